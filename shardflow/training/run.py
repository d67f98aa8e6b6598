"""Training from stores without Prefect: dataset + plan -> trained shards, traffic and metrics.

`shardflow train` calls `train_from_stores`; the orchestrated run builds on the same parts.
The model takes the plan's embedding dimension, history window and negatives (the plan's
cost model assumed them), and every table of the dataset other than the item sequence
as a categorical feature.
"""

from __future__ import annotations

import logging
from pathlib import Path

from distributed import Client

from shardflow.errors import InputError
from shardflow.model import ModelConfig
from shardflow.optim import OptimizerConfig
from shardflow.planner.costmodel import CostModel, StepShape
from shardflow.planning import accesses_from_profile
from shardflow.training.engine import Engine, TrainConfig, estimation_plan
from storage.dataset import Dataset
from storage.plan import read_plan
from storage.profile import Profile

log = logging.getLogger("shardflow.train")


def train_from_stores(
    dataset: str | Path,
    plan_path: str | Path,
    client: Client,
    train: TrainConfig,
    *,
    mlp: tuple[int, ...] = ModelConfig.mlp,
    optimizer: OptimizerConfig | None = None,
    estimate: bool = False,
    server_memory_bytes: int | None = None,
) -> dict:
    """Train for train.epochs (or train.max_steps) and evaluate; the summary `shardflow train --json` prints."""
    ds = Dataset.open(dataset)
    plan, topology, shape, manifest = read_plan(plan_path)
    profile = Profile.open(manifest["source"]["profile"])
    made_from = profile.manifest["dataset"]["checksum"]
    if made_from != ds.info.checksum:
        raise InputError(
            f"plan {plan_path} was made from a profile of dataset {profile.manifest['dataset']['path']} "
            f"(checksum {made_from}), not of {dataset} ({ds.info.checksum}); accepted: a plan of this dataset"
        )
    source = manifest["source"]
    model = ModelConfig(
        dim=shape.dim, mlp=tuple(mlp), history=source["history"], negatives=source["negatives"],
        features=ds.info.feature_tables,
    )
    accesses = {a.name: a for a in accesses_from_profile(profile, source["history"], source["negatives"])}
    scaled = None
    if estimate:
        budget = server_memory_bytes if server_memory_bytes is not None else topology.device_memory_bytes
        plan, scaled, factor = estimation_plan({t.name: t.rows for t in plan.tables}, shape.dim, budget)
        log.info("estimation: every table on device 0, rows scaled by %.4f", factor)
    predicted = CostModel(topology, StepShape(train.batch_size, shape.dim, train.dedup)).evaluate(plan, accesses)
    with Engine(client, str(dataset), plan, topology, model, optimizer or OptimizerConfig(), train, scaled) as engine:
        log.info("training %s on %d devices: batch %d, dedup %s", plan.strategy, topology.devices, train.batch_size, train.dedup)
        result = engine.fit()
        metrics = engine.evaluate()
        traffic = engine.traffic()
    steps = max(result.steps, 1)
    return {
        "steps": result.steps,
        "examples": result.examples,
        "examples_per_s": result.examples / result.seconds if result.seconds else 0.0,
        "measured_bytes_per_step": float(traffic["lookup"].sum() + traffic["sync"].sum()) / steps,
        "predicted_bytes_per_step": predicted.bytes_per_step,
        "auc": metrics["auc"],
        "hr_at_10": metrics["hr_at_10"],
        "loss": result.epoch_loss[-1] if result.epoch_loss else float("nan"),
        "strategy": plan.strategy,
        "devices": topology.devices,
        "dedup": train.dedup,
        "batch_size": train.batch_size,
        "eval_users": metrics["users"],
        "epoch_loss": result.epoch_loss,
        "bytes_per_step": {k: float(v.sum()) / steps for k, v in traffic.items() if k != "eval"},
        "seconds_per_step": result.timings,
    }
