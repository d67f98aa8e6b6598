"""A run's workers keep large buffers on the heap where Dask's nanny pinned glibc's mmap threshold
(shardflow.heap), and only while the run's cluster is open."""

from __future__ import annotations

import ctypes
import json
import os
import platform
import subprocess
import sys

import dask
import pytest
from distributed import Client, LocalCluster

from shardflow.cluster import LOOPBACK_DASHBOARD, dask_client, run_cluster
from shardflow.heap import pinned

# Unmarked tests are in the unit tier (tests/conftest.py: tier).
pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt and mallinfo2")

MIB = 1 << 20
DASKS_OWN = {"distributed.worker.multiprocessing-method": "spawn",
             "distributed.nanny.pre-spawn-environ.MALLOC_TRIM_THRESHOLD_": 65536}


class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]


def mmapped(size: int = MIB) -> bool:
    """Whether this process's malloc gives a buffer of `size` bytes its own mmap now (glibc's count of mmapped
    chunks while it is held)."""
    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = MallInfo2
    libc.malloc.restype = ctypes.c_void_p
    before = libc.mallinfo2().hblks
    buffer = libc.malloc(size)
    try:
        return bool(libc.mallinfo2().hblks > before)
    finally:
        libc.free(ctypes.c_void_p(buffer))


PLUGIN = """
import json
from shardflow.heap import HeapThresholds
from test_heap import mmapped

plugin = HeapThresholds()
seen = [mmapped()]
plugin.setup(None)
seen += [plugin.applied, mmapped()]
plugin.teardown(None)
print(json.dumps(seen + [mmapped()]))
"""


TWO = """
import json
from shardflow.heap import HeapThresholds
from test_heap import mmapped

first, second = HeapThresholds(), HeapThresholds()
first.setup(None)
second.setup(None)
first.teardown(None)
seen = [mmapped()]
second.teardown(None)
print(json.dumps(seen + [mmapped()]))
"""


def plugin_in(env: dict[str, str], script: str = PLUGIN) -> list[bool]:
    """[mmapped before, applied, mmapped while set up, mmapped after teardown] in a process with `env`."""
    path = os.pathsep.join([os.path.dirname(__file__), os.getcwd()])
    done = subprocess.run([sys.executable, "-c", script], env={**env, "PYTHONPATH": path}, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def without_malloc_settings() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}


def test_with_the_nannys_trim_threshold_a_mib_is_mmapped_until_the_plugin_sets_the_thresholds():
    env = {**without_malloc_settings(), "MALLOC_TRIM_THRESHOLD_": "65536"}
    assert plugin_in(env) == [True, True, False, True]


def test_the_thresholds_stay_until_the_last_registration_is_torn_down():
    """Two runs on one cluster register one each: the first done leaves the other's worker unpinned."""
    env = {**without_malloc_settings(), "MALLOC_TRIM_THRESHOLD_": "65536"}
    assert plugin_in(env, TWO) == [False, True]


def test_a_process_that_chose_its_mmap_threshold_or_none_is_left_alone():
    chose = {**without_malloc_settings(), "MALLOC_TRIM_THRESHOLD_": "65536", "MALLOC_MMAP_THRESHOLD_": "131072"}
    assert plugin_in(chose) == [True, False, True, True]
    assert plugin_in(without_malloc_settings())[1] is False


def test_pinned_reads_only_the_two_variables():
    assert pinned({"MALLOC_TRIM_THRESHOLD_": "65536"})
    assert not pinned({"MALLOC_TRIM_THRESHOLD_": "65536", "MALLOC_MMAP_THRESHOLD_": "1"})
    assert not pinned({"MALLOC_TOP_PAD_": "0"})


@pytest.mark.cluster
def test_a_run_on_a_scheduler_it_did_not_start_unpins_its_workers_while_it_runs(monkeypatch):
    """Workers started by distributed's own nanny (MALLOC_TRIM_THRESHOLD_ 65536), as a user's cluster is."""
    # What the nanny writes into this process's environment too; monkeypatch unsets it after the test.
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "65536")
    # Dask's own settings, whichever local cluster of shardflow's (forked from its worker server, the variable
    # unset) this process has open meanwhile: the session's keeps LOCAL_CLUSTER_CONFIG set while it runs.
    with dask.config.set(DASKS_OWN), \
            LocalCluster(n_workers=1, threads_per_worker=1, dashboard_address=LOOPBACK_DASHBOARD) as cluster, \
            Client(cluster) as own:
        assert list(own.run(os.getenv, "MALLOC_TRIM_THRESHOLD_").values()) == ["65536"]
        assert list(own.run(mmapped).values()) == [True]
        with run_cluster(cluster.scheduler_address, None, {}, 1) as client:
            assert list(client.run(mmapped).values()) == [False]
            with dask_client(cluster.scheduler_address) as other:  # a second run on the same scheduler, done first
                assert list(other.run(mmapped).values()) == [False]
            assert list(client.run(mmapped).values()) == [False]
        assert list(own.run(mmapped).values()) == [True]  # put back as the last run ends
