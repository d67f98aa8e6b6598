"""The run summary: one typed value, parsed where it crosses JSON (result.json, the flow's result, --json)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from shardflow.errors import InputError
from shardflow.model.metrics import Metrics
from shardflow.reporting.summary import RUN_KEYS, RunSummary
from support import TRAINED


def test_the_json_form_reads_back_to_the_same_value_with_every_key_as_before():
    summary = RunSummary.parse(TRAINED)
    assert summary.window == (1, 1) and summary.training.epoch_loss == (0.5, 0.4, 0.35)  # lists become tuples
    assert summary.to_dict() == TRAINED  # newest_version only where a run trained nothing
    assert RunSummary.parse(json.loads(json.dumps(summary.to_dict()))) == summary
    assert set(summary.stored()) == set(TRAINED) - set(RUN_KEYS)
    assert summary.previous == Metrics(0.8, hr_at_10=0.48, ndcg_at_10=0.28, full_ranking="exclude-seen",
                                                   full_hr_at_10=0.05, full_ndcg_at_10=0.025, full_hr_at_20=0.08,
                                                   full_ndcg_at_20=0.035)
    idle = dataclasses.replace(summary, trained=False, newest_version=3)
    assert idle.to_dict()["newest_version"] == 3


def test_a_key_a_version_made_before_it_existed_lacks_is_none_and_an_unknown_key_is_left_out():
    older = {k: v for k, v in TRAINED.items()
             if not k.startswith(("val_", "previous_n", "full_", "previous_full")) and k != "best_epoch"}
    summary = RunSummary.parse({**older, "retired_key": 1})
    assert (summary.validation.auc, summary.training.best_epoch, summary.previous.ndcg_at_10) == (None, None, None)
    assert summary.held_out.full_hr_at_10 is None
    assert summary.held_out.text() == "AUC 0.8100, HR@10 0.5000, NDCG@10 0.3000"
    assert "retired_key" not in summary.to_dict()


@pytest.mark.parametrize(
    ("change", "refusal"),
    [
        ({"auc": "0.81"}, "auc = '0.81'; accepted: int or float"),
        ({"version": True}, "version = True; accepted: int"),
        ({"promoted": 1}, "promoted = 1; accepted: bool"),
        ({"window": [1, "a"]}, "window = 'a'; accepted: int"),
        ({"best_epoch": 2.5}, "best_epoch = 2.5; accepted: int or none"),
        ({"auc": None}, "auc = None; accepted: int or float"),
    ],
)
def test_a_bad_value_is_refused_naming_the_file_and_the_key(change, refusal):
    with pytest.raises(InputError, match=f"^versions/0002/result.json: {refusal}"):
        RunSummary.parse({**TRAINED, **change}, "versions/0002/result.json")


def test_a_missing_key_without_a_default_or_not_an_object_is_refused():
    with pytest.raises(InputError, match="result.json: auc = missing; accepted: int or float"):
        RunSummary.parse({k: v for k, v in TRAINED.items() if k != "auc"}, "result.json")
    with pytest.raises(InputError, match="result.json: a list; accepted: a JSON object"):
        RunSummary.parse([], "result.json")
