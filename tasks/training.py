"""The training task group of a model version: start the parameter servers, resume or warm-start, each
epoch and its checkpoint, keep the best epoch, the one download, release. The steps are the core's
(shardflow.training.epochs, .engine); a lost worker comes back from a task as Lost, and the flow restores the
cluster and resumes from the last complete checkpoint."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

from distributed import Client
from prefect import get_run_logger, task
from prefect.artifacts import update_progress_artifact
from prefect.cache_policies import NONE

from shardflow.config import RetrainConfig
from shardflow.errors import WorkerLost
from shardflow.training.engine import Engine
from shardflow.training.epochs import (
    EpochDone,
    Kept,
    Resumed,
    keep_best_epoch,
    restart_workers,
    resume_newest,
    retire_checkpoints,
)
from shardflow.training.run import prepare, start_engine
from storage.checkpoint import checkpoint_dir

T = TypeVar("T")
PROGRESS_EVERY_S = 2.0  # how often a training epoch moves its progress artifact


@dataclass(frozen=True)
class Lost:
    """A lost worker, handed to the flow as a task's result (see lost): why, in one line."""

    why: str


def lost(what: str, e: WorkerLost) -> Lost:
    """A lost worker, handed to the flow as a result: it restores the cluster and resumes from the last
    checkpoint, so the loss is a warning in the run's summary, not a red task inside a Completed run."""
    get_run_logger().warning("%s stopped: %s", what, e)
    return Lost(str(e))


def unless_lost(result: T | Lost) -> T:
    """A task's result, or the WorkerLost it handed back (see lost), raised in the flow that recovers it."""
    if isinstance(result, Lost):
        raise WorkerLost(result.why)
    return result


@task(name="start-parameter-servers", task_run_name="start-parameter-servers", cache_policy=NONE)
def start_parameter_servers(config: RetrainConfig, dataset: str, plan_path: str, client: Client,
                            estimate: bool = False, window: tuple[int, int] = (0, 0)) -> Engine:
    job = prepare(dataset, plan_path, config.training(window), mlp=tuple(config.model.mlp),
                  bottom=tuple(config.model.bottom_mlp), optimizer=config.optimizer(), encoder=config.encoder_options(),
                  estimate=estimate)
    if job.scaled_rows is not None:
        get_run_logger().info("estimation: one parameter server, rows scaled to %s", job.scaled_rows)
    engine = start_engine(client, job)
    get_run_logger().info("parameter servers up on %d devices (Dask dashboard: %s)", job.topology.devices,
                          client.dashboard_link)
    return engine


@task(name="resume", task_run_name="resume", cache_policy=NONE)
def resume(engine: Engine, run_dir: str) -> Resumed | Lost:
    """Restore the newest complete checkpoint that verifies (shardflow.training.epochs.resume_newest)."""
    try:
        return resume_newest(engine, run_dir, get_run_logger())
    except WorkerLost as e:
        return lost("resume", e)


@task(name="restore-cluster", task_run_name="restore-cluster-{attempt}", cache_policy=NONE)
def restore_cluster(engine: Engine | None, client: Client, devices: int, attempt: int, timeout_s: float) -> None:
    """After a lost worker: release the shards, restart the surviving workers, wait for enough
    (shardflow.training.epochs.restart_workers)."""
    up = restart_workers(engine, client, devices, timeout_s, get_run_logger())
    get_run_logger().info("restore %d: %d workers up", attempt, up)


@task(name="train-epoch", task_run_name="train-epoch-{epoch}", cache_policy=NONE)
def train_epoch(engine: Engine, epoch: int, epochs: int | None = None, progress=None) -> EpochDone | Lost:
    """Train epoch `epoch` (numbered from 1, as checkpoints and plots are).

    With a progress artifact, moves it every PROGRESS_EVERY_S seconds and at the end:
    "epoch 2/3 · step 30/54 · loss 0.371 · 41k examples/s".
    """
    last = [0.0]

    def report(done: int, steps: int, loss: float, examples: int, seconds: float) -> None:
        if progress is None or (seconds - last[0] < PROGRESS_EVERY_S and done < steps):
            return
        last[0] = seconds
        update_progress_artifact(
            progress, 100.0 * (epoch - 1 + done / steps) / epochs,
            description=f"epoch {epoch}/{epochs} · step {done}/{steps} · loss {loss:.3f} · "
                        f"{examples / max(seconds, 1e-9) / 1e3:.0f}k examples/s",
        )

    try:
        stats = engine.train_epoch(epoch - 1, on_step=report)
        done = EpochDone(stats, engine.evaluate(), engine.validate() if engine.train.validation else {})
    except WorkerLost as e:
        return lost(f"epoch {epoch}", e)
    get_run_logger().info("epoch %d: %d steps, loss %.4f, AUC %.4f, %.0f examples/s", epoch, stats.steps,
                          stats.loss, done.metrics.auc, stats.examples_per_s)
    return done


@task(name="checkpoint", task_run_name="checkpoint-epoch-{epoch}", cache_policy=NONE)
def checkpoint(engine: Engine, run_dir: str, epoch: int, figures: dict, keep: int | None = None,
               scored: bool = False) -> str | Lost:
    """The checkpoint after epoch `epoch` (numbered from 1), with what it measured (`figures`,
    storage.checkpoint.CheckpointManifest's), then the older ones retired but the newest `keep` and, when epochs are
    `scored`, the best (shardflow.training.epochs.retire_checkpoints): its path, or Lost (see lost)."""
    path = checkpoint_dir(run_dir, epoch)
    try:
        engine.checkpoint(path, epoch, figures)
    except WorkerLost as e:
        return lost(f"checkpoint {epoch}", e)
    retired = retire_checkpoints(run_dir, keep, scored)
    if retired:
        get_run_logger().info("retired the checkpoints of epochs %s: their records kept, their shards deleted "
                              "(keep_checkpoints %s)", retired, keep)
    return str(path)


@task(name="keep-best-epoch", task_run_name="keep-best-epoch", cache_policy=NONE)
def keep_best(engine: Engine, version_dir: str, patience: int | None) -> Kept | Lost:
    """With a validation split, the best-scoring epoch (shardflow.training.epochs.keep_best_epoch), or Lost."""
    try:
        return keep_best_epoch(engine, version_dir, patience, get_run_logger())
    except WorkerLost as e:
        return lost("restoring the best epoch", e)


@task(name="download", task_run_name="download", cache_policy=NONE)
def download(engine: Engine, out: str, epochs: int, best_epoch: int | None, strategy: str) -> str | Lost:
    """The one parameter download of a run, after the last epoch: the model's path, or Lost (see lost)."""
    try:
        engine.export(out, epochs, best_epoch, strategy)
    except WorkerLost as e:
        return lost("download", e)
    get_run_logger().info("model exported to %s", out)
    return out


@task(name="exit", task_run_name="exit", cache_policy=NONE)
def release_parameter_servers(engine: Engine | None) -> None:
    if engine is not None:
        engine.close()
