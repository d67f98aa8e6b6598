"""How `shardflow run` starts a retraining run: the checks before any write, a night with nothing new answered
from the stores, then a local cluster's worker server and the embedded Prefect API started side by side with
the flow's imports, and the flow."""

from __future__ import annotations

import importlib
import os

from shardflow.config import RetrainConfig


def launch(config: RetrainConfig, verbose: bool = False) -> dict:
    """Run `config`'s retraining flow as `shardflow run` does; its summary as a dict (the JSON the command prints)."""
    from shardflow.preflight import check_run

    # The embedded server would try to send usage telemetry; these machines may have no network.
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    check_run(config)
    from shardflow.lifecycle import nothing_new

    idle = nothing_new(config)  # a night with nothing new: answered from the stores, no Prefect API, no cluster
    if idle is not None:
        return idle.to_dict()
    from shardflow.cluster import VERBOSE, quiet_dask, start_worker_server

    if verbose:
        os.environ[VERBOSE] = "1"
    quiet_dask()
    if not (config.cluster.scheduler_address or config.cluster.cluster_class):
        start_worker_server()  # a local cluster's: its imports overlap the embedded API's start
    from cli.embedded_api import embedded_api

    # The flow's imports (PyTorch, Prefect's engine: 4-7 s) overlap the embedded API's start-up.
    with embedded_api(meanwhile=lambda: importlib.import_module("flows.retrain")):
        from flows.retrain import retrain

        return retrain(config)
