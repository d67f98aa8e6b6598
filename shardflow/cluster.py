"""One place that opens the Dask cluster a job runs on."""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
from collections.abc import Iterator

import dask
from distributed import Client, LocalCluster

from shardflow.errors import InputError


def default_workers() -> int:
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)


@contextlib.contextmanager
def dask_client(scheduler_address: str | None = None, workers: int | None = None, gpus: bool = False) -> Iterator[Client]:
    """A client on an existing scheduler, or on a LocalCluster of `workers` single-threaded processes.

    Profiling and training kernels are numpy and hold the GIL in parts, so a local
    device is a process with one thread. With `gpus`, every local worker offers the
    resource GPU=1 (one worker per GPU; CUDA device d for worker d).
    """
    if scheduler_address:
        if workers is not None:
            raise InputError("--workers applies to a local cluster; it cannot be combined with --scheduler")
        with Client(scheduler_address, timeout="30s") as client:
            yield client
        return
    workers = default_workers() if workers is None else workers
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise InputError(f"workers = {workers!r}; accepted: an integer >= 1")
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
        yield client


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
            yield client
        return
    module, _, name = cluster_class.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as e:
        raise InputError(f"cluster_class {cluster_class!r}: {e}; accepted: an importable Dask cluster class") from None
    with cls(**cluster_kwargs) as cluster, Client(cluster) as client:
        if hasattr(cluster, "scale") and not cluster_kwargs.get("n_workers"):
            cluster.scale(workers)
        client.wait_for_workers(workers, timeout="600s")
        yield client


def worker_count(client: Client) -> int:
    return max(1, len(client.scheduler_info()["workers"]))
