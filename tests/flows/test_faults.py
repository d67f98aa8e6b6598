"""Faults caused for real: a worker process killed mid-epoch, the run's own process killed while a
checkpoint or the download is being written, chunks truncated or deleted, two runs on one run_dir.

The item table has 10^6 rows, so a checkpoint or an export takes long enough to be cut in
the middle; the model is small, so every run takes seconds.
"""

from __future__ import annotations

import os
import shutil
import signal
import threading
import time
from pathlib import Path

import pytest

from flows.retrain import retrain
from runs import SMALL, TOPOLOGY, exported, live_actors, run_until_killed, task_run_states, task_runs
from shardflow.cluster import dask_client
from shardflow.config import RetrainConfig
from shardflow.data.batches import TrainData
from shardflow.data.synthetic import SynthTable
from shardflow.errors import InputError
from storage import versions
from storage.checkpoint import checkpoint_dir, complete_checkpoints, verify_export
from storage.lock import run_lock
from storage.manifest import MANIFEST
from support import snapshot

pytestmark = pytest.mark.fault  # the tier: killed, interrupted or starved processes

ROWS = 1_000_000


def first_version(run: Path) -> Path:
    return versions.version_dir(run, 1)


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    from shardflow.data.synthetic import synth_dataset

    root = tmp_path_factory.mktemp("faults")
    synth_dataset(root / "ds", [SynthTable("item", ROWS, 1.1)], interactions=8000, seed=3, mean_length=12)
    (root / "topo.yaml").write_text(TOPOLOGY)
    return root


def values(big: Path, run: str, client, **kw) -> dict:
    return {**SMALL, "dataset": str(big / "ds"), "run_dir": str(big / run), "topology": str(big / "topo.yaml"),
            "scheduler_address": client.scheduler.address, **kw}


def config(big: Path, run: str, client, **kw) -> RetrainConfig:
    return RetrainConfig.build(values(big, run, client, **kw))


@pytest.fixture(scope="module")
def whole(prefect_api, client, big):
    """The uninterrupted run every faulty one must end up equal to."""
    summary = retrain(config(big, "whole", client))
    assert summary["restarts"] == 0 and summary["resumed_from"] is None and summary["downloads"] == 1
    return exported(first_version(big / "whole") / "model")


@pytest.mark.parametrize("transport", ["actor", "collective"])
def test_a_worker_killed_mid_epoch_is_restored_from_the_last_checkpoint(prefect_api, client, big, whole, transport):
    """With the collective transport the killed worker's peers are inside a gloo wait on it: its closed
    sockets end the wait, and the restore forms a new group."""
    per_epoch = TrainData.load(str(big / "ds"), ()).steps_per_epoch(SMALL["batch_size"])
    killed = {}

    def kill_in_the_second_epoch():
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            # A worker whose actor is still being made may not answer: ask again, as the killer below.
            seen = client.run(lambda dask_worker: (os.getpid(), [
                a.device.shard.clock for a in dask_worker.state.actors.values() if hasattr(a, "device")]),
                on_error="ignore")
            for address, (pid, clocks) in sorted(seen.items()):
                if clocks and clocks[0] >= per_epoch + 3:
                    os.kill(pid, signal.SIGKILL)
                    killed.update(address=address, step=clocks[0])
                    return
            time.sleep(0.01)

    killer = threading.Thread(target=kill_in_the_second_epoch)
    killer.start()
    state = retrain(config(big, f"worker-killed-{transport}", client, transport=transport), return_state=True)
    killer.join()
    summary = state.result()
    assert per_epoch + 3 <= killed["step"] < 2 * per_epoch, (killed, per_epoch)  # mid-epoch, after checkpoint 1
    assert summary["restarts"] == 1
    names = task_runs(state.state_details.flow_run_id)
    assert names.count("train-epoch-2") == 2 and names.count("train-epoch-1") == 1 and "restore-cluster-1" in names
    # The recovered loss is a warning in the summary, not a red task inside a Completed run.
    assert {state for name, state in task_run_states(state.state_details.flow_run_id)} == {"COMPLETED"}
    assert len(summary["warnings"]) == 1 and summary["warnings"][0].startswith("restart 1: ")
    assert names.count("download") == 1
    assert exported(summary["model"]) == whole
    assert [p.name for _, p in complete_checkpoints(first_version(big / f"worker-killed-{transport}"))] == [
        "epoch-000001",
        "epoch-000002",
    ]
    client.wait_for_workers(4, timeout=60)
    assert live_actors(client) == 0


def test_losing_workers_more_than_max_restarts_fails_and_keeps_the_checkpoints(prefect_api, big):
    # A cluster of its own: the killer SIGKILLs every worker holding an actor, several times a
    # second, and a nanny whose fresh worker is killed while it starts may give up on it.
    with dask_client(workers=2) as own:
        def kill_every_shard_worker():
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline and not done.is_set():
                # A worker killed during the call is left out (its error ignored): by default it would raise
                # here and end this thread, and the run would then finish unharmed.
                seen = own.run(lambda dask_worker: (os.getpid(), len(dask_worker.state.actors)), on_error="ignore")
                for pid, actors in seen.values():
                    if actors:
                        os.kill(pid, signal.SIGKILL)
                time.sleep(0.3)

        done = threading.Event()
        killer = threading.Thread(target=kill_every_shard_worker)
        killer.start()
        try:
            state = retrain(config(big, "keeps-dying", own, max_restarts=1, epochs=1), return_state=True)
        finally:
            done.set()
            killer.join()
    assert state.is_failed()
    with pytest.raises(Exception, match=r"lost a worker 2 times .*max_restarts = 1 reached; no checkpoint of "
                                        r".*keeps-dying/versions/0001 was complete yet: a new run starts it"):
        state.result()
    assert (
        not (first_version(big / "keeps-dying") / "model").exists() and not (big / "keeps-dying" / "current").exists()
    )


def test_a_run_killed_while_writing_a_checkpoint_resumes_from_the_one_before(prefect_api, client, big, whole):
    run = big / "cut-checkpoint"
    version = first_version(run)
    env = {**os.environ, "PREFECT_API_URL": prefect_api}
    second = checkpoint_dir(version, 2)

    def writing_second_checkpoint() -> bool:
        stages = list(second.parent.glob(f".{second.name}.staging-*/shards/*/item"))
        return bool(stages) and not second.exists()

    run_until_killed(values(big, "cut-checkpoint", client), env, writing_second_checkpoint, big / "cut-checkpoint-log")
    assert [p.name for _, p in complete_checkpoints(version)] == ["epoch-000001"]
    assert not second.exists() and not (version / "model").exists() and not (run / "current").exists()
    assert (run / "run.lock").is_file()  # the killed run's lock, released by the kernel

    state = retrain(config(big, "cut-checkpoint", client), return_state=True)
    summary = state.result()
    assert summary["resumed_from"] == str(checkpoint_dir(version, 1)) and summary["skipped_checkpoints"] == []
    names = task_runs(state.state_details.flow_run_id)
    assert "train-epoch-1" not in names and names.count("train-epoch-2") == 1
    assert summary["version"] == 1 and summary["promoted"] and exported(version / "model") == whole
    assert sorted(p.name for p in (version / "checkpoints").iterdir()) == ["epoch-000001", "epoch-000002"]


def test_a_version_cut_off_goes_on_from_its_checkpoint_on_the_devices_left(prefect_api, client, big, whole):
    """A node lost for good: the next run, given a topology of the devices left, resumes the version from its last
    checkpoint on a new plan, and ends with the model of the uninterrupted run (float32 rounding apart)."""
    import numpy as np

    run = big / "fewer-devices"
    version = first_version(run)
    first = checkpoint_dir(version, 1)
    env = {**os.environ, "PREFECT_API_URL": prefect_api}
    run_until_killed(values(big, run.name, client), env, lambda: (first / MANIFEST).is_file(), big / f"{run.name}-log")
    kept = snapshot(first)
    (big / "one.yaml").write_text(TOPOLOGY.split("  - {name: b")[0])

    state = retrain(config(big, run.name, client, topology=str(big / "one.yaml")), return_state=True)
    summary = state.result()
    assert summary["resumed_from"] == str(first) and summary["version"] == 1 and summary["restarts"] == 0
    assert summary["replanned"] and summary["replan_reason"] == "the topology changed (2 devices → 1)"
    names = task_runs(state.state_details.flow_run_id)
    assert "train-epoch-1" not in names and names.count("train-epoch-2") == 1
    assert versions.started(run, 1).config["topology"]["nodes"] == [{"name": "a", "devices": 1,
                                                                        "uplink_gbytes_per_s": 10.0}]
    assert snapshot(first) == kept  # the checkpoint it went on from is untouched
    moved = exported(version / "model")
    for k, v in whole.items():
        a, b = np.frombuffer(v, np.float32), np.frombuffer(moved[k], np.float32)
        print(f"\n{k}: largest difference from the uninterrupted run {np.abs(a - b).max() / np.abs(a).max():.1e} "
              "of its largest value")
        assert np.abs(a - b).max() <= 1e-4 * np.abs(a).max(), k


def test_a_run_killed_during_the_download_leaves_no_model_and_a_rerun_completes_it(prefect_api, client, big, whole):
    run = big / "cut-download"
    version = first_version(run)
    env = {**os.environ, "PREFECT_API_URL": prefect_api}

    def exporting() -> bool:
        return bool(list(version.glob(".model.staging-*/tables/item/c")))

    run_until_killed(values(big, "cut-download", client), env, exporting, big / "cut-download-log")
    partial = next(version.glob(".model.staging-*"))
    with pytest.raises(InputError, match="incomplete"):
        verify_export(partial)
    assert not (version / "model").exists() and not (run / "current").exists()  # nothing half-promoted

    state = retrain(config(big, "cut-download", client), return_state=True)
    names = task_runs(state.state_details.flow_run_id)
    assert not any(n.startswith("train-epoch") for n in names) and names.count("download") == 1
    assert exported(version / "model") == whole and state.result()["current"] == 1
    assert not list(version.glob(".model.*"))  # the partial export was removed
    uninterrupted = versions.result(big / "whole", 1)["epoch_loss"]  # the cut run trained both epochs
    assert state.result()["epoch_loss"] == uninterrupted and len(uninterrupted) == SMALL["epochs"]


def test_truncated_and_deleted_chunks_are_found_and_the_resume_falls_back(prefect_api, client, big, whole):
    run = big / "damaged"
    shutil.copytree(big / "whole", run, ignore=shutil.ignore_patterns("run.lock"), symlinks=True)
    version = first_version(run)
    chunk = next(
        p for p in sorted((checkpoint_dir(version, 2) / "shards").rglob("item/weights/c/*/*")) if p.stat().st_size
    )
    chunk.write_bytes(chunk.read_bytes()[: chunk.stat().st_size // 2])
    gone = sorted((version / "model" / "tables" / "item" / "c").rglob("*"))[-1]
    gone.unlink()
    with pytest.raises(InputError, match=r"tables/item/\d+: rows \d+\.\. do not match their checksum"):
        verify_export(version / "model")
    # As a kill before the version's result leaves it: unfinished, nothing promoted.
    (version / "result.json").unlink()
    (run / "current").unlink()

    state = retrain(config(big, "damaged", client), return_state=True)
    summary = state.result()
    assert summary["resumed_from"] == str(checkpoint_dir(version, 1))
    [skipped] = summary["skipped_checkpoints"]
    assert skipped["checkpoint"] == str(checkpoint_dir(version, 2)) and "weights" in skipped["reason"]
    assert exported(version / "model") == whole
    verify_export(version / "model")
    assert [p.name for _, p in complete_checkpoints(version)] == ["epoch-000001", "epoch-000002"]


def test_a_truncated_manifest_of_the_newest_checkpoint_falls_back_to_the_one_before(prefect_api, client, big, whole):
    """As a damaged chunk does: the run resumes from the checkpoint before, names the one it skipped and ends
    with the uninterrupted run's model (a manifest cut short once stopped the run in one line, exit 2)."""
    run = big / "truncated-manifest"
    shutil.copytree(big / "whole", run, ignore=shutil.ignore_patterns("run.lock"), symlinks=True)
    version = first_version(run)
    manifest = checkpoint_dir(version, 2) / MANIFEST
    manifest.write_bytes(manifest.read_bytes()[: manifest.stat().st_size // 2])
    (version / "result.json").unlink()
    (run / "current").unlink()
    shutil.rmtree(version / "model")

    summary = retrain(config(big, "truncated-manifest", client))
    assert summary["resumed_from"] == str(checkpoint_dir(version, 1))
    [skipped] = summary["skipped_checkpoints"]
    assert skipped["checkpoint"] == str(checkpoint_dir(version, 2)) and "not valid JSON" in skipped["reason"]
    assert exported(version / "model") == whole and summary["epoch_loss"] == \
        versions.result(big / "whole", 1)["epoch_loss"]
    assert [p.name for _, p in complete_checkpoints(version)] == ["epoch-000001", "epoch-000002"]


def test_a_second_run_on_the_same_run_dir_is_refused_and_a_dead_holder_leaves_no_lock(
    prefect_api, client, big, whole, tmp_path
):
    run = big / "whole"
    before = snapshot(run)
    with run_lock(run):
        state = retrain(config(big, "whole", client), return_state=True)
        assert state.is_failed()
        with pytest.raises(InputError, match=rf"run_dir {run} is in use by another run \(host .*, pid {os.getpid()}"):
            state.result()
    assert snapshot(run) == before

    import subprocess
    import sys

    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from storage.lock import run_lock\n"
                               f"with run_lock({str(tmp_path)!r}):\n    print('held', flush=True); time.sleep(600)"],
                              stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[2])
    assert holder.stdout.readline() == "held\n"
    with pytest.raises(InputError, match=f"pid {holder.pid}"):
        with run_lock(tmp_path):
            pass
    holder.kill()
    holder.wait()
    with run_lock(tmp_path) as path:  # the crashed holder's lock went with its process
        assert f"pid {os.getpid()}" in path.read_text()
    assert path.read_text() == ""
    assert not (tmp_path / MANIFEST).exists()


def test_a_run_with_another_dimension_on_a_run_dir_with_a_model_is_refused_before_writing(
    prefect_api, client, big, whole
):
    run = big / "whole"
    before = snapshot(run)
    state = retrain(config(big, "whole", client, dim=16), return_state=True)
    assert state.is_failed()
    with pytest.raises(
        InputError, match=r"current model version 1 has dim = 8, this run dim = 16; .*Accepted: the same"
    ):
        state.result()
    assert snapshot(run) == before


def test_a_run_while_other_processes_keep_every_core_busy_completes_without_a_restart(prefect_api, client, big):
    """A worker is declared lost only when the scheduler no longer has it (asked afresh, never from the
    client's cache) or the scheduler stops answering for its reconnect window: CPU contention reaches neither
    (under 6 busy processes on 2 cores the scheduler answered within 14 ms, worst of 566 requests)."""
    import subprocess
    import sys

    busy = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2 * len(os.sched_getaffinity(0)))
    ]
    try:
        state = retrain(config(big, "loaded", client), return_state=True)
    finally:
        for p in busy:
            p.kill()
            p.wait()
    summary = state.result()
    assert summary["restarts"] == 0 and summary["warnings"] == [], summary["warnings"]
    assert {s for _, s in task_run_states(state.state_details.flow_run_id)} == {"COMPLETED"}
