"""The estimation run (as Caffe2 estimates): the retraining config on one parameter server.

Every table lives on device 0 (scaled by one common factor if the tables exceed its
device_memory_bytes); trainers are unchanged. It reports throughput and traffic; it
writes no checkpoints and no model, only its profile and plan under RUN_DIR/estimate. It trains
`epochs` epochs without patience; with patience (the default), whose early stopping needs validation
scores an estimate does not compute, one.
"""

from __future__ import annotations

import shutil

from prefect import flow, get_run_logger

from shardflow.cluster import run_cluster
from shardflow.config import RetrainConfig
from shardflow.errors import one_line_errors
from storage.lock import run_lock
from tasks.retrain import prepare_dataset, profile, shard
from tasks.training import release_parameter_servers, start_parameter_servers, train_epoch, unless_lost


def epochs_of(config: RetrainConfig) -> int:
    return config.train.epochs if config.train.patience is None else 1


def _run_name() -> str:
    from prefect.runtime import flow_run

    config = flow_run.parameters.get("config") or RetrainConfig()
    return f"estimate-{epochs_of(config if isinstance(config, RetrainConfig) else RetrainConfig.build(config))}-epochs"


@flow(name="estimate", flow_run_name=_run_name)
def estimate(config: RetrainConfig = RetrainConfig()) -> dict:
    one_line_errors()
    layout = config.layout
    scratch = layout.estimate
    devices = config.parsed_topology.devices
    with run_lock(layout.run), run_cluster(**dict(config.cluster), workers=devices) as client:
        dataset = prepare_dataset(config).path
        shutil.rmtree(scratch, ignore_errors=True)  # the last estimate's profile and plan, under the run's lock
        profile(dataset, str(scratch / "profile"), client, str(layout.run))
        shard(config, str(scratch / "profile"), str(scratch / "plan"), None)
        engine = None
        try:
            engine = start_parameter_servers(config, dataset, str(scratch / "plan"), client, estimate=True)
            # Estimation writes no checkpoints to resume from: a lost worker ends the run.
            epochs = [unless_lost(train_epoch(engine, e)).stats for e in range(1, epochs_of(config) + 1)]
            traffic = engine.traffic()
        finally:
            release_parameter_servers(engine)
    steps = sum(e.steps for e in epochs)
    summary = {
        "epochs": epochs_of(config),
        "examples_per_s": sum(e.examples for e in epochs) / sum(e.seconds for e in epochs),
        "bytes_per_step": traffic.modeled_bytes / max(steps, 1),
        "epoch_loss": [e.loss for e in epochs],
    }
    get_run_logger().info("estimation: %s", summary)
    return summary
