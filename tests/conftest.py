"""Session-wide fixtures: one LocalCluster and one Prefect test harness for the whole run; the test tiers.

Every test is in one tier (a marker its module declares, or set here from the fixtures it uses):

    fault    processes killed, interrupted or starved, disks filled, soak runs (whole modules)
    server   a Prefect API: the test harness, a real `prefect server`, or `shardflow run` as a process
    cluster  a Dask LocalCluster (the session's `client`, or a command that starts one)
    unit     none of these: pure logic and real zarr stores, milliseconds to seconds

`make test-quick` runs the unit tier; `make test` runs them all.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

# Each pytest worker (two on CI's two cores) computes with PyTorch; an intra-op thread per core each only
# spins against the other worker's (OpenMP waits by spinning). Set before PyTorch loads, and inherited by
# the commands a test starts (a Dask worker takes 1 already: distributed's pre-spawn-environ). Measured on
# 2 cores: the unit tier 155 s -> 95 s, its CPU 299 s -> 180 s.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Dask's statistical profiler samples every worker thread's stack every 10 ms, for the dashboard's profile
# page no test reads: four idle workers spent 2.7 CPU-s in 30 s with it, 1.7 s without (2 cores, loaded).
os.environ.setdefault("DASK_DISTRIBUTED__WORKER__PROFILE__ENABLED", "False")
# Every Dask process also checks its event loop's health every 20 ms, samples its own CPU and disk every 0.5 s
# and its memory every 0.1 s: four idle workers and their scheduler spent 3.8 CPU-s in 30 s, 0.7 s with these
# (2 cores). The suite's two session clusters idle through most of it. Only what the monitors sample changes:
# no test fills a worker's memory (the out-of-memory note is tested on a worker's recorded figures).
os.environ.setdefault("DASK_DISTRIBUTED__ADMIN__TICK__INTERVAL", "1s")
os.environ.setdefault("DASK_DISTRIBUTED__ADMIN__SYSTEM_MONITOR__INTERVAL", "5s")
os.environ.setdefault("DASK_DISTRIBUTED__WORKER__MEMORY__MONITOR_INTERVAL", "1s")

import pytest  # noqa: E402

from shardflow.cluster import dask_client

WORKERS = 4  # the training tests place up to four devices, one per worker

_config: pytest.Config  # the session's, for the terminal its failures are named on as they happen

TIERS = ("fault", "server", "cluster", "unit")
# Every test here uses Prefect (the server tier or a heavier one). `-m unit` does not import these modules: their
# imports (Prefect's API server among them) cost each pytest worker 3.0-3.6 s of its 11-12 s of collection.
FLOWS = Path(__file__).parent / "flows"


def tier(item: pytest.Item) -> str:
    """The tier a module declares (`pytestmark = pytest.mark.fault`: what no fixture shows, such as killing
    processes or running a command that starts a cluster or a server), else the one its fixtures give."""
    declared = [m.name for m in item.iter_markers() if m.name in TIERS]
    if declared:
        return min(declared, key=TIERS.index)
    fixtures = set(item.fixturenames)
    if fixtures & {"prefect_api", "server"}:
        return "server"
    if "client" in fixtures:
        return "cluster"
    return "unit"


def pytest_configure(config) -> None:
    """The session's controlling process makes the directory its pytest workers share (they inherit the
    variable): tests/flows/runs.py keeps the Prefect home template there. Every process keeps its config for
    pytest_runtest_logreport."""
    global _config
    _config = config
    if not hasattr(config, "workerinput"):
        os.environ["SHARDFLOW_TEST_PREFECT_HOME"] = tempfile.mkdtemp(prefix="shardflow-prefect-home-")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Name each failure in one line as it happens, with its phase, seconds and crash line: pytest-xdist prints
    tracebacks only at the session's end, which a run stopped at CI's time limit never reaches."""
    if not report.failed or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    crash = getattr(report.longrepr, "reprcrash", None)
    where = f"{crash.path}:{crash.lineno}: {crash.message.splitlines()[0][:200]}" if crash else ""
    terminal = _config.pluginmanager.get_plugin("terminalreporter")
    terminal.write_line(f"\nFAILED {report.nodeid} ({report.when}, {report.duration:.0f} s) {where}", flush=True)


def pytest_unconfigure(config) -> None:
    if not hasattr(config, "workerinput"):
        shutil.rmtree(os.environ.pop("SHARDFLOW_TEST_PREFECT_HOME"), ignore_errors=True)


def pytest_ignore_collect(collection_path: Path, config) -> bool | None:
    return True if config.option.markexpr == "unit" and collection_path == FLOWS else None


def pytest_collection_modifyitems(items) -> None:
    """Mark each test with its tier, and order the tiers heaviest first (fault, server, cluster, unit): `make
    test` runs them in one session whose two workers take tests from each other's queues, so the minutes-long
    tests start first and the unit tier's milliseconds fill the ends (and a server test's waits)."""
    tiers = {}
    for item in items:
        tiers[item] = tier(item)
        if tiers[item] == "unit" and FLOWS in item.path.parents:
            raise pytest.UsageError(f"{item.nodeid} is in the unit tier; accepted there: tests that use Prefect "
                                    f"(`-m unit` does not collect {FLOWS.name}/): move it beside the code it tests")
        if not item.get_closest_marker(tiers[item]):
            item.add_marker(tiers[item])
    items.sort(key=lambda item: TIERS.index(tiers[item]))


@pytest.fixture(scope="session")
def client():
    with dask_client(workers=WORKERS) as c:
        yield c


@pytest.fixture(scope="session")
def prefect_api():
    from prefect.settings import PREFECT_API_URL
    from prefect.testing.utilities import prefect_test_harness

    # Prefect's harness gives its server 30 s; under load (every core busy) it needs more, as the embedded
    # API does (cli/embedded_api.py): the same bound.
    from cli.embedded_api import STARTUP_TIMEOUT_S

    with prefect_test_harness(server_startup_timeout=STARTUP_TIMEOUT_S):
        yield PREFECT_API_URL.value()
