"""The promotion gate's rule, on the figure the config names: worse beyond the margin stays unpromoted."""

from __future__ import annotations

import pytest

from shardflow.config import RetrainConfig
from shardflow.errors import InputError
from shardflow.model.metrics import Metrics
from shardflow.promotion import judge, rejection

NEW = Metrics(0.80, full_ndcg_at_10=0.030)
CURRENT = Metrics(0.79, full_ndcg_at_10=0.035)


def test_each_figure_decides_on_its_own_within_the_margin():
    assert judge(NEW, CURRENT, "auc", 0.0).promoted  # better AUC
    by_ranking = judge(NEW, CURRENT, "full_ndcg_at_10", 0.002)
    assert not by_ranking.promoted and (by_ranking.new, by_ranking.previous) == (0.030, 0.035)
    assert judge(NEW, CURRENT, "full_ndcg_at_10", 0.006).promoted  # 0.030 >= 0.035 - 0.006
    assert judge(NEW, None, "full_ndcg_at_10", 0.0).promoted  # a cold start
    assert rejection(by_ranking, 4, 3, 0.002) == ("version 4 not promoted: full-catalog NDCG@10 0.0300 is below "
                                                 "version 3's 0.0350 by more than promotion_margin 0.002; version "
                                                 "3 stays current")


@pytest.mark.parametrize("values", [{"dataset_format": "criteo"}, {"full_ranking": "off"}])
def test_gating_on_the_full_catalog_needs_a_ranked_sequence_model(values):
    with pytest.raises(InputError, match=r"promote_on = 'full_ndcg_at_10' with .*accepted: auc, or a sequence"):
        RetrainConfig.build({"promote_on": "full_ndcg_at_10", **values})
    assert RetrainConfig.build({"promote_on": "full_ndcg_at_10"}).nightly.promote_on == "full_ndcg_at_10"
