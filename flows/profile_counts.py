"""Profiling on its own: dataset -> per-row access counts (the first stage of a retraining run)."""

from __future__ import annotations

from prefect import flow

from shardflow.cluster import dask_client
from storage.profile import TableStats
from tasks.profiling import profile


@flow(name="profile")
def profile_flow(
    dataset: str,
    out: str,
    scheduler_address: str | None = None,
    workers: int | None = None,
    overwrite: bool = False,
) -> dict[str, TableStats]:
    with dask_client(scheduler_address, workers) as client:
        return profile(dataset, out, client.scheduler.address, overwrite)
