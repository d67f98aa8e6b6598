"""What the flow tests share: run configs, reading a run back from the API, exported bytes, cut-off runs."""

from __future__ import annotations

import asyncio
import fcntl
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import yaml
import zarr

BIN = Path(sys.executable).parent
PREFECT_HOME_TEMPLATE = "SHARDFLOW_TEST_PREFECT_HOME"  # a directory the whole test session shares
TOPOLOGY = ("intra_node_gbytes_per_s: 100\nnodes:\n  - {name: a, devices: 1, uplink_gbytes_per_s: 10}\n"
            "  - {name: b, devices: 1, uplink_gbytes_per_s: 5}\n")
SMALL = dict(dim=8, mlp=(8,), history=5, negatives=2, batch_size=128, epochs=2, patience=None, eval_users=200,
             memory_slack=0.5)


FIRST_START = """
import prefect.server.api.server as api
server = api.SubprocessASGIServer()
server.start(timeout=int(__import__("sys").argv[1]))
server.stop()
"""


def prefect_home(home: Path, startup_timeout_s: int = 600) -> Path:
    """`home` made a PREFECT_HOME as a Prefect API server leaves it after its first start: its database
    migrated and its block types registered (prefect.db, memo_store.toml). Each is a copy of one made once
    per test session; a server started on it answered in 4.0 s instead of 11.2 s (2 cores, quiet). A first
    start on an empty home is what test_startup runs."""
    shared = Path(os.environ[PREFECT_HOME_TEMPLATE])  # the session's (tests/conftest.py)
    template = shared / "home"
    with open(shared / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the session's pytest workers make it once, one of them
        if not (template / "prefect.db").is_file():
            made = shared / "making"
            shutil.rmtree(made, ignore_errors=True)
            env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
            done = subprocess.run([sys.executable, "-c", FIRST_START, str(startup_timeout_s)], capture_output=True,
                                  text=True, env=env | {"PREFECT_HOME": str(made),
                                                        "PREFECT_SERVER_ANALYTICS_ENABLED": "false"})
            assert done.returncode == 0, done.stderr[-3000:]
            with sqlite3.connect(made / "prefect.db") as db:  # the write-ahead log into the file itself
                db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            for leftover in ("prefect.db-wal", "prefect.db-shm"):
                (made / leftover).unlink(missing_ok=True)
            made.rename(template)
    home.mkdir(parents=True, exist_ok=True)
    for name in ("prefect.db", "memo_store.toml"):
        shutil.copy2(template / name, home / name)
    return home


def stderr_of(proc: subprocess.Popen) -> str:
    """The end of a process's stderr for a failed assertion: the process is killed first, so reading never waits
    on a run that is stuck."""
    proc.kill()
    return proc.communicate(timeout=60)[1][-3000:]


def task_run_states(flow_run_id) -> list[tuple[str, str]]:
    """(name, state type) of every task run of a flow run."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    async def read():
        async with get_client() as c:
            runs = await c.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
            return [(r.name, r.state_type.value) for r in runs]
    return asyncio.run(read())


def task_runs(flow_run_id) -> list[str]:
    return [name for name, _ in task_run_states(flow_run_id)]


def live_actors(client) -> int:
    return sum(len(a) for a in client.run(lambda dask_worker: list(dask_worker.state.actors)).values())


def exported(model) -> dict:
    """Every parameter of an exported model (its tables' rows, its dense weights), as bytes."""
    root = zarr.open_group(str(model), mode="r")
    return {f"{group}/{name}": array[...].tobytes() for group in ("tables", "dense")
            for name, array in root[group].arrays()}


def run_until_killed(values: dict, env: dict, cut: Callable[[], bool], where: Path, timeout: float = 300) -> None:
    """`shardflow run` with `values` in a child process, SIGKILLed the moment `cut()` holds.

    The child is stopped (SIGSTOP) first, so it writes no manifest and renames nothing
    after `cut` saw the state (its workers finish the write they are in, as they would).
    Fails if the run ends before `cut` ever held.
    """
    where.mkdir(parents=True, exist_ok=True)
    config = where / "run.yaml"
    config.write_text(yaml.safe_dump({k: list(v) if isinstance(v, tuple) else v for k, v in values.items()}))
    proc = subprocess.Popen([str(BIN / "shardflow"), "run", "--config", str(config), "--json"], env=env,
                            stdout=subprocess.DEVNULL, stderr=open(where / "stderr.txt", "w"))
    deadline = time.monotonic() + timeout
    try:
        while not cut():
            if proc.poll() is not None:
                raise AssertionError(f"the run ended (exit {proc.returncode}) before it could be cut: "
                                     + (where / "stderr.txt").read_text()[-3000:])
            if time.monotonic() > deadline:
                raise AssertionError(f"the run was not cut within {timeout} s")
            time.sleep(0.002)
        os.kill(proc.pid, signal.SIGSTOP)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
