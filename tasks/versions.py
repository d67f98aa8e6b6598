"""The model-version tasks of a nightly run: open a version (shardflow.lifecycle decides which), warm-start it,
gate it."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime

from prefect import get_run_logger, task
from prefect.cache_policies import NONE

from shardflow import lifecycle
from shardflow.config import RetrainConfig
from shardflow.errors import WorkerLost
from shardflow.lifecycle import NothingNew
from shardflow.model.metrics import Metrics
from shardflow.promotion import judge, rejection
from shardflow.reporting.summary import RunSummary, VersionFigures
from shardflow.training.engine import Engine
from shardflow.training.evaluate import evaluate_export
from storage import versions
from storage.checkpoint import verify_export
from storage.versions import VersionStart
from tasks.assets import emit_model_event
from tasks.training import Lost, lost


@task(name="open-version", task_run_name="open-version", cache_policy=NONE)
def open_version(config: RetrainConfig, dataset: str) -> VersionStart | NothingNew:
    """What this run does (shardflow.lifecycle.open_version): NothingNew, or the start record of its version."""
    return lifecycle.open_version(config, dataset, get_run_logger())


@task(name="warm-start", task_run_name="warm-start-from-{number}", cache_policy=NONE)
def warm_start(engine: Engine, model: str, number: int) -> str | Lost:
    """Load the promoted version's exported model into fresh shards: its path, or Lost."""
    manifest = verify_export(model)
    try:
        engine.warm_start(model, manifest)
    except WorkerLost as e:
        return lost("warm start", e)
    get_run_logger().info("warm start from version %d (%s)", number, model)
    return model


@task(name="promote", task_run_name="promote-version-{number}", cache_policy=NONE)
def gate(config: RetrainConfig, dataset: str, number: int, client, figures: VersionFigures) -> RunSummary:
    """Evaluate the promoted version on the new version's held-out items; promote the new one unless worse;
    the run's summary (`figures`: what the version measured).

    The new version is promoted when its promote_on figure (AUC by default) is at least the
    promoted one's minus promotion_margin (shardflow.promotion). Its result.json is written
    first, then `current` switched; a rejection leaves `current` as it was and emits
    `shardflow.model.rejected`. Then old versions' checkpoints are pruned (keep_versions; the
    promoted one never).
    """
    log, run = get_run_logger(), config.run_dir
    began = versions.began(run, number)
    source = began.warm_start_from
    previous = None
    if source is not None:
        model = str(versions.version_dir(run, source) / "model")
        previous = evaluate_export(model, dataset, config.train.eval_users, config.train.seed, began.window[1],
                                   figures.held_out.full_ranking, client)  # ranked as the new version was
    margin = config.nightly.promotion_margin
    verdict = judge(figures.held_out, previous, config.nightly.promote_on, margin)
    summary = RunSummary(**{f.name: getattr(figures, f.name) for f in dataclasses.fields(VersionFigures)},
                         previous=previous or Metrics(None), promoted=verdict.promoted, promoted_on=verdict.figure,
                         finished=datetime.now(UTC).isoformat(timespec="seconds"))
    versions.finish(run, number, summary.stored())
    message = None
    aucs = {"auc": summary.held_out.auc, "previous_auc": None if previous is None else previous.auc}
    if verdict.promoted:
        versions.promote(run, number)
        log.info("version %d promoted (%s %.4f%s)", number, verdict.label, verdict.new,
                 "" if verdict.previous is None else f" against {verdict.previous:.4f} of version {source}")
        emit_model_event("promoted", run, number, {"previous": source, **aucs})
    else:
        message = rejection(verdict, number, source, margin)
        log.warning(message)
        emit_model_event("rejected", run, number, {"current": source, **aucs, "message": message})
    gone = versions.prune_checkpoints(run, config.nightly.keep_versions)
    if gone:
        log.info("removed the checkpoints of versions %s (keep_versions %d)", gone, config.nightly.keep_versions)
    return dataclasses.replace(summary, current=versions.current(run), message=message)
