"""A model version's epochs as a run keeps them: where a resume left off, each trained epoch and what its
checkpoint records, the epoch kept for the download, what the attempts of a version share and what its training
came to — and the steps behind the training tasks (resume, keep the best epoch, restart a cluster's workers).

A lost worker surfaces here as WorkerLost; the flow restores the cluster and resumes from
the last complete checkpoint (docs/reliability.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from logging import Logger, LoggerAdapter
from pathlib import Path
from typing import Any
from uuid import UUID

from distributed import Client

from shardflow.cluster import live_workers
from shardflow.errors import InputError, TrainingError
from shardflow.model.metrics import Metrics
from shardflow.training.config import EpochStats
from shardflow.training.engine import Engine
from shardflow.training.validation import SCORE_KEYS, best_epoch, epoch_scores, validation_of
from storage.checkpoint import (
    complete_checkpoints,
    epoch_records,
    read_checkpoint,
    retire_checkpoint,
    unreadable_checkpoints,
)

Log = Logger | LoggerAdapter[Logger]


@dataclass(frozen=True)
class Resumed:
    """Where the resume left the engine: the epochs done (0: none), the checkpoint restored (None: none),
    the bytes per step measured when it was written (None if none) and every newer one skipped, with why."""

    epochs_done: int
    checkpoint: str | None
    skipped: tuple[dict[str, Any], ...]
    bytes_per_step: float | None


@dataclass(frozen=True)
class EpochDone:
    """A trained epoch: what it did, the model's held-out metrics after it, and its validation split's (val_
    keys; none without a split)."""

    stats: EpochStats
    metrics: Metrics
    validation: dict[str, float | None]

    def figures(self, bytes_per_step: float) -> dict[str, Any]:
        """What its checkpoint keeps (storage.checkpoint.CheckpointManifest's figures), with the bytes per step
        measured so far."""
        return {"loss": self.stats.loss, **self.metrics.values(), **validation_of(self.validation),
                "bytes_per_step": bytes_per_step, "examples_per_s": self.stats.examples_per_s,
                "seconds": self.stats.seconds}


@dataclass(frozen=True)
class Kept:
    """The epoch the download takes: of `epochs` trained, `best_epoch` (None without a validation split),
    with its validation metrics under their val_ keys (empty without a split)."""

    epochs: int
    best_epoch: int | None
    validation: dict[str, float | None]


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


def resume_newest(engine: Engine, version_dir: str | Path, log: Log) -> Resumed:
    """Restore the newest complete checkpoint of `version_dir` that verifies, logging each newer one skipped and
    why; WorkerLost if a worker is lost meanwhile."""
    skipped = []
    for _, path, why in reversed(unreadable_checkpoints(version_dir)):  # newest first, as those tried below
        log.warning("checkpoint %s is unusable (%s); falling back to the one before", path, why)
        skipped.append({"checkpoint": str(path), "reason": why})
    for epochs_done, path in reversed(complete_checkpoints(version_dir)):
        try:
            m, moved = engine.restore(path)
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


def validation_scores(version_dir: str | Path) -> dict[int, float]:
    """Epoch (from 1) -> its validation score, from the version's epoch records (complete and retired
    checkpoints) that have one."""
    infos = {e: m.figures for e, m in epoch_records(version_dir)}
    return epoch_scores({e: i for e, i in infos.items() if any(i.get(k) is not None for k in SCORE_KEYS)})


def keep_best_epoch(engine: Engine, version_dir: str | Path, patience: int | None, log: Log) -> Kept:
    """With a validation split (`patience` set), the best-scoring epoch of those whose checkpoint is complete,
    restored from it unless it is the last; WorkerLost if a worker is lost meanwhile."""
    found = dict(complete_checkpoints(version_dir))
    epochs = max(found, default=0)
    best = _best_complete(version_dir, found) if patience is not None else None
    if best is None:
        return Kept(epochs, None, {})
    if best != epochs:
        engine.restore(found[best])
        log.info("kept epoch %d of %d: the best validation score", best, epochs)
    return Kept(epochs, best, validation_of(read_checkpoint(found[best]).figures))


def retire_checkpoints(version_dir: str | Path, keep: int | None, scored: bool) -> list[int]:
    """Retire (storage.checkpoint.retire_checkpoint) every complete checkpoint of a version but the newest `keep`
    and, when epochs are `scored` on a validation split, the best-scoring one (keep_best_epoch restores it);
    the epochs retired. None keeps every checkpoint."""
    if keep is None:
        return []
    found = dict(complete_checkpoints(version_dir))
    spared = set(sorted(found)[-keep:]) | ({_best_complete(version_dir, found)} if scored else set())
    gone = [e for e in sorted(found) if e not in spared]
    for e in gone:
        retire_checkpoint(found[e])
    return gone


def _best_complete(version_dir: str | Path, complete: dict[int, Path]) -> int | None:
    """The best-scoring epoch of those whose checkpoint is complete (None before any is scored)."""
    return best_epoch({e: x for e, x in validation_scores(version_dir).items() if e in complete})


def restart_workers(engine: Engine | None, client: Client, devices: int, timeout_s: float, log: Log) -> int:
    """After a lost worker: release the shards, restart this run's surviving workers, wait for enough; the
    workers up.

    The survivors are restarted too (those with a nanny: a worker started without one
    cannot be), so no actor thread stays blocked on the lost peer. A TrainingError when
    fewer workers than devices are back after `timeout_s`.
    """
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
    return len(live_workers(client))


def kept_note(version_dir: str | Path) -> str:
    """What a stopped run leaves for the next one."""
    if complete_checkpoints(version_dir):
        return (f"the checkpoints in {version_dir} are kept: a new run resumes from the last complete one (on a "
                "new plan if its topology has other devices)")
    return f"no checkpoint of {version_dir} was complete yet: a new run starts it from the beginning"


def checkpoint_losses(version_dir: str | Path) -> dict[int, float]:
    """Each epoch's loss as its checkpoint, complete or retired, recorded it (by epoch, from 1): what a resumed
    run did not train itself."""
    losses = {epoch: m.loss for epoch, m in epoch_records(version_dir)}
    return {epoch: loss for epoch, loss in losses.items() if loss is not None}


def checkpoint_paths(version_dir: str | Path) -> list[str]:
    """The complete checkpoints of a version directory, oldest first."""
    return [str(p) for _, p in complete_checkpoints(version_dir)]
