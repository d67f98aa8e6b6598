"""The profiling task group: count every row's accesses on the run's Dask cluster."""

from __future__ import annotations

from distributed import Client
from prefect import get_run_logger, task
from prefect.artifacts import create_table_artifact

from shardflow.profiling.profiles import check_inputs, profile_dataset
from storage.profile import TableStats


@task(name="profile-dataset", task_run_name="profile-{dataset}")
def profile(dataset: str, out: str, scheduler_address: str, overwrite: bool = False) -> dict[str, TableStats]:
    """Profile `dataset` into `out` on the cluster at `scheduler_address`; returns per-table stats."""
    check_inputs(dataset, out, overwrite=overwrite)
    with Client(scheduler_address) as client:
        manifest = profile_dataset(dataset, out, client=client, overwrite=overwrite)
    stats = manifest.tables
    get_run_logger().info("profiled %d tables of %s into %s", len(stats), dataset, out)
    create_table_artifact(
        [{"table": name, **s.to_dict()} for name, s in stats.items()],
        key="profile",
        description=f"Row access skew of {dataset}",
    )
    return stats
