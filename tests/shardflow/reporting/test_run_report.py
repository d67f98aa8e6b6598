"""What the operator reads of a night (shardflow/reporting/run_report.py), built from a run summary without a server."""

from __future__ import annotations

from shardflow.reporting.run_report import outcome, state_message
from shardflow.reporting.summary import RunSummary
from support import TRAINED


def test_the_run_state_names_the_outcome_and_says_the_verdict_first_in_under_70_characters():
    summary = RunSummary.parse({**TRAINED, "promoted": False, "promoted_on": "full_ndcg_at_10", "current": 1})
    assert state_message(summary) == "rejected v2: full NDCG@10 0.0300 < v1's 0.0250; v1 stays"
    assert outcome(summary) == "Rejected"
    before = RunSummary.parse({k: v for k, v in TRAINED.items() if k != "promoted_on"})  # gated on AUC
    assert state_message(before) == "promoted v2: AUC 0.8100 vs v1's 0.8000" and outcome(before) == "Promoted"
    cold = RunSummary.parse({**TRAINED, "warm_start_from": None, "previous_auc": None})
    idle = RunSummary.parse({**TRAINED, "trained": False, "newest_version": 2, "current": 1})
    assert state_message(cold) == "promoted v2 (cold start): AUC 0.8100" and outcome(idle) == "No new data"
    worst = RunSummary.parse({**TRAINED, "version": 10_000, "warm_start_from": 9_999, "current": 9_999,
                              "promoted": False, "promoted_on": "full_ndcg_at_10"})
    assert all(len(state_message(s)) < 70 for s in (summary, before, cold, idle, worst))
