"""A Dask cluster on the emulated network: a scheduler in the hub, each node's devices' workers in its namespace.

Device d of the topology is the worker listening on its node's address, port WORKER_PORT + d:
the engine gives device d to the d-th worker sorted by address, and these addresses sort
node by node, device by device, as the topology numbers its devices. The engine then runs
unchanged through `scheduler_address`, from a command started in the hub (`command`).

Every process started here is in a session of its own (a terminal's Ctrl-C reaches only
the harness, which stops them) and dies with the harness (PR_SET_PDEATHSIG), so a harness
killed even by SIGKILL leaves no worker behind; its namespaces go at the next harness's
`sweep`. `close` stops the processes, commands first and the scheduler last (SIGTERM,
then SIGKILL after STOP_WAIT_S), and removes the network.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from shardflow.emulation.network import HUB_ADDRESS, SCHEDULER_PORT, WORKER_PORT, Network
from shardflow.errors import InputError
from shardflow.planner.topology import Topology

STOP_WAIT_S = 5.0
READY_TIMEOUT_S = 600.0  # an upper bound only: the wait ends as soon as every worker has joined
PR_SET_PDEATHSIG = 1

# Run in the hub: returns once the scheduler has `n` workers (a Python start-up and a connection).
_WAIT_FOR_WORKERS = """
import sys
from distributed import Client
with Client(sys.argv[1], timeout="60s") as c:
    c.wait_for_workers(int(sys.argv[2]), timeout=float(sys.argv[3]))
"""


def worker_environment() -> dict[str, str]:
    """The environment a Dask nanny gives the worker it starts (`distributed.nanny.pre-spawn-environ`: one
    OpenMP, MKL and OpenBLAS thread), which a worker started without a nanny would not have: with PyTorch's
    default of a thread per core, four workers on 2 cores ran a step's compute about 10× slower."""
    import dask.config
    import distributed  # noqa: F401  (loads the distributed section of dask.config)

    return {**os.environ, **{k: str(v) for k, v in dask.config.get("distributed.nanny.pre-spawn-environ").items()}}


def die_with_parent() -> None:
    os.setsid()
    signal.pthread_sigmask(signal.SIG_SETMASK, [])  # the harness blocks its stop signals while it starts one
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


class EmulatedCluster:
    """Build with `with EmulatedCluster(topology, time_scale, logs) as cluster:`; `cluster.scheduler_address`."""

    def __init__(self, topology: Topology, time_scale: float, logs: Path, worker_memory: str = "auto"):
        self.network = Network(topology, time_scale)
        self.logs = Path(logs)
        self.worker_memory = worker_memory
        self.scheduler_address = f"tcp://{HUB_ADDRESS}:{SCHEDULER_PORT}"
        self.worker_addresses: list[str] = []
        self._procs: dict[str, subprocess.Popen] = {}  # the scheduler and the workers, by name
        self._commands: list[subprocess.Popen] = []  # what `command` started

    def __enter__(self) -> EmulatedCluster:
        self.logs.mkdir(parents=True, exist_ok=True)
        self.network.build()
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _spawn(self, name: str, namespace: str, argv: list[str], env: dict[str, str] | None = None
               ) -> subprocess.Popen:
        with open(self.logs / f"{name}.log", "wb") as log:
            proc = subprocess.Popen(["ip", "netns", "exec", namespace, *argv], stdin=subprocess.DEVNULL,
                                    stdout=log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent, env=env)
        self._procs[name] = proc
        return proc

    def _start(self) -> None:
        dask = [sys.executable, "-m"]
        self._spawn("scheduler", self.network.hub,
                    [*dask, "distributed.cli.dask_scheduler", "--host", HUB_ADDRESS, "--port", str(SCHEDULER_PORT),
                     "--no-dashboard"])
        d, env = 0, worker_environment()
        for node in self.network.nodes:
            for _ in range(node.devices):
                address = f"tcp://{node.address}:{WORKER_PORT + d}"
                self._spawn(f"device-{d}", node.namespace,
                            [*dask, "distributed.cli.dask_worker", self.scheduler_address, "--name", f"device-{d}",
                             "--listen-address", address, "--nthreads", "1", "--no-nanny", "--no-dashboard",
                             "--memory-limit", self.worker_memory], env)
                self.worker_addresses.append(address)
                d += 1
        waiter = self.command([sys.executable, "-c", _WAIT_FOR_WORKERS, self.scheduler_address,
                               str(len(self.worker_addresses)), str(READY_TIMEOUT_S)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        while waiter.poll() is None:
            self._check_running()
            time.sleep(0.2)
        if waiter.returncode != 0:
            raise InputError(f"the emulated cluster's {len(self.worker_addresses)} workers did not all join "
                             f"(see {self.logs}): {waiter.stderr.read().strip().splitlines()[-1:]}")

    def _check_running(self) -> None:
        for name, proc in self._procs.items():
            if proc.poll() is not None:
                tail = (self.logs / f"{name}.log").read_text(errors="replace").strip().splitlines()[-1:]
                raise InputError(f"the emulated cluster's {name} exited with {proc.returncode}: {tail}")

    def command(self, argv: list[str], **popen) -> subprocess.Popen:
        """Start `argv` in the hub (it reaches the scheduler and every node); it dies with the harness too, and
        `close` stops it with the cluster. Ctrl-C and SIGTERM wait while it starts: one arriving between the
        fork and its record here would leave it running past the harness's cleanup."""
        stops = {signal.SIGINT, signal.SIGTERM}
        signal.pthread_sigmask(signal.SIG_BLOCK, stops)
        try:
            proc = subprocess.Popen(["ip", "netns", "exec", self.network.hub, *argv], preexec_fn=die_with_parent,
                                    **popen)
            self._commands.append(proc)
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, stops)
        return proc

    def close(self) -> None:
        """Commands first, then the workers, then the scheduler, each group asked to stop (SIGTERM) and waited
        for, within STOP_WAIT_S in all; what is left then is killed. The order matters: workers sent SIGTERM
        together with their scheduler hung in their close until killed (3 of the 4, in each of 3 tries): 5 s per
        cluster. Workers first, the scheduler after: the whole close 0.40-0.46 s (2026-11-29, 2 cores)."""
        procs, commands, self._procs, self._commands = dict(self._procs), self._commands, {}, []
        scheduler = procs.pop("scheduler", None)
        deadline = time.monotonic() + STOP_WAIT_S
        for group in (commands, list(procs.values()), [scheduler] if scheduler else []):
            for proc in group:
                if proc.poll() is None:
                    proc.terminate()
            for proc in group:
                try:
                    proc.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        self.network.remove()
