"""A training job from stores: the one place a dataset and a plan become an engine.

`prepare` reads the plan and checks it against the dataset, builds the model from the
plan's shape (its cost model assumed the dimension, history window and negatives): the
sequence model with every table of the dataset other than the item sequence as a
categorical feature, or for a click log the DLRM over all its tables, and predicts the
bytes per step; `start_engine` starts the Dask engine on it and
`in_process` runs all its devices in this process. `shardflow train` (prepare, then train_job)
and the retraining flow both build their engines this way.
"""

from __future__ import annotations

import logging
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from distributed import Client

from shardflow.data.batches import TrainData
from shardflow.data.clicks import ClickData, config_record, load_training_data, model_config
from shardflow.errors import InputError
from shardflow.model.configs import ClickConfig, ModelConfig, OptimizerConfig
from shardflow.model.metrics import Metrics
from shardflow.planner.costmodel import StepShape
from shardflow.planner.estimation import estimation_plan
from shardflow.planner.sharding_plan import ShardingPlan
from shardflow.planner.topology import Topology
from shardflow.sharding.stage import accesses_from_profile, cost_model, read_plan
from shardflow.training.config import TrainConfig, check_batch
from shardflow.training.device import Device
from shardflow.training.engine import Engine
from shardflow.training.inprocess import InProcess
from shardflow.training.validation import validation_of
from storage.dataset import Dataset
from storage.profile import Profile

log = logging.getLogger("shardflow.train")


@dataclass(frozen=True)
class TrainingJob:
    dataset: str
    plan: ShardingPlan  # the plan to train (the estimation plan in estimation mode)
    topology: Topology
    model: ModelConfig | ClickConfig
    optimizer: OptimizerConfig
    train: TrainConfig
    scaled_rows: dict[str, int] | None  # estimation mode: rows per table on the one server
    predicted_bytes_per_step: float  # the cost model's figure for `plan`


def prepare(
    dataset: str | Path,
    plan_path: str | Path,
    train: TrainConfig,
    *,
    mlp: tuple[int, ...] = ModelConfig.mlp,
    bottom: tuple[int, ...] = ClickConfig.bottom,
    optimizer: OptimizerConfig | None = None,
    encoder: dict[str, Any] | None = None,
    estimate: bool = False,
    server_memory_bytes: int | None = None,
) -> TrainingJob:
    """The job of training `dataset` on the plan at `plan_path`, refused before any work if they do not match."""
    ds = Dataset.open(dataset)
    stored = read_plan(plan_path)
    plan, topology, shape, manifest = stored.plan, stored.topology, stored.shape, stored.manifest
    profile = Profile.open(manifest.source.profile)
    made_from = profile.dataset.checksum
    if made_from != ds.info.checksum:
        raise InputError(
            f"plan {plan_path} was made from a profile of dataset {profile.dataset.path} "
            f"(checksum {made_from}), not of {dataset} ({ds.info.checksum}); accepted: a plan of this dataset"
        )
    source = manifest.source
    model = model_config(ds, dim=shape.dim, mlp=mlp, bottom=bottom, history=source.history,
                         negatives=source.negatives, seed=train.seed, encoder=encoder)
    # the engine's own check, made again here so that a batch its cluster would refuse is refused before one starts
    # (a local one took 6 s on 2 cores to say so): the examples' index is read in milliseconds (22 ms for Video)
    examples = load_training_data(ds, model.features, train.window, validation=train.validation).targets
    check_batch(train.batch_size, topology.devices, examples)
    optimizer = optimizer or OptimizerConfig(rows=shape.row_optimizer)
    scaled = None
    if estimate:
        budget = server_memory_bytes if server_memory_bytes is not None else topology.device_memory_bytes
        plan, scaled, factor = estimation_plan({t.name: t.rows for t in plan.tables}, shape.dim, budget,
                                               optimizer.rows)
        log.info("estimation: every table on device 0, rows scaled by %.4f", factor)
    accesses = {a.name: a for a in accesses_from_profile(profile, source.history, source.negatives)}
    step = StepShape(train.batch_size, shape.dim, train.dedup, optimizer.rows)
    predicted = cost_model(profile, list(accesses.values()), topology, step, source.history,
                           source.negatives).evaluate(plan, accesses)
    return TrainingJob(str(dataset), plan, topology, model, optimizer, train, scaled,
                       predicted.bytes_per_step)


def start_engine(client: Client, job: TrainingJob) -> Engine:
    return Engine(client, job.dataset, job.plan, job.topology, job.model, job.optimizer, job.train, job.scaled_rows)


def in_process(job: TrainingJob, data: TrainData | ClickData | None = None) -> InProcess:
    """Every device of the job in this process (no cluster): for tests and single-machine checks."""
    data = data or load_training_data(job.dataset, job.model.features, job.train.window,
                                      validation=job.train.validation)
    tables = job.plan.for_devices(job.topology.devices)
    return InProcess([
        Device(d, job.topology, tables, data, job.model, job.optimizer, batch_size=job.train.batch_size,
               dedup=job.train.dedup, array_device=job.train.device, scaled_rows=job.scaled_rows)
        for d in range(job.topology.devices)
    ])


@dataclass(frozen=True)
class JobShape:
    """What a training job was: its plan's strategy on how many devices, the step and the model."""

    strategy: str
    devices: int
    dedup: str
    batch_size: int
    row_optimizer: str
    patience: int | None
    model: dict[str, Any]  # the model's record (shardflow.data.clicks.config_record)


@dataclass(frozen=True)
class Progress:
    """What the training did: steps, examples and their rate, the steady steps (after the engine's warm-up;
    when the first began and the last ended on CLOCK_MONOTONIC, None without one), each epoch's loss and the
    epoch kept (None without a validation split)."""

    steps: int
    examples: int
    examples_per_s: float
    steady_steps: int
    steady_monotonic_s: tuple[float, float] | None
    epoch_loss: tuple[float, ...]
    best_epoch: int | None

    @property
    def loss(self) -> float:
        return self.epoch_loss[-1] if self.epoch_loss else float("nan")


@dataclass(frozen=True)
class StepFigures:
    """Per step: bytes measured against the plan's cost model, bytes by round, and the slowest device's
    seconds by part."""

    measured_bytes_per_step: float
    predicted_bytes_per_step: float
    bytes_per_step: dict[str, float]
    seconds_per_step: dict[str, float]


@dataclass(frozen=True)
class JobResult:
    """A training job's outcome (train_job): the job, what it did, per-step figures, the held-out
    metrics and the validation figures (val_ keys of the epoch kept; every epoch's, oldest first)."""

    job: JobShape
    progress: Progress
    per_step: StepFigures
    metrics: Metrics
    validation: dict[str, float | None]
    epoch_validation: tuple[dict[str, float | None], ...]

    def record(self) -> dict[str, Any]:
        """The flat JSON `shardflow train --json` prints."""
        p, j = self.progress, self.job
        return {
            "steps": p.steps, "examples": p.examples, "examples_per_s": p.examples_per_s,
            "steady_steps": p.steady_steps,
            # bench/emulated_cluster.py reads the links' byte counters over this window
            "steady_monotonic_s": None if p.steady_monotonic_s is None else list(p.steady_monotonic_s),
            "measured_bytes_per_step": self.per_step.measured_bytes_per_step,
            "predicted_bytes_per_step": self.per_step.predicted_bytes_per_step,
            **self.metrics.values(),
            "loss": p.loss,
            "strategy": j.strategy, "model": j.model, "row_optimizer": j.row_optimizer, "devices": j.devices,
            "dedup": j.dedup, "batch_size": j.batch_size, "eval_users": self.metrics.users,
            "epoch_loss": list(p.epoch_loss), "epochs_trained": len(p.epoch_loss), "best_epoch": p.best_epoch,
            "patience": j.patience,
            **self.validation,
            "epoch_validation": list(self.epoch_validation),
            "bytes_per_step": self.per_step.bytes_per_step,
            "seconds_per_step": self.per_step.seconds_per_step,
        }


def train_job(client: Client, job: TrainingJob) -> JobResult:
    """Train a prepared job for its train.epochs (or train.max_steps) and evaluate (JobResult; `record()`: the
    summary `shardflow train --json` prints)."""
    train = job.train
    with start_engine(client, job) as engine, tempfile.TemporaryDirectory(prefix="shardflow-best-") as keep:
        log.info("training %s on %d devices: batch %d, dedup %s", job.plan.strategy, job.topology.devices,
                 train.batch_size, train.dedup)
        result = engine.fit(best=Path(keep) / "best")
        metrics = engine.evaluate()
        traffic = engine.traffic()
    steps = max(result.steps, 1)
    steady = result.steady
    return JobResult(
        job=JobShape(job.plan.strategy, job.topology.devices, train.dedup, train.batch_size, job.optimizer.rows,
                     train.patience, config_record(job.model)),
        progress=Progress(result.steps, result.examples, result.examples_per_s, steady.steps,
                          (steady.began, steady.ended) if steady.steps else None, tuple(result.epoch_loss),
                          result.best_epoch),
        per_step=StepFigures(traffic.modeled_bytes / steps, job.predicted_bytes_per_step,
                          {k: v / steps for k, v in traffic.sums().items() if k != "eval"}, dict(result.timings)),
        metrics=metrics,
        validation=validation_of(result.validation.get(result.best_epoch or 0, {})),
        epoch_validation=tuple(result.validation[e] for e in sorted(result.validation)),
    )
