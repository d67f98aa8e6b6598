"""Soak: many nights, each a whole run that imports a new day, makes a warm-started model version,
checkpoints, downloads and gates it; memory stays flat, no file descriptor, thread or file on
disk is left behind, and only the newest versions keep their checkpoints.

Bounded: CYCLES runs of one epoch each (a few seconds per run on 2 cores).
"""

from __future__ import annotations

import ctypes
import gc
import threading
from pathlib import Path

import numpy as np
import psutil
import pytest

from flows.retrain import retrain
from runs import SMALL, TOPOLOGY, live_actors
from shardflow.cluster import dask_client
from shardflow.config import RetrainConfig
from storage import versions
from storage.checkpoint import verify_export
from support import CYCLES, WARM, WORKER_GROWTH_MB, settled, worker_growth_mb

pytestmark = pytest.mark.fault  # the tier: killed, interrupted or starved processes

RSS_GROWTH_MB = 20  # allowed growth of the flow process over the last CYCLES - WARM runs (measured: 3-4)
KEEP = 3  # keep_versions


def resident_mb() -> float:
    """This process's resident memory once garbage is collected and glibc has handed its free pages back
    (malloc_trim, as Dask's docs advise for unmanaged memory): live memory, not the allocator's free lists."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    return psutil.Process().memory_info().rss / 2**20


def worker_rss(client) -> dict[str, float]:
    return client.run(resident_mb)


def write_day(path: Path, day: int) -> None:
    """One day's sasrec log: 300 users (a third of them new each day), 10 events each, Zipf-read items."""
    rng = np.random.default_rng(day)
    users = np.repeat(rng.integers(0, 200 + 100 * day, 300), 10)
    items = np.minimum(rng.zipf(1.3, users.size), 400)
    np.savetxt(path, np.stack([np.sort(users, kind="stable"), items], axis=1), fmt="%d")
    settled(path)  # finished a while ago, as a night's part is when its run starts


@pytest.fixture
def own_client():
    """A cluster of the soak's own, as a scheduler kept for nights would be: the session's workers carry what
    the tests before this one left in their heaps (CI saw them at 516-659 MB where fresh ones start at
    486-540), and one of them grew 29 MB over the last nights where fresh workers grow 1-7."""
    with dask_client(workers=4) as c:
        yield c


def worker_series(seen: list[dict]) -> str:
    """Each worker's resident MB, run by run, in full (pytest shortens a long repr in a failure)."""
    return "; ".join(f"{a}: {[round(s['workers'].get(a, 0)) for s in seen]}" for a in seen[-1]["workers"])


def test_many_nightly_runs_keep_memory_flat_and_leak_nothing(prefect_api, own_client, tmp_path):
    (tmp_path / "topo.yaml").write_text(TOPOLOGY)
    parts, run = tmp_path / "parts", tmp_path / "run"
    parts.mkdir()
    me = psutil.Process()
    seen = []
    for cycle in range(1, CYCLES + 1):
        write_day(parts / f"day-{cycle:02d}.txt", cycle)
        summary = retrain(RetrainConfig.build({
            **SMALL, "dataset": str(parts), "run_dir": str(run), "topology": str(tmp_path / "topo.yaml"),
            "scheduler_address": own_client.scheduler.address, "epochs": 1, "eval_users": 50, "keep_versions": KEEP,
        }))
        assert summary["version"] == cycle and summary["parts_added"] == [f"day-{cycle:02d}.txt"]
        assert summary["downloads"] == 1 and len(summary["epoch_loss"]) == 1
        verify_export(run / "current" / "model")
        files = sorted(str(p.relative_to(run)) for p in run.rglob("*") if p.is_file())
        seen.append({"rss": resident_mb(), "fds": me.num_fds(), "threads": threading.active_count(),
                     "workers": worker_rss(own_client), "files": files, "actors": live_actors(own_client),
                     "current": versions.current(run)})

    for s in seen:  # retention: checkpoints of the newest KEEP versions and of the current one, no more
        kept = {int(f.split("/")[1]) for f in s["files"] if "/checkpoints/" in f}
        newest = max(int(f.split("/")[1]) for f in s["files"] if f.startswith("versions/"))
        assert kept == set(range(max(1, newest - KEEP + 1), newest + 1)) | {s["current"]}, (kept, s["current"])
    assert not [f for f in seen[-1]["files"] if ".staging-" in f or ".replaced-" in f]
    base, last = seen[WARM - 1], seen[-1]
    assert last["rss"] - base["rss"] < RSS_GROWTH_MB, [round(s["rss"]) for s in seen]
    grown = worker_growth_mb(base["workers"], last["workers"])
    assert grown and max(grown.values()) < WORKER_GROWTH_MB, worker_series(seen)
    assert last["fds"] <= base["fds"] + 2, [s["fds"] for s in seen]
    assert last["threads"] <= base["threads"] + 2, [s["threads"] for s in seen]
    assert all(s["actors"] == 0 for s in seen)
    print("\nsoak (MB, fds, threads per run):", [(round(s["rss"]), s["fds"], s["threads"]) for s in seen],
          "workers MB:", [[round(mb) for mb in s["workers"].values()] for s in seen])
