"""One place that opens the Dask cluster a job runs on."""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import dask
from dask.utils import parse_timedelta
from distributed import Client, LocalCluster, WorkerPlugin
from distributed.deploy import Cluster
from distributed.utils import get_mp_context

from shardflow.cluster_options import (
    CLUSTER_KWARGS,
    LOCAL_CLASSES,
    TlsFiles,
    check_cluster_class,
    check_cluster_kwargs,
    check_local_workers,
    check_tls_address,
    cores,
)
from shardflow.errors import InputError, SchedulerLost, TrainingError, stop_signal
from shardflow.heap import NAME as HEAP_PLUGIN
from shardflow.heap import HeapThresholds

__all__ = ["check_cluster_class", "check_cluster_kwargs", "dask_client", "run_cluster", "resolve_cluster_class"]

RECONNECT_MARGIN_S = 5.0  # beyond the client's reconnect window (comm.timeouts.connect), for it to close
LOOPBACK_DASHBOARD = "127.0.0.1:0"  # a local cluster's dashboard: this machine only, any free port
# Local worker processes are forked from one server that has imported what a worker needs to host a device
# (PyTorch, zarr, the engine) once, instead of each spawned worker importing it: 4 workers up with the engine
# imported in 4.9 s against 19.7 s spawned (2 cores at load 5-7). The server is started with the nanny's
# pre-spawn environment (one OpenMP thread), imports no CUDA, and ends with the process that started it.
# torch._dynamo too: a process's first torch.optim optimizer imports it (2.1 s of CPU here), which every
# worker did when its parameter server started (2 devices up in 2.0 s instead of 5.0 s, 2 cores).
# shardflow.training.recommend too: the night's top-K lists are written as Parquet on the workers, and
# pyarrow.parquet is 29 MB resident a process; imported by whichever worker got a block first, one worker
# grew by it in a later night of the soak test. shardflow.worker_server first: the server and its workers
# ignore a terminal's Ctrl-C from then on.
WORKER_PRELOAD = ["shardflow.worker_server", "distributed", "shardflow.training.actor", "torch._dynamo",
                  "shardflow.training.recommend"]
# How local worker processes start (distributed's config): forked from that server. Dask would set
# MALLOC_TRIM_THRESHOLD_ in them, which also pins glibc's mmap threshold at 128 KiB: every chunk-sized
# buffer is then a fresh mmap that page-faults. Counting 10^8 ids took 1.9 s with it and 1.05 s without
# (bench/profile_throughput.py).
LOCAL_CLUSTER_CONFIG = {"distributed.nanny.pre-spawn-environ.MALLOC_TRIM_THRESHOLD_": None,
                        "distributed.worker.multiprocessing-method": "forkserver"}


@contextlib.contextmanager
def dask_client(scheduler_address: str | None = None, workers: int | None = None,
                worker_log: Path | None = None, tls: TlsFiles | None = None) -> Iterator[Client]:
    """A client on an existing scheduler, or on a LocalCluster of `workers` single-threaded processes.

    Profiling and training kernels are numpy and hold the GIL in parts, so a local
    device is a process with one thread. With `worker_log`, what local worker processes
    write to stderr goes to that file (WorkerOutput). A scheduler is waited for, at the
    start and once lost, for distributed's `comm.timeouts.connect` (connect_timeout_s():
    30 s unless Dask's config says otherwise).
    """
    if scheduler_address:
        if workers is not None:
            raise InputError(f"--workers {workers} with --scheduler {scheduler_address}; accepted: one of them "
                             "(--workers sizes a local cluster, --scheduler names a running one)")
        with _remote_client(scheduler_address, tls) as client, heap_thresholds(client):
            yield client
        return
    workers = check_local_workers(cores() if workers is None else workers)
    with local_processes(worker_log) as adopt:
        cluster = LocalCluster(
            n_workers=workers,
            threads_per_worker=1,
            processes=True,
            dashboard_address=LOOPBACK_DASHBOARD,
            silence_logs=logging.WARNING,
        )
        try:
            with Client(cluster) as client:
                adopt(client)
                yield client
        finally:
            # Our own workers are done: one still busy after the nanny's 4 s (a loaded machine) is killed
            # without a warning line per worker.
            with _log_level("distributed.nanny", logging.ERROR):
                cluster.close()


@contextlib.contextmanager
def local_processes(worker_log: Path | None) -> Iterator[Callable[[Client], None]]:
    """While a local cluster made inside runs: its worker processes are forked from the worker server
    (WORKER_PRELOAD; SIGINT ignored from their first instruction, start_worker_server), what they say goes to
    `worker_log` unless SHARDFLOW_VERBOSE, and `adopt(client)` registers the plugins that keep a terminal's
    Ctrl-C and their output off the terminal for workers started later too (restarts)."""
    quiet = worker_log is not None and os.environ.get(VERBOSE, "0") in ("", "0")

    def adopt(client: Client) -> None:
        client.register_plugin(IgnoreInterrupts(), name="shardflow-ignore-interrupts")
        if quiet:
            client.register_plugin(WorkerOutput(str(worker_log)), name="shardflow-worker-output")

    # Until the cluster is closed: a worker the nanny starts again is forked like the first, and what the
    # cluster says while closing goes where the rest went.
    with dask.config.set(LOCAL_CLUSTER_CONFIG), _dask_log_to(worker_log if quiet else None):
        start_worker_server()  # after distributed's own choice of method, before a fork; at once if running
        yield adopt


@contextlib.contextmanager
def performance_report(path: Path) -> Iterator[None]:
    """distributed's performance report of what the default client's cluster does meanwhile (its task stream,
    the workers' profiles, bandwidth, the scheduler's log), written to `path` as HTML at the end; after a failure
    of the run's own (bad input, training stopped: what a 3 a.m. reader wants) too, its own failure then ignored.
    Not after a stop signal (the command ends within seconds) nor once the cluster is lost (nothing to ask)."""
    from distributed import performance_report as report

    writer = report(filename=str(path))
    writer.__enter__()
    try:
        yield
    except (InputError, TrainingError) as e:
        if not isinstance(e, SchedulerLost) and stop_signal(e) is None:
            with contextlib.suppress(Exception):  # the run's error is the one to report
                writer.__exit__(type(e), e, e.__traceback__)
        raise
    writer.__exit__(None, None, None)


def start_worker_server() -> None:
    """Start now the server local workers are forked from (WORKER_PRELOAD), so that its imports (PyTorch, the
    engine) overlap what this process waits on next (a run's embedded API) instead of the cluster's start.

    It gets the environment the first nanny would give it (distributed's pre-spawn-environ, a fixed
    PYTHONHASHSEED as distributed.nanny sets it), without what LOCAL_CLUSTER_CONFIG unsets: a nanny of a Dask
    cluster started earlier in this process with Dask's own config wrote MALLOC_TRIM_THRESHOLD_ into
    os.environ, and a server started from there pinned every local worker's mmap threshold (shardflow.heap).
    This process's own environment is left as it was."""
    import multiprocessing.forkserver

    with dask.config.set(LOCAL_CLUSTER_CONFIG):
        get_mp_context().set_forkserver_preload(WORKER_PRELOAD)
        env: dict[str, str | None] = {k: None if v is None else os.environ.get(k, str(v))
                                      for k, v in dask.config.get("distributed.nanny.pre-spawn-environ").items()}
    if env.get("PYTHONHASHSEED") in (None, "0"):
        env["PYTHONHASHSEED"] = "6640"
    before = {k: os.environ.get(k) for k in env}
    _set_environ(env)
    try:
        _spawn_ignoring_interrupts(multiprocessing.forkserver.ensure_running)
    finally:
        _set_environ(before)


def _set_environ(values: dict[str, str | None]) -> None:
    """Set each variable of `values` in os.environ, or unset it where its value is None."""
    for k, v in values.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def _spawn_ignoring_interrupts(spawn: Callable[[], None]) -> None:
    """`spawn` the worker server with SIGINT blocked: the mask passes to it through fork and exec, and its first
    import (shardflow.worker_server) ignores the signal, discarding one that arrived meanwhile, then unblocks it.

    A terminal's Ctrl-C reaches its whole process group: the worker server would die printing a KeyboardInterrupt
    traceback of the import it was in (its preload takes seconds). Only the calling thread blocks the signal, and
    this process's handler stays in: a Ctrl-C sent meanwhile is taken by another thread and handled as ever.
    (Ignoring it here for the spawn instead lost it: the kernel hands a signal blocked in one thread to another,
    where it was ignored; the run then went on to the end.) multiprocessing's resource tracker is started first:
    the server needs it, and starting it unblocks SIGINT in the calling thread (it guards its own start so)."""
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        spawn()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def connect_timeout_s() -> float:
    """distributed's `comm.timeouts.connect` in seconds: how long a client waits for its scheduler to answer,
    at the start and again (its reconnect window) once the connection is lost."""
    return parse_timedelta(dask.config.get("distributed.comm.timeouts.connect"), "s")


def _remote_client(scheduler_address: str, tls: TlsFiles | None = None) -> Client:
    """A client of a running scheduler (over TLS with `tls`), or an InputError naming it when it does not answer
    in time."""
    check_address(scheduler_address)
    check_tls_address(scheduler_address, tls)
    timeout = connect_timeout_s()
    try:
        return Client(scheduler_address, timeout=timeout, security=None if tls is None else tls.security())
    except (OSError, TimeoutError) as e:
        raise InputError(
            f"scheduler {scheduler_address!r} did not answer within {timeout:g} s "
            f"({type(e).__name__}); accepted: the address of a running Dask scheduler"
        ) from None


@contextlib.contextmanager
def _dask_log_to(path: Path | None) -> Iterator[None]:
    """While a local cluster runs, this process's `distributed` log lines (its scheduler's and nannies':
    a worker that left, a restart) go to `path` (emptied first: the last run's lines), not the terminal.

    So do the exceptions of callbacks on its client's tornado loop (`tornado.application`): distributed
    2026.8's `sync()` schedules a `cancel` that raises a NameError when Ctrl-C lands before its future
    exists, and the loop logs that traceback."""
    if path is None:
        yield
        return
    Path(path).write_text("")
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s - %(name)s - %(levelname)s - %(message)s"))
    loggers = [logging.getLogger(name) for name in DASK_LOGGERS]
    before = [(logger.handlers, logger.propagate) for logger in loggers]
    for logger in loggers:
        logger.handlers, logger.propagate = [handler], False
    try:
        yield
    finally:
        for logger, (handlers, propagate) in zip(loggers, before, strict=True):
            logger.handlers, logger.propagate = handlers, propagate
        handler.close()


DASK_LOGGERS = ("distributed", "tornado.application")


@contextlib.contextmanager
def _log_level(name: str, level: int) -> Iterator[None]:
    logger = logging.getLogger(name)
    before = logger.level
    logger.setLevel(level)
    try:
        yield
    finally:
        logger.setLevel(before)


VERBOSE = "SHARDFLOW_VERBOSE"  # set (to anything but empty or 0): Dask's INFO lines reach the logs again


def quiet_dask() -> None:
    """Dask's and the HTTP client's INFO lines (connections, workers starting, dashboards) stay out of a run's
    terminal and worker log unless VERBOSE is set (`shardflow run --verbose` sets it); warnings still show."""
    if os.environ.get(VERBOSE, "0") in ("", "0"):
        for noisy in ("distributed", "httpx"):
            logging.getLogger(noisy).setLevel(logging.WARNING)


class IgnoreInterrupts(WorkerPlugin):
    """Local worker processes ignore SIGINT: a terminal's Ctrl-C reaches its whole process group, and the
    command that owns the cluster (which got it too) closes them; each would otherwise die printing a
    KeyboardInterrupt traceback of its own. Applies to workers started later (restarts) too."""

    def setup(self, worker) -> None:
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, signal.SIG_IGN)


class WorkerOutput(WorkerPlugin):
    """A local worker process writes its stderr (Dask's log lines, tracebacks of its threads) to a file.

    A local cluster's workers share the terminal of the command that started them. What
    they say when that command is interrupted (heartbeats to a scheduler that is closing)
    or when a peer is killed (connections that fail before the run restores the cluster)
    is their own diagnosis of an event the run reports itself in one line; the file keeps
    it for whoever wants it. Applies to workers started later (restarts) too.
    """

    def __init__(self, path: str) -> None:
        self.path = path

    def setup(self, worker) -> None:
        import sys

        sys.stderr.flush()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(fd, 2)
        os.close(fd)


@contextlib.contextmanager
def run_cluster(
    scheduler_address: str | None,
    cluster_class: str | None,
    cluster_kwargs: dict,
    workers: int,
    worker_log: Path | None = None,
    tls_ca_file: str | None = None,
    tls_cert: str | None = None,
    tls_key: str | None = None,
) -> Iterator[Client]:
    """The one cluster a run's stages share: an existing scheduler, a cluster class, or a LocalCluster.

    `cluster_class` is an import path (`distributed.LocalCluster`, "dask_cuda.LocalCUDACluster", ...: the
    keys of CLUSTER_KWARGS) built with `cluster_kwargs`, checked here again as the config checks them, so a
    run moves onto a GPU host or a batch system without code changes and a value never runs code. The TLS
    files, when given, secure every connection (TlsFiles.security). A local cluster's workers write their
    output to `worker_log` (dask_client); a local class's dashboard binds loopback unless told otherwise.
    """
    quiet_dask()
    tls = TlsFiles.parse(tls_ca_file, tls_cert, tls_key)
    if not cluster_class:
        with dask_client(scheduler_address, None if scheduler_address else workers,
                         worker_log=worker_log, tls=tls) as client:
            if scheduler_address:
                check_workers(client, workers)
            yield client
        return
    check_cluster_kwargs(cluster_class, cluster_kwargs, tls)
    cls = resolve_cluster_class(cluster_class)
    kwargs = dict(cluster_kwargs)
    if cluster_class in LOCAL_CLASSES:
        kwargs.setdefault("dashboard_address", LOOPBACK_DASHBOARD)
    if tls is not None:
        kwargs["security"] = tls.security()
    local = local_processes(worker_log) if cluster_class in LOCAL_CLASSES else contextlib.nullcontext()
    with local as adopt, cls(**kwargs) as cluster, Client(cluster, security=kwargs.get("security")) as client:
        if adopt is not None:
            adopt(client)
        if hasattr(cluster, "scale") and not cluster_kwargs.get("n_workers"):
            cluster.scale(workers)
        client.wait_for_workers(workers, timeout="600s")
        with contextlib.nullcontext() if cluster_class in LOCAL_CLASSES else heap_thresholds(client):
            yield client


@contextlib.contextmanager
def heap_thresholds(client: Client) -> Iterator[None]:
    """While this client uses a cluster it did not start, its workers keep large buffers on the heap
    (shardflow.heap), put back as the client is done with it unless another client still holds them. After a
    failure they stay until a worker restarts: a failing run (a lost scheduler among the causes) waits on
    nothing. Failing to put them back is logged, not raised: the run's own work is done."""
    name = f"{HEAP_PLUGIN}-{client.id}"
    client.register_plugin(HeapThresholds(), name=name)
    yield
    try:
        client.unregister_worker_plugin(name)
    except Exception as e:
        logging.getLogger(__name__).warning("the workers' heap thresholds were not put back: %s", e)


def resolve_cluster_class(path: str) -> type[Cluster]:
    """The class `path` names, if it is one of CLUSTER_KWARGS' Dask Cluster classes; else an InputError.

    Checked before anything is called or imported outside the packages CLUSTER_KWARGS names.
    """
    check_cluster_class(path)
    accepted = f"one of {', '.join(CLUSTER_KWARGS)}"
    module, _, name = path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except ModuleNotFoundError:
        package = module.partition(".")[0].replace("_", "-")
        raise InputError(f"cluster_class {path!r}: {package} is not installed here; accepted: {accepted}, its "
                         f"package installed (pip install {package})") from None
    except (ImportError, AttributeError, ValueError) as e:
        raise InputError(f"cluster_class {path!r}: {e}; accepted: {accepted} (its package installed)") from None
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
    closes, so this gives up after that and RECONNECT_MARGIN_S at most.
    """
    window = connect_timeout_s() + RECONNECT_MARGIN_S
    deadline = time.monotonic() + window
    while client.status in ("running", "connecting") and time.monotonic() < deadline:
        if client.status == "running":
            try:
                return client.sync(client.scheduler.identity, n_workers=-1)["workers"]
            except OSError:  # slow or briefly unreachable: ask again
                pass
        time.sleep(0.2)
    where = getattr(client.scheduler, "address", None) or "of this run"
    raise SchedulerLost(f"the Dask scheduler {where} is gone (no answer for {window:g} s)")
