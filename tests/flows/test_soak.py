"""Soak: many nights, each a whole run that imports a new day, makes a warm-started model version,
checkpoints, downloads and gates it; memory stays flat, no file descriptor, thread or file on
disk is left behind, and only the newest versions keep their checkpoints.

Bounded: CYCLES runs of one epoch each (a few seconds per run on 2 cores).
"""

from __future__ import annotations

import collections
import ctypes
import gc
import os
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


def open_files() -> collections.Counter:
    """What this process's file descriptors point at (a path, or a socket's or pipe's kind), counted."""
    found = collections.Counter()
    for fd in os.listdir("/proc/self/fd"):
        try:
            found[os.readlink(f"/proc/self/fd/{fd}").split(":[")[0]] += 1
        except OSError:  # the listing's own descriptor, closed since
            pass
    return found


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
        seen.append({"rss": resident_mb(), "fds": open_files(), "threads": threading.active_count(),
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
    # A leak grows night after night; a socket or thread the session's other parts (its cluster, the Prefect
    # harness) hold at one reading is gone at the next (the suite saw 161-169 descriptors over the nights, the
    # soak alone 89-91): the last three nights' lowest count is judged, which a leak of one a night still fails.
    fds = [sum(s["fds"].values()) for s in seen]
    low = min(range(len(seen) - 3, len(seen)), key=fds.__getitem__)
    assert fds[low] <= fds[WARM - 1] + 2, (fds, dict(seen[low]["fds"] - base["fds"]))
    threads = [s["threads"] for s in seen]
    assert min(threads[-3:]) <= base["threads"] + 2, threads
    assert all(s["actors"] == 0 for s in seen)
    print("\nsoak (MB, fds, threads per run):",
          [(round(s["rss"]), n, s["threads"]) for s, n in zip(seen, fds, strict=True)],
          "workers MB:", [[round(mb) for mb in s["workers"].values()] for s in seen])
