"""One place that opens the Dask cluster a job runs on."""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import signal
import threading
import time
from collections.abc import Iterator

import dask
from distributed import Client, LocalCluster, WorkerPlugin
from distributed.deploy import Cluster

from shardflow.errors import InputError, SchedulerLost


RECONNECT_S = 35.0  # a client gives a lost scheduler 30 s (comm.timeouts.connect) before it closes
LOCAL_WORKERS_PER_CORE = 4  # a local cluster beyond this only thrashes (each worker is a process)


def default_workers() -> int:
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)


@contextlib.contextmanager
def dask_client(scheduler_address: str | None = None, workers: int | None = None, gpus: bool = False,
                connect_timeout_s: float = 30.0) -> Iterator[Client]:
    """A client on an existing scheduler, or on a LocalCluster of `workers` single-threaded processes.

    Profiling and training kernels are numpy and hold the GIL in parts, so a local
    device is a process with one thread. With `gpus`, every local worker offers the
    resource GPU=1 (one worker per GPU; CUDA device d for worker d).
    """
    if scheduler_address:
        if workers is not None:
            raise InputError("--workers applies to a local cluster; it cannot be combined with --scheduler")
        check_address(scheduler_address)
        try:
            client = Client(scheduler_address, timeout=f"{connect_timeout_s}s")
        except (OSError, TimeoutError) as e:
            raise InputError(
                f"scheduler {scheduler_address!r} did not answer within {connect_timeout_s:.0f} s ({type(e).__name__}); "
                "accepted: the address of a running Dask scheduler. Nothing was written"
            ) from None
        with client:
            yield client
        return
    workers = default_workers() if workers is None else workers
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise InputError(f"workers = {workers!r}; accepted: an integer >= 1")
    limit = LOCAL_WORKERS_PER_CORE * default_workers()
    if workers > max(limit, 8):
        raise InputError(
            f"workers = {workers:,}: a local cluster of {workers:,} processes (one per device) on "
            f"{default_workers()} cores; accepted: at most {max(limit, 8)}, or a scheduler_address / cluster_class "
            "for a larger cluster"
        )
    # Dask sets MALLOC_TRIM_THRESHOLD_ in worker processes, which also pins glibc's mmap
    # threshold at 128 KiB: every chunk-sized buffer is then a fresh mmap that page-faults.
    # Counting 10^8 ids took 1.9 s with it and 1.05 s without (bench/profile_throughput.py).
    no_trim = {"distributed.nanny.pre-spawn-environ.MALLOC_TRIM_THRESHOLD_": None}
    with dask.config.set(no_trim), LocalCluster(
        n_workers=workers,
        threads_per_worker=1,
        processes=True,
        dashboard_address=":0",
        silence_logs=logging.WARNING,
        **({"resources": {"GPU": 1}} if gpus else {}),
    ) as cluster, Client(cluster) as client:
        client.register_plugin(IgnoreInterrupts(), name="shardflow-ignore-interrupts")
        yield client


class IgnoreInterrupts(WorkerPlugin):
    """Local worker processes ignore SIGINT: a terminal's Ctrl-C reaches its whole process group, and the
    command that owns the cluster (which got it too) closes them; each would otherwise die printing a
    KeyboardInterrupt traceback of its own. Applies to workers started later (restarts) too."""

    def setup(self, worker) -> None:
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, signal.SIG_IGN)


@contextlib.contextmanager
def run_cluster(
    scheduler_address: str | None,
    cluster_class: str | None,
    cluster_kwargs: dict,
    workers: int,
    gpus: bool = False,
) -> Iterator[Client]:
    """The one cluster a run's stages share: an existing scheduler, a cluster class, or a LocalCluster.

    `cluster_class` is an import path ("dask_jobqueue.SLURMCluster", "dask_kubernetes.KubeCluster")
    built with `cluster_kwargs`, so a run moves off one machine without code changes.
    """
    if not cluster_class:
        with dask_client(scheduler_address, None if scheduler_address else workers, gpus=gpus) as client:
            if scheduler_address:
                check_workers(client, workers)
            yield client
        return
    cls = resolve_cluster_class(cluster_class)
    with cls(**cluster_kwargs) as cluster, Client(cluster) as client:
        if hasattr(cluster, "scale") and not cluster_kwargs.get("n_workers"):
            cluster.scale(workers)
        client.wait_for_workers(workers, timeout="600s")
        yield client


# Packages whose cluster classes a run may name; an operator adds more (comma-separated) in
# SHARDFLOW_CLUSTER_MODULES. Nothing outside them is imported for a config value.
CLUSTER_MODULES = ("distributed", "dask_jobqueue", "dask_kubernetes", "dask_cloudprovider", "dask_gateway",
                   "dask_yarn", "dask_mpi")


def resolve_cluster_class(path: str) -> type[Cluster]:
    """The class `path` names, if it is a Dask Cluster from an allowed package; else an InputError.

    Checked before anything is called: a config value never runs code of its own choosing
    (`subprocess.Popen`, `os.system` are refused without being imported).
    """
    allowed = CLUSTER_MODULES + tuple(m.strip() for m in os.environ.get("SHARDFLOW_CLUSTER_MODULES", "").split(",")
                                      if m.strip())
    accepted = f"a Dask Cluster subclass from {', '.join(allowed)} (more via SHARDFLOW_CLUSTER_MODULES)"
    module, _, name = path.rpartition(".")
    if not module or module.split(".")[0] not in allowed:
        raise InputError(f"cluster_class {path!r}: not from an allowed package; accepted: {accepted}")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as e:
        raise InputError(f"cluster_class {path!r}: {e}; accepted: {accepted}") from None
    if not (isinstance(cls, type) and issubclass(cls, Cluster)):
        raise InputError(f"cluster_class {path!r} is not a Dask Cluster class; accepted: {accepted}")
    return cls


def check_address(address: str) -> str:
    """A Dask scheduler address (tcp://host:port, tls://…, inproc://…, ucx://…), or an InputError."""
    scheme, sep, rest = address.partition("://")
    host, colon, port = rest.rpartition(":")
    if not sep or scheme not in ("tcp", "tls", "inproc", "ucx", "ws", "wss") or (
            scheme != "inproc" and not (host and colon and port.isdigit())):
        raise InputError(f"scheduler address {address!r}; accepted: PROTOCOL://HOST:PORT, e.g. tcp://10.0.0.5:8786")
    return address


def check_workers(client: Client, devices: int, timeout_s: float = 10.0) -> None:
    """Refuse a cluster with fewer workers than devices (after `timeout_s` for late ones to join)."""
    try:
        client.wait_for_workers(devices, timeout=timeout_s)
    except TimeoutError:
        workers = len(live_workers(client))
        raise InputError(
            f"the scheduler at {client.scheduler.address} has {workers} workers; the topology has {devices} "
            f"devices; accepted: at least one worker per device (waited {timeout_s:.0f} s for more)"
        ) from None


def worker_count(client: Client) -> int:
    return max(1, len(live_workers(client)))


def live_workers(client: Client) -> dict:
    """The scheduler's workers (address -> info), asked afresh; SchedulerLost once the scheduler is gone.

    Never read from the client's cache: distributed refreshes it in the background with
    no per-worker detail, so a fresh request that timed out under CPU load would show
    every worker gone. A request that fails is asked again; a client whose scheduler went
    away reconnects for distributed's `comm.timeouts.connect` (30 s by default) and then
    closes, so this gives up after RECONNECT_S at most.
    """
    deadline = time.monotonic() + RECONNECT_S
    while client.status in ("running", "connecting") and time.monotonic() < deadline:
        if client.status == "running":
            try:
                return client.sync(client.scheduler.identity, n_workers=-1)["workers"]
            except OSError:  # slow or briefly unreachable: ask again
                pass
        time.sleep(0.2)
    where = getattr(client.scheduler, "address", None) or "of this run"
    raise SchedulerLost(f"the Dask scheduler {where} is gone (no answer for {RECONNECT_S:.0f} s)")
