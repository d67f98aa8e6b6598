"""Every way an external Dask cluster can go away mid-run ends in one line within a bounded time.

A real `dask scheduler` and four `dask worker` processes on loopback; `shardflow run`
against them is cut once its first checkpoint is complete, by killing the scheduler, a
worker with its nanny, or a worker started without one. The run must stop with exit 3,
one line naming what was lost and saying the checkpoints are kept, and no traceback.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time

import pytest
import yaml

from cli.embedded_api import free_port
from runs import BIN, SMALL, TOPOLOGY, stderr_of
from shardflow.data.synthetic import SynthTable, synth_dataset

pytestmark = pytest.mark.fault  # the tier: killed, interrupted or starved processes

RESTART_TIMEOUT_S = 5
# The run's reconnect window for a lost scheduler: distributed's comm.timeouts.connect, which a user sets in Dask's
# config (30 s by default). The window is what the scheduler case waits out; 10 s keeps it short.
CONNECT_TIMEOUT = "10s"


class ExternalCluster:
    def __init__(self, nanny: bool) -> None:
        self.address = f"tcp://127.0.0.1:{free_port()}"
        self.procs = [self._start(["scheduler", "--port", self.address.rsplit(":", 1)[1]])]
        time.sleep(2)
        self.procs += [self._start(["worker", self.address, "--nthreads", "1", *([] if nanny else ["--no-nanny"])])
                       for _ in range(2)]

    @staticmethod
    def _start(args: list[str]) -> subprocess.Popen:
        return subprocess.Popen([str(BIN / "dask"), *args, "--no-dashboard"], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True)

    def kill(self, index: int) -> None:
        os.killpg(self.procs[index].pid, signal.SIGKILL)  # the process and whatever it started (a nanny's worker)

    def close(self) -> None:
        for p in self.procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait(timeout=30)


@pytest.mark.parametrize("lost, says", [
    ("scheduler", r"the Dask scheduler (tcp://127\.0\.0\.1:\d+|of this run) is gone"),  # its address while known
    ("a worker and its nanny", r"the cluster has 1 of the 2 workers the plan needs after waiting 5 s"),
    ("a worker without a nanny", r"the cluster has 1 of the 2 workers the plan needs after waiting 5 s"),
])
def test_a_lost_cluster_ends_in_one_line_and_keeps_the_checkpoints(prefect_api, tmp_path, lost, says):
    cluster = ExternalCluster(nanny=lost != "a worker without a nanny")
    try:
        # 10,000 events: epochs of about 65 steps (5 s beside a CI run on 2 cores), the run still training after
        # its first checkpoint, when the fault comes
        synth_dataset(tmp_path / "ds", [SynthTable("item", 400, 1.1)], interactions=10_000, seed=3, mean_length=12)
        (tmp_path / "topo.yaml").write_text(TOPOLOGY)
        (tmp_path / "run.yaml").write_text(yaml.safe_dump({
            **{k: list(v) if isinstance(v, tuple) else v for k, v in SMALL.items()}, "epochs": 5,
            "dataset": str(tmp_path / "ds"), "run_dir": str(tmp_path / "run"), "topology": str(tmp_path / "topo.yaml"),
            "scheduler_address": cluster.address, "restart_timeout_s": RESTART_TIMEOUT_S, "max_restarts": 1,
        }))
        env = {**os.environ, "PREFECT_API_URL": prefect_api,
               "DASK_DISTRIBUTED__COMM__TIMEOUTS__CONNECT": CONNECT_TIMEOUT}
        proc = subprocess.Popen([str(BIN / "shardflow"), "run", "--config", str(tmp_path / "run.yaml")], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        first = tmp_path / "run" / "versions" / "0001" / "checkpoints" / "epoch-000001" / "manifest.json"
        deadline = time.monotonic() + 300
        while not first.exists():
            assert proc.poll() is None and time.monotonic() < deadline, stderr_of(proc)
            time.sleep(0.05)
        cut = time.monotonic()
        cluster.kill(0 if lost == "scheduler" else 1)
        _, err = proc.communicate(timeout=300)
        seconds = time.monotonic() - cut
    finally:
        cluster.close()
    assert proc.returncode == 3, err[-3000:]
    assert seconds < 45, seconds  # bounded: the 10 s reconnect window or restart_timeout_s, plus the exit
    assert "Traceback" not in err, err[-3000:]
    [line] = [x for x in err.splitlines() if x.startswith("shardflow run:")]
    kept = "are kept: a new run resumes from the last complete one (on a new plan if its topology has other devices)"
    assert re.search(says, line) and line.endswith(kept), line
    assert first.exists()  # the checkpoint it resumes from
