"""Ctrl-C and SIGTERM, sent for real to a `shardflow run`'s process group as a terminal or a supervisor does.

Each run starts in a session of its own and is interrupted once its first checkpoint is
complete; it must end within seconds with one line on the terminal, leave no process
behind (its embedded Prefect server, its Dask workers), be recorded as Crashed, and a
rerun must resume from that checkpoint.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest
import yaml
from test_real_server import READ_BACK

from runs import BIN, SMALL, TOPOLOGY, prefect_home
from shardflow.data.synthetic import SynthTable, synth_dataset
from shardflow.emulation.calibration import REFERENCE_STEP_S, measured_time_scale

pytestmark = pytest.mark.fault  # the tier: killed, interrupted or starved processes

ENDS_WITHIN_QUIET_S = 15  # on the reference host, where the emulation's reference step takes 96 ms


@functools.cache
def ends_within_s() -> float:
    """How long an interrupted command may take to end: ENDS_WITHIN_QUIET_S, scaled by how much slower than the
    reference host this one is now (measured once, as `make test` does after the suite; a few seconds)."""
    _, step_s = measured_time_scale(4)
    return ENDS_WITHIN_QUIET_S * max(1.0, step_s / REFERENCE_STEP_S)


def start(tmp_path: Path, env: dict, interactions: int = 40000, **config) -> subprocess.Popen:
    synth_dataset(tmp_path / "ds", [SynthTable("item", 400, 1.1)], interactions=interactions, seed=3, mean_length=12)
    (tmp_path / "topo.yaml").write_text(TOPOLOGY)
    (tmp_path / "run.yaml").write_text(yaml.safe_dump({
        **{k: list(v) if isinstance(v, tuple) else v for k, v in SMALL.items()}, "epochs": 3,
        "dataset": str(tmp_path / "ds"), "run_dir": str(tmp_path / "run"), "topology": str(tmp_path / "topo.yaml"),
        **config,
    }))
    return subprocess.Popen([str(BIN / "shardflow"), "run", "--config", str(tmp_path / "run.yaml")], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def first_checkpoint(run: Path) -> bool:
    return (run / "versions" / "0001" / "checkpoints" / "epoch-000001" / "manifest.json").exists()


def profiling(run: Path) -> bool:
    return any((run / "versions" / "0001").glob(".profile.staging-*"))


def wait_for(proc: subprocess.Popen, moment, run: Path) -> None:
    deadline = time.monotonic() + 300
    while not moment(run):
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        assert time.monotonic() < deadline, f"no {moment.__name__} within 300 s"
        time.sleep(0.01)


def interrupt_after_the_first_checkpoint(proc: subprocess.Popen, run: Path, signum: int, moment=first_checkpoint,
                                         again_after_s: float | None = None) -> tuple[int, float, str, list]:
    """(exit status, seconds from the last signal to the run's exit, stderr, the run's processes before the signal).

    `again_after_s`: the same signal a second time, that long after the first. The run's own exit is timed:
    its stderr closes later, when the last process that inherited it (the API server, a worker) has gone."""
    wait_for(proc, moment, run)
    family = [proc.pid] + [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
    os.killpg(proc.pid, signum)  # the whole process group, as a terminal's Ctrl-C
    sent = time.monotonic()
    if again_after_s is not None:
        time.sleep(again_after_s)
        if proc.poll() is None:
            os.killpg(proc.pid, signum)
            sent = time.monotonic()
    try:
        proc.wait(timeout=120)
        seconds = time.monotonic() - sent
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    return proc.returncode, seconds, err, family


def evidence(err: str) -> str:
    """A failed run's stderr for the assertion: its first traceback (what went wrong first), then its end."""
    at = err.find("Traceback")
    return (err[max(at - 200, 0) : at + 2000] + "\n[...]\n" if at >= 0 else "") + err[-1000:]


def still_running(pids: list[int]) -> list[str]:
    time.sleep(2)  # a process being reaped is gone within this
    alive = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            if p.status() != psutil.STATUS_ZOMBIE:
                alive.append(" ".join(p.cmdline())[:120])
        except psutil.NoSuchProcess:
            pass
    return alive


def one_line(err: str, begins: str) -> None:
    assert "Traceback" not in err and "distributed." not in err, err[-3000:]
    ours = [line for line in err.splitlines() if line.startswith("shardflow run:")]
    assert len(ours) == 1 and ours[0].startswith(begins) and "run the same command again to resume" in ours[0], ours


@pytest.mark.parametrize("transport", ["actor", "collective"])
def test_sigterm_to_the_group_is_recorded_as_crashed_and_the_same_command_resumes(server, tmp_path, transport):
    """With the collective transport the devices may be inside a gloo wait: the engine's stop ends it."""
    proc = start(tmp_path, server.env, transport=transport)
    status, seconds, err, family = interrupt_after_the_first_checkpoint(proc, tmp_path / "run", signal.SIGTERM)
    assert status == 143 and seconds < ends_within_s(), (status, seconds, evidence(err))
    one_line(err, "shardflow run: terminated (SIGTERM);")
    assert still_running(family) == []
    back = subprocess.run([str(Path(BIN) / "python"), "-c", READ_BACK], env=server.env, capture_output=True, text=True,
                          timeout=120)
    assert back.returncode == 0, back.stderr[-3000:]
    assert [state for _, state in json.loads(back.stdout)["runs"]] == ["CRASHED"]


def embedded(tmp_path: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    return env | {"PREFECT_HOME": str(prefect_home(tmp_path / "prefect")), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}


def test_ctrl_c_while_profiling_is_one_line_and_the_workers_say_nothing_on_the_terminal(tmp_path):
    # Workers forked with the engine imported profile 40,000 events in under the 10 ms the test polls at (missed
    # once): 2,000,000 keep the profile's staging directory there long enough to be seen; none of them is trained.
    proc = start(tmp_path, embedded(tmp_path), interactions=2_000_000)
    status, seconds, err, family = interrupt_after_the_first_checkpoint(proc, tmp_path / "run", signal.SIGINT,
                                                                        moment=profiling)
    assert status == 130 and seconds < ends_within_s(), (status, seconds, evidence(err))
    one_line(err, "shardflow run: interrupted;")
    assert still_running(family) == []


def test_ctrl_c_while_the_worker_server_imports_and_the_api_starts_is_one_line(tmp_path):
    """The local cluster's worker server is started beside the embedded API and imports PyTorch for seconds: a
    Ctrl-C then reached it too, and it died printing a KeyboardInterrupt traceback of that import."""
    proc = start(tmp_path, embedded(tmp_path))

    def worker_server_importing(run: Path) -> bool:
        def command(p: psutil.Process) -> str:
            try:
                return " ".join(p.cmdline())
            except psutil.Error:  # a short-lived child already gone (or a zombie)
                return ""
        return any("multiprocessing.forkserver" in command(p) for p in psutil.Process(proc.pid).children())

    status, seconds, err, family = interrupt_after_the_first_checkpoint(proc, tmp_path / "run", signal.SIGINT,
                                                                        moment=worker_server_importing)
    assert status == 130 and seconds < ends_within_s(), (status, seconds, evidence(err))
    one_line(err, "shardflow run: interrupted;")
    assert "KeyboardInterrupt" not in err, evidence(err)
    assert still_running(family) == []


def test_a_second_ctrl_c_ends_the_run_at_once_with_one_line_and_keeps_the_checkpoint(tmp_path):
    proc = start(tmp_path, embedded(tmp_path))
    status, seconds, err, family = interrupt_after_the_first_checkpoint(proc, tmp_path / "run", signal.SIGINT,
                                                                        again_after_s=0.5)
    # A second Ctrl-C that lands once the run has said its line and is exiting (Python has put SIGINT's default
    # back) ends it by the signal itself: a shell reports that as 130 too.
    assert status in (130, -signal.SIGINT) and seconds < 5, (status, seconds, evidence(err))
    one_line(err, "shardflow run: interrupted")
    assert "leaked semaphore" not in err, err[-3000:]  # multiprocessing's resource tracker, after the stop at once
    assert still_running(family) == []
    assert first_checkpoint(tmp_path / "run")  # what a rerun resumes from (a stop at once is a kill -9: test_faults)


def checkpoint(epoch: int):
    def written(run: Path) -> bool:
        return (run / "versions" / "0001" / "checkpoints" / f"epoch-{epoch:06d}" / "manifest.json").exists()
    written.__name__ = f"checkpoint of epoch {epoch}"
    return written


def embedded_server(proc: subprocess.Popen) -> psutil.Process:
    servers = [p for p in psutil.Process(proc.pid).children(recursive=True) if "uvicorn" in " ".join(p.cmdline())]
    assert len(servers) == 1, [p.cmdline() for p in servers]
    return servers[0]


def test_a_worker_then_the_embedded_api_killed_mid_run_are_ridden_through_quietly_and_the_run_completes(tmp_path):
    """One run, two faults (one run's start-up fewer than a test each): a worker killed after the first
    checkpoint is a warning in the summary, not tracebacks on the terminal; the embedded API killed after the
    second is started again and the run completes."""
    proc = start(tmp_path, embedded(tmp_path))
    wait_for(proc, first_checkpoint, tmp_path / "run")
    # The local cluster's workers are forked from its fork server (shardflow.cluster.WORKER_PRELOAD).
    # A forked worker keeps its server's command line: the server is the one the run started itself.
    servers = [p for p in psutil.Process(proc.pid).children() if "multiprocessing.forkserver" in " ".join(p.cmdline())]
    assert len(servers) == 1, [p.cmdline() for p in psutil.Process(proc.pid).children()]
    workers = servers[0].children()
    assert len(workers) == 2, [p.pid for p in workers]
    workers[0].kill()
    wait_for(proc, checkpoint(2), tmp_path / "run")
    server = embedded_server(proc)
    # What the server prints (its cancelled requests' tracebacks when a kill -9 of the run stops it) is not the
    # terminal's: its stderr is a file of its own, not the run's.
    assert os.readlink(f"/proc/{server.pid}/fd/2") != os.readlink(f"/proc/{proc.pid}/fd/2")
    server.kill()
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    assert "Traceback" not in err and "distributed." not in err and "Error logging to API" not in err, err[-3000:]
    assert "restoring the cluster and resuming from the last complete checkpoint (restart 1 of 3)" in err
    assert "  warning      restart 1: device " in out and "resumed from the last complete checkpoint" in out, out
    log = (tmp_path / "run" / "dask-workers.log").read_text()
    assert "Restarting worker" in log  # the workers' own account of it is kept, off the terminal
    assert "the embedded Prefect API stopped (exit status -9); starting it again at http://127.0.0.1:" in err
    assert "epoch 3: " in err and "promoted" in out


def test_ctrl_c_ends_at_once_then_an_embedded_api_that_cannot_start_again_stops_the_resumed_run_and_the_next_resumes(
        tmp_path):
    """Three runs of one config (a run's start-up fewer than a test each): Ctrl-C once the first checkpoint is
    written ends the run at once with one line, leaves nothing running and records it as Crashed; the same
    command resumes from that checkpoint and, its embedded API killed after the second and its address taken,
    stops in one line with exit status 3; the next run resumes from the second and completes. The cluster is
    the class named in the config (its workers once printed 83 lines of tracebacks on that Ctrl-C)."""
    import socket

    env = embedded(tmp_path)
    proc = start(tmp_path, env, cluster_class="distributed.LocalCluster", cluster_kwargs={"n_workers": 2})
    status, seconds, err, family = interrupt_after_the_first_checkpoint(proc, tmp_path / "run", signal.SIGINT)
    assert status == 130 and seconds < ends_within_s(), (status, seconds, evidence(err))
    one_line(err, "shardflow run: interrupted;")
    assert len(family) > 2 and still_running(family) == []  # the embedded server and every Dask process
    assert "Finished in state Crashed('Execution was aborted by an interrupt signal.')" in err

    resumed = subprocess.Popen([str(BIN / "shardflow"), "run", "--config", str(tmp_path / "run.yaml")], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    wait_for(resumed, checkpoint(2), tmp_path / "run")
    server = embedded_server(resumed)
    port = next(c.laddr.port for c in server.net_connections("tcp") if c.status == psutil.CONN_LISTEN)
    server.kill()
    server.wait(10)
    squatter = socket.socket()  # takes the server's address, listens and never answers
    squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    squatter.bind(("127.0.0.1", port))
    squatter.listen(16)
    try:
        _, err = resumed.communicate(timeout=600)
    finally:
        squatter.close()
    assert resumed.returncode == 3, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    first = tmp_path / "run" / "versions" / "0001" / "checkpoints" / "epoch-000001"
    assert f"resumed from {first}: 1 epochs done" in err, err[-3000:]
    ours = [line for line in err.splitlines() if line.startswith("shardflow run:")]
    assert len(ours) == 1 and ours[0].startswith("shardflow run: training stopped: the embedded Prefect API stopped "
                                                 "(exit status -9) and did not start again"), ours

    rerun = subprocess.run([str(BIN / "shardflow"), "run", "--config", str(tmp_path / "run.yaml"), "--json"], env=env,
                           capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    summary = json.loads(rerun.stdout)
    assert summary["version"] == 1 and summary["resumed_from"].endswith("epoch-000002") and summary["promoted"]
    assert [Path(c).name for c in summary["checkpoints"]] == ["epoch-000002", "epoch-000003"]  # keep_checkpoints 2
    assert len(summary["epoch_loss"]) == 3


def test_sigterm_to_an_import_is_one_line_and_leaves_no_staging_or_lock(tmp_path):
    """`kill PID` of `shardflow import` while it writes: one line, exit 143, nothing half-written beside the
    destination (its staging directory and its writer's lock removed), no process left."""
    import numpy as np

    rng = np.random.default_rng(0)
    lines = 6_000_000  # an import of several seconds on 2 cores: long enough to be cut in the middle
    users = np.sort(rng.integers(0, 300_000, lines))
    items = rng.zipf(1.2, lines) % 100_000
    log = tmp_path / "big.txt"
    np.savetxt(log, np.c_[users, items], fmt="%d")
    dest = tmp_path / "ds"
    proc = subprocess.Popen([str(BIN / "shardflow"), "import", "--format", "sasrec", str(log), str(dest)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob(".ds.staging-*")):
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        assert time.monotonic() < deadline, "no staging directory within 120 s"
        time.sleep(0.01)
    family = [proc.pid] + [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
    os.kill(proc.pid, signal.SIGTERM)
    sent = time.monotonic()
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143 and time.monotonic() - sent < ends_within_s(), (proc.returncode, err[-3000:])
    assert "Traceback" not in err and err.strip().splitlines()[-1].startswith(
        "shardflow import: terminated (SIGTERM);"), err[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.txt"]  # no store, no staging, no lock
    assert still_running(family) == []
