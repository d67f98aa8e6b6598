"""The training task group of a model version: start the parameter servers, resume or warm-start, each
epoch and its checkpoint, keep the best epoch, the one download, release; a lost worker comes back from a
task as Lost, and the flow restores the cluster and resumes from the last complete checkpoint."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypeVar
from uuid import UUID

from distributed import Client
from prefect import get_run_logger, task
from prefect.artifacts import create_table_artifact, update_progress_artifact
from prefect.cache_policies import NONE

from shardflow.cluster import live_workers
from shardflow.config import RetrainConfig
from shardflow.errors import InputError, TrainingError, WorkerLost
from shardflow.model.metrics import Metrics
from shardflow.reporting.run_report import artifact_key
from shardflow.reporting.tables import number
from shardflow.training.config import EpochStats
from shardflow.training.engine import Engine
from shardflow.training.run import prepare, start_engine
from shardflow.training.validation import (
    SCORE_KEYS,
    VALIDATION_KEYS,
    best_epoch,
    score,
    validation_of,
    validation_values,
)
from storage.checkpoint import checkpoint_dir, complete_checkpoints, read_checkpoint, unreadable_checkpoints

T = TypeVar("T")


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


@dataclass(frozen=True)
class Lost:
    """A lost worker, handed to the flow as a task's result (see lost): why, in one line."""

    why: str


@dataclass(frozen=True)
class Resumed:
    """Where the resume task left the engine: the epochs done (0: none), the checkpoint restored (None: none),
    the bytes per step measured when it was written (None if none) and every newer one skipped, with why."""

    epochs_done: int
    checkpoint: str | None
    skipped: tuple[dict, ...]
    bytes_per_step: float | None


@task(name="resume", task_run_name="resume", cache_policy=NONE)
def resume(engine: Engine, run_dir: str) -> Resumed | Lost:
    """Restore the newest complete checkpoint that verifies."""

    log = get_run_logger()
    skipped = []
    for _, path, why in reversed(unreadable_checkpoints(run_dir)):  # newest first, as those tried below
        log.warning("checkpoint %s is unusable (%s); falling back to the one before", path, why)
        skipped.append({"checkpoint": str(path), "reason": why})
    for epochs_done, path in reversed(complete_checkpoints(run_dir)):
        try:
            m, moved = engine.restore(path)
        except WorkerLost as e:
            return lost("resume", e)
        except InputError as e:
            log.warning("checkpoint %s is unusable (%s); falling back to the one before", path, e)
            skipped.append({"checkpoint": str(path), "reason": str(e)})
            continue
        log.info("resumed from %s: %d epochs done, step %d%s", path, epochs_done, engine.step_count,
                 f"; its rows moved from the {m.devices} devices that wrote it onto this plan's "
                 f"{len(engine.actors)}" if moved else "")
        return Resumed(epochs_done, str(path), tuple(skipped), m.bytes_per_step)
    if skipped:
        log.warning("no usable checkpoint; training starts from the initial parameters")
    return Resumed(0, None, tuple(skipped), None)


@task(name="restore-cluster", task_run_name="restore-cluster-{attempt}", cache_policy=NONE)
def restore_cluster(engine: Engine | None, client: Client, devices: int, attempt: int, timeout_s: float) -> None:
    """After a lost worker: release the shards, restart this run's surviving workers, wait for enough.

    The survivors are restarted too (those with a nanny: a worker started without one
    cannot be), so no actor thread stays blocked on the lost peer. A TrainingError when
    fewer workers than devices are back after `timeout_s`.
    """
    log = get_run_logger()
    ours = []
    if engine is not None:
        ours = list(engine.workers)
        engine.close()
    workers = live_workers(client)
    alive = [w for w in ours if workers.get(w, {}).get("nanny")]  # only a nanny can restart its worker
    if alive:
        status = client.restart_workers(alive, timeout=timeout_s, raise_for_error=False)
        log.info("restarted workers %s", status)
    try:
        client.wait_for_workers(devices, timeout=timeout_s)
    except TimeoutError:
        have = len(live_workers(client))
        raise TrainingError(
            f"the cluster has {have} of the {devices} workers the plan needs after waiting {timeout_s:.0f} s "
            "(restart_timeout_s) for lost ones to come back (a worker without a nanny, or whose nanny died, does "
            "not); bring workers back, or start a cluster, and run again, or run again with a topology of the "
            "devices left"
        ) from None
    log.info("restore %d: %d workers up", attempt, len(live_workers(client)))


def publish_epoch_metrics(version_dir: str, run_dir: str, modeled_bytes_per_step: float) -> None:
    """The epoch-metrics table of a model version: one row per complete checkpoint, every row with every column.

    Built from the checkpoints, so it spans resumed runs; under one key per run_dir, so
    the UI keeps its history night after night. Made to fit the UI's artifact width (about 1,000 px at
    1,600): a metric no epoch has (log-loss of a sequence model, val_ without a split) is left out, traffic
    is the measured MB per step and its ratio to the model's; numbers are text with thousands separators and
    a fixed number of decimals per unit.
    """
    mb, rows = 1e6, []
    figures = [(epoch, read_checkpoint(path).figures) for epoch, path in complete_checkpoints(version_dir)]
    metrics = [k for k in ("auc", "hr_at_10", "ndcg_at_10", "logloss", *VALIDATION_KEYS)
               if any(f[k] is not None for _, f in figures)]
    for epoch, info in figures:
        measured = info["bytes_per_step"]
        rows.append({"epoch": epoch, "loss": number(info["loss"], 4), **{k: number(info[k], 4) for k in metrics},
                     "examples/s": number(info["examples_per_s"], 0), "seconds": number(info["seconds"], 1),
                     "MB/step": number(None if measured is None else measured / mb, 3),
                     # a plan with nothing to send (one device) has no ratio
                     "measured/modeled": number(None if measured is None or not modeled_bytes_per_step
                                                else measured / modeled_bytes_per_step, 3)})
    create_table_artifact(
        rows,
        key=artifact_key("epoch-metrics", run_dir),
        description=f"Per epoch: loss, held-out metrics (val_: on the validation split), speed, traffic measured "
                    f"and its ratio to the plan's model ({modeled_bytes_per_step / mb:,.3f} MB/step) ({version_dir})",
    )


PROGRESS_EVERY_S = 2.0  # how often a training epoch moves its progress artifact


@dataclass(frozen=True)
class EpochDone:
    """A trained epoch: what it did, the model's held-out metrics after it, and its validation split's (val_
    keys; none without a split)."""

    stats: EpochStats
    metrics: Metrics
    validation: dict

    def figures(self, bytes_per_step: float) -> dict:
        """What its checkpoint keeps (storage.checkpoint.CheckpointManifest's figures), with the bytes per step
        measured so far."""
        return {"loss": self.stats.loss, **self.metrics.values(), **validation_of(self.validation),
                "bytes_per_step": bytes_per_step, "examples_per_s": self.stats.examples_per_s,
                "seconds": self.stats.seconds}


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
        done = EpochDone(stats, engine.evaluate(),
                         validation_values(engine.evaluate("validation")) if engine.train.validation else {})
    except WorkerLost as e:
        return lost(f"epoch {epoch}", e)
    get_run_logger().info("epoch %d: %d steps, loss %.4f, AUC %.4f, %.0f examples/s", epoch, stats.steps,
                          stats.loss, done.metrics.auc, stats.examples_per_s)
    return done


@task(name="checkpoint", task_run_name="checkpoint-epoch-{epoch}", cache_policy=NONE)
def checkpoint(engine: Engine, run_dir: str, epoch: int, figures: dict) -> str | Lost:
    """The checkpoint after epoch `epoch` (numbered from 1), with what it measured (`figures`,
    storage.checkpoint.CheckpointManifest's): its path, or Lost (see lost)."""
    path = checkpoint_dir(run_dir, epoch)
    try:
        engine.checkpoint(path, epoch, figures)
    except WorkerLost as e:
        return lost(f"checkpoint {epoch}", e)
    return str(path)


def validation_scores(version_dir: str) -> dict[int, float]:
    """Epoch (from 1) -> its validation score, from the version's complete checkpoints that have one."""
    infos = {e: read_checkpoint(p).figures for e, p in complete_checkpoints(version_dir)}
    return {e: score(i) for e, i in infos.items() if any(i.get(k) is not None for k in SCORE_KEYS)}


@dataclass(frozen=True)
class Kept:
    """The epoch the download takes: of `epochs` trained, `best_epoch` (None without a validation split),
    with its validation metrics under their val_ keys (empty without a split)."""

    epochs: int
    best_epoch: int | None
    validation: dict


@task(name="keep-best-epoch", task_run_name="keep-best-epoch", cache_policy=NONE)
def keep_best(engine: Engine, version_dir: str, patience: int | None) -> Kept | Lost:
    """With a validation split, the best-scoring epoch, restored from its checkpoint unless it is the last;
    or Lost (see lost)."""
    found = dict(complete_checkpoints(version_dir))
    epochs = max(found, default=0)
    best = best_epoch(validation_scores(version_dir)) if patience is not None else None
    if best is None:
        return Kept(epochs, None, {})
    if best != epochs:
        try:
            engine.restore(found[best])
        except WorkerLost as e:
            return lost("restoring the best epoch", e)
        get_run_logger().info("kept epoch %d of %d: the best validation score", best, epochs)
    return Kept(epochs, best, validation_of(read_checkpoint(found[best]).figures))


@task(name="download", task_run_name="download", cache_policy=NONE)
def download(engine: Engine, out: str, epochs: int, best_epoch: int | None, strategy: str) -> str | Lost:
    """The one parameter download of a run, after the last epoch: the model's path, or Lost (see lost)."""
    try:
        engine.export(out, epochs, best_epoch, strategy)
    except WorkerLost as e:
        return lost("download", e)
    get_run_logger().info("model exported to %s", out)
    return out


@dataclass
class Attempts:
    """What a version's attempts share: each epoch's loss (by epoch, from 1), the warnings, the progress
    artifact."""

    losses: dict[int, float] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    progress: UUID | None = None


@dataclass(frozen=True)
class Trained:
    """A version's training: the epoch kept, the bytes per step measured, where it resumed, what it took."""

    chosen: Kept
    bytes_per_step: float | None
    downloads: int
    resumed: Resumed
    losses: dict[int, float] = field(default_factory=dict)
    restarts: int = 0
    warnings: tuple[str, ...] = ()


def unless_lost(result: T | Lost) -> T:
    """A task's result, or the WorkerLost it handed back (see lost), raised in the flow that recovers it."""
    if isinstance(result, Lost):
        raise WorkerLost(result.why)
    return result


def lost(what: str, e: WorkerLost) -> Lost:
    """A lost worker, handed to the flow as a result: it restores the cluster and resumes from the last
    checkpoint, so the loss is a warning in the run's summary, not a red task inside a Completed run."""
    get_run_logger().warning("%s stopped: %s", what, e)
    return Lost(str(e))


@task(name="exit", task_run_name="exit", cache_policy=NONE)
def release_parameter_servers(engine: Engine | None) -> None:
    if engine is not None:
        engine.close()


def kept_note(version: str) -> str:
    """What a stopped run leaves for the next one."""
    if complete_checkpoints(version):
        return (f"the checkpoints in {version} are kept: a new run resumes from the last complete one (on a new "
                "plan if its topology has other devices)")
    return f"no checkpoint of {version} was complete yet: a new run starts it from the beginning"


def checkpoint_losses(version: str) -> dict[int, float]:
    """Each epoch's loss as its complete checkpoint recorded it (by epoch, from 1): what a resumed run did not
    train itself."""
    return {epoch: read_checkpoint(path).figures["loss"] for epoch, path in complete_checkpoints(version)}


def checkpoint_paths(version: str) -> list[str]:
    """The complete checkpoints of a version directory, oldest first."""
    return [str(p) for _, p in complete_checkpoints(version)]
