"""Soak: many short epochs, each a whole run that resumes from the last checkpoint, checkpoints and
downloads; memory stays flat, no file descriptor, thread or file on disk is left behind.

Bounded: CYCLES runs of one epoch each (about 3 s per run on 2 cores).
"""

from __future__ import annotations

import threading

import psutil
from flows.retrain import retrain
from runs import SMALL, TOPOLOGY, live_actors
from shardflow.config import RetrainConfig
from shardflow.synthetic import SynthTable
from storage.checkpoint import verify_export
from storage.synth import synth_dataset

CYCLES = 12
WARM = 3  # runs before the baseline: imports, caches and the first allocations settle
RSS_GROWTH_MB = 20  # allowed growth of the flow process over the last CYCLES - WARM runs (measured: 9)
WORKER_GROWTH_MB = 20


def worker_rss(client) -> dict[str, float]:
    return client.run(lambda: __import__("psutil").Process().memory_info().rss / 2**20)


def test_many_resumed_runs_keep_memory_flat_and_leak_nothing(prefect_api, client, tmp_path):
    synth_dataset(tmp_path / "ds", [SynthTable("item", 400, 1.1)], interactions=4000, seed=8, mean_length=10)
    (tmp_path / "topo.yaml").write_text(TOPOLOGY)
    run = tmp_path / "run"
    me = psutil.Process()
    seen = []
    for cycle in range(1, CYCLES + 1):
        summary = retrain(RetrainConfig.build({
            **SMALL, "dataset": str(tmp_path / "ds"), "run_dir": str(run), "topology": str(tmp_path / "topo.yaml"),
            "scheduler_address": client.scheduler.address, "epochs": cycle, "eval_users": 50,
        }))
        assert summary["epochs"] == cycle and len(summary["epoch_loss"]) == 1 and summary["downloads"] == 1
        assert summary["resumed_from"] == (str(run / "checkpoints" / f"epoch-{cycle - 1:06d}") if cycle > 1 else None)
        verify_export(run / "model")
        files = sorted(str(p.relative_to(run)) for p in run.rglob("*") if p.is_file())
        seen.append({"rss": me.memory_info().rss / 2**20, "fds": me.num_fds(), "threads": threading.active_count(),
                     "workers": worker_rss(client), "files": files, "actors": live_actors(client)})

    checkpoint_files = [len([f for f in s["files"] if f.startswith("checkpoints/")]) for s in seen]
    assert checkpoint_files == [checkpoint_files[0] * (i + 1) for i in range(CYCLES)]  # one more checkpoint per run
    rest = [sorted(f for f in s["files"] if not f.startswith("checkpoints/") and not f.startswith("plots/")) for s in seen]
    assert all(r == rest[0] for r in rest), "files other than the new checkpoint appeared or vanished"
    assert not [f for f in seen[-1]["files"] if ".staging-" in f or ".replaced-" in f]
    base, last = seen[WARM - 1], seen[-1]
    assert last["rss"] - base["rss"] < RSS_GROWTH_MB, [round(s["rss"]) for s in seen]
    for address, mb in last["workers"].items():
        if address in base["workers"]:
            assert mb - base["workers"][address] < WORKER_GROWTH_MB, [s["workers"] for s in seen]
    assert last["fds"] <= base["fds"] + 2, [s["fds"] for s in seen]
    assert last["threads"] <= base["threads"] + 2, [s["threads"] for s in seen]
    assert all(s["actors"] == 0 for s in seen)
    print("\nsoak (MB, fds, threads per run):", [(round(s["rss"]), s["fds"], s["threads"]) for s in seen],
          "workers MB:", [round(sum(s["workers"].values())) for s in seen])
