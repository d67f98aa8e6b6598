"""The tasks are adapters: what they add to the core is Prefect's — a lost worker handed back as a result and
raised again in the flow, and the core's findings said in the run's log."""

from __future__ import annotations

import logging

import pytest
from prefect import flow

from shardflow.errors import WorkerLost
from tasks.retrain import tidy
from tasks.training import Lost, unless_lost


def test_a_lost_worker_handed_back_as_a_result_is_raised_again_in_the_flow():
    assert unless_lost("checkpoints/0002") == "checkpoints/0002"
    with pytest.raises(WorkerLost, match="^tcp://127.0.0.1:4242 left the cluster$"):
        unless_lost(Lost("tcp://127.0.0.1:4242 left the cluster"))


def test_tidy_removes_a_cut_off_runs_leftovers_and_says_which(prefect_api, tmp_path, caplog):
    run = tmp_path / "run"
    (run / "checkpoints" / ".0003.staging-0123456789ab").mkdir(parents=True)
    (run / ".profile.replaced-ba9876543210").mkdir()
    (run / "profile").mkdir()  # a complete store: kept

    @flow
    def sweep():
        tidy(str(run))

    with caplog.at_level(logging.WARNING):
        sweep()
    assert sorted(p.name for p in run.rglob("*")) == ["checkpoints", "profile"]
    assert ("removed 2 unfinished stores a cut-off run left behind: .profile.replaced-ba9876543210, "
            ".0003.staging-0123456789ab") in caplog.text
