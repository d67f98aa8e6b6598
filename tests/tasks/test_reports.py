"""What the operator reads of a night (tasks/reports.py), built from a run summary without a server."""

from __future__ import annotations

from shardflow.reporting.summary import RunSummary
from tasks.reports import state_message
from support import TRAINED


def test_the_run_state_names_the_figure_the_gate_compared():
    summary = RunSummary.parse({**TRAINED, "promoted": False, "promoted_on": "full_ndcg_at_10", "current": 1})
    assert state_message(summary) == ("rejected v2: full-catalog NDCG@10 0.0300 vs v1's 0.0250 on the same 500 "
                                      "held-out events; v1 stays current")
    before = RunSummary.parse({k: v for k, v in TRAINED.items() if k != "promoted_on"})  # gated on AUC
    assert state_message(before).startswith("promoted v2: AUC 0.8100 vs v1's 0.8000")
