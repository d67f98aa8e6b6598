"""The sequence metrics against a hand count: AUC, HR@10 and NDCG@10 of the positive among its candidates."""

from __future__ import annotations

import math

import numpy as np

from shardflow.data.batches import TrainData
from shardflow.model.metrics import Metrics, hits


def scores_with_rank(rank: int, candidates: int = 101) -> np.ndarray:
    """One example's logits, column 0 the positive, with exactly `rank` negatives above it."""
    logit = np.zeros(candidates, dtype=np.float32)
    logit[0] = 0.5
    logit[1 : 1 + rank] = 1.0
    return logit


def test_hr_and_ndcg_at_10_count_the_positive_rank():
    ranks = [0, 1, 9, 10, 50]
    auc, hit, ndcg = hits(np.stack([scores_with_rank(r) for r in ranks]))
    assert hit == 3  # ranks 0, 1 and 9 are in the top 10
    assert math.isclose(ndcg, 1.0 + 1 / math.log2(3) + 1 / math.log2(11), rel_tol=1e-12)
    assert auc == 1.0  # the first negative scores above the positive except at rank 0


def test_the_merged_metrics_are_means_over_the_held_out_items():
    parts = [TrainData.scored.of(np.stack([scores_with_rank(0)])),
             TrainData.scored.of(np.stack([scores_with_rank(3), scores_with_rank(20)]))]
    m = sum(parts, TrainData.scored()).metrics()
    assert m.users == 3 and math.isclose(m.hr_at_10, 2 / 3) and m.logloss is None
    assert math.isclose(m.ndcg_at_10, (1.0 + 1 / math.log2(5)) / 3)
    assert m.text() == f"AUC {m.auc:.4f}, HR@10 {m.hr_at_10:.4f}, NDCG@10 {m.ndcg_at_10:.4f}"
    assert Metrics.read({"auc": 0.8, "hr_at_10": 0.5}).text() == "AUC 0.8000, HR@10 0.5000"  # before NDCG@10
    assert Metrics(0.71, 9, logloss=0.49).text() == "AUC 0.7100, log-loss 0.4900"


def test_ties_count_against_the_positive_constant_logits_give_ten_over_the_candidates():
    """A diverged model scoring every candidate alike is not a perfect one: HR@10 is 10 / 101, as chance."""
    auc, hit, ndcg = hits(np.zeros((7, 101), dtype=np.float32))
    assert math.isclose(hit / 7, 10 / 101, rel_tol=1e-12)
    assert math.isclose(ndcg / 7, sum(1 / math.log2(r + 2) for r in range(10)) / 101, rel_tol=1e-12)
    assert auc == 3.5  # against the first negative: half of each tie


def test_a_tie_shares_the_ranks_it_spans_and_strict_order_is_unchanged():
    logit = scores_with_rank(8)
    logit[9:12] = 0.5  # three negatives tie with the positive: ranks 8 .. 11 equally likely
    _, hit, ndcg = hits(logit[None])
    assert math.isclose(hit, 2 / 4) and math.isclose(ndcg, (1 / math.log2(10) + 1 / math.log2(11)) / 4)
    oracle = [hits(scores_with_rank(r)[None])[1:] for r in range(15)]  # no ties: exactly the old count
    assert [h for h, _ in oracle] == [1.0] * 10 + [0.0] * 5
