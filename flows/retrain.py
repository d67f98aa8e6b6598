"""One retraining run, top to bottom: import → open a version → profile → shard → train epochs →
download → evaluate → promote → exit.

Every stage is its own named task on one shared Dask cluster (a LocalCluster, an existing
scheduler, or any cluster class). A run appends the dataset's new parts and makes a model
version of them (RUN_DIR/versions/NNNN), warm-started from the promoted one, on a plan
kept or re-made as the access pattern drifted; a run that finds no new data trains
nothing. Each epoch ends in a checkpoint every shard writes itself; a version cut off
part-way is resumed from its last complete one. The parameter download happens once,
after the last epoch; the parameter servers are released by the exit task whether the
run succeeds, fails or is cancelled. The new version is promoted (RUN_DIR/current) only
if its held-out AUC is not worse than the promoted one's. The run holds the run
directory's lock throughout; a lost worker is recovered from the last checkpoint
(docs/reliability.md).
"""

from __future__ import annotations

import contextlib
import itertools
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path

from prefect import flow, get_run_logger
from prefect.artifacts import create_progress_artifact, update_progress_artifact
from prefect.states import Completed

from shardflow.cluster import performance_report
from shardflow.config import RetrainConfig
from shardflow.data.windows import held_events
from shardflow.errors import (
    SchedulerLost,
    TrainingError,
    WorkerLost,
    WorkerOutOfMemory,
    as_stop,
    one_line_errors,
    stop_if_asked,
)
from shardflow.importing import Imported
from shardflow.lifecycle import NothingNew, nothing_new, untrained
from shardflow.model.metrics import Metrics
from shardflow.preflight import check_disk, check_run, check_training_examples
from shardflow.profiling.profiles import unread_hashed_rows
from shardflow.reporting.run_report import artifact_key, outcome, run_label, state_message
from shardflow.reporting.stages import StageClock
from shardflow.reporting.summary import VAL, PlanFigures, RunSummary, TrainingFigures, VersionFigures
from shardflow.sharding.stage import read_plan_summary
from shardflow.training.epochs import (
    Attempts,
    Resumed,
    Trained,
    checkpoint_losses,
    checkpoint_paths,
    kept_note,
    validation_scores,
)
from shardflow.training.validation import best_epoch, stop_now
from storage.lock import owned, run_lock
from storage.versions import RunLayout, VersionPaths, VersionStart, began, lists_cut_off, new_parts
from tasks.assets import materialize_model
from tasks.reports import (
    name_run,
    publish_epoch_metrics,
    publish_failure,
    publish_summary,
    publish_versions,
    tag_run,
)
from tasks.retrain import (
    evaluate,
    plots,
    prepare_dataset,
    profile,
    recommend,
    shard,
    start_cluster,
    tidy,
)
from tasks.training import (
    checkpoint,
    download,
    keep_best,
    release_parameter_servers,
    restore_cluster,
    resume,
    start_parameter_servers,
    train_epoch,
    unless_lost,
)
from tasks.versions import gate, open_version, warm_start

DASK_REPORT = "dask-performance.html"  # a version's: distributed's performance report of its work


def _run_name() -> str:
    """`<run_dir name>-<6 hex of its path>·<UTC date>` until the run knows its version (tasks.reports.name_run)."""
    from prefect.runtime import flow_run

    config = flow_run.parameters.get("config") or RetrainConfig()
    values = config if isinstance(config, dict) else config.model_dump()
    return f"{run_label(values.get('run_dir') or RetrainConfig().run_dir)}·{datetime.now(UTC):%Y-%m-%d}"


# The summary is the flow's persisted result, as JSON (the result storage of Prefect's settings, by default
# PREFECT_HOME/storage): the Result tab and `state.result()` read it after the run.
@flow(name="retrain", flow_run_name=_run_name, log_prints=True, persist_result=True, result_serializer="json")
def retrain(config: RetrainConfig = RetrainConfig()):
    started = _started_s_ago()  # read before the clock starts, so the read's own time is booked once
    clock = StageClock(between=stop_if_asked)
    clock.book("start-up (Prefect, before the flow's code)", started)
    one_line_errors()  # an error shardflow explains reaches the terminal or the worker's log as one line
    run = str(config.layout.run)
    try:
        check_run(config)
        _tag(config)
        clock.done("pre-flight")
        summary = nothing_new(config)  # a night with nothing new is answered from the stores: no cluster
        clock.done("nothing-new check")
        if summary is None:
            summary = _make_version(config, run, clock)
    except Exception as e:  # an interrupt is a crash: Prefect records it, nothing more is sent to the API
        stop = as_stop(e)
        if stop is not None:
            raise stop from e
        publish_failure(run, e)  # what failed, what stays current, what the next run does
        _failed(run)
        raise
    name_run(run, f"v{summary.version}" if summary.trained else "no new data")
    tag_run([f"outcome:{outcome(summary).lower().replace(' ', '-')}", f"version:{summary.version}"])
    publish_versions(run)
    clock.done("reports")
    summary = replace(summary, stage_seconds=dict(clock.seconds))
    publish_summary(summary, config)
    # The state's name says what the night did in the runs list (a COMPLETED type: Prefect's views count it done).
    return Completed(name=outcome(summary), message=state_message(summary), data=summary.to_dict())  # the JSON edge


def _started_s_ago() -> float:
    """Seconds since Prefect started this flow run (its engine's start-up before the flow's code), 0 if unknown."""
    from prefect.client.orchestration import get_client
    from prefect.runtime import flow_run

    try:
        with get_client(sync_client=True) as client:
            start = client.read_flow_run(flow_run.id).start_time
        return (datetime.now(UTC) - start).total_seconds() if start else 0.0
    except Exception:  # timing is a courtesy: a run without it still runs
        return 0.0


def _failed(run: str) -> None:
    """Name a failed night apart from every other (`…·2026-12-02 03:00:12·failed`, `…·v3 03:00:12·failed`: its
    date or version and the time it failed, UTC), and tag it."""
    from prefect.runtime import flow_run

    try:
        label = flow_run.name.split("·", 1)[1] if "·" in flow_run.name else "night"
        name_run(run, f"{label} {datetime.now(UTC):%H:%M:%S}·failed")
        tag_run(["outcome:failed"])
    except Exception:  # naming is a courtesy: the failure itself is what the run reports
        pass


def _make_version(config: RetrainConfig, run: str, clock: StageClock) -> RunSummary:
    """The data imported and verified and the version opened first (a bad part, a damaged store or a batch
    larger than the version's training examples fails in seconds, before any cluster starts), then the
    version on the run's Dask cluster."""
    devices = config.parsed_topology.devices
    with run_lock(run):
        tidy(run)
        imported = prepare_dataset(config)
        dataset = imported.path
        clock.done("import and verify the data")
        with owned(dataset, run):  # the run owns its data: no append until it ends
            version = open_version(config, dataset)
            clock.done("open the version")
            if isinstance(version, VersionStart):
                check_training_examples(config, dataset, version.window)
                check_disk(config, dataset, RunLayout(Path(run)).version(version.version).version)
            elif not lists_cut_off(run, version.newest, config.nightly.top_k):
                return untrained(run, version.current, version.newest, imported.parts_added, imported.warnings)
            with contextlib.ExitStack() as cluster:
                client = start_cluster(config, cluster)
                clock.done("cluster start")
                summary = _version(config, run, client, devices, dataset, imported, clock, cluster, version)
        clock.done("Dask performance report, cluster stop")
        return summary


def _version(config: RetrainConfig, run: str, client, devices: int, dataset: str, imported: Imported,
             clock: StageClock, cluster: contextlib.ExitStack, version: VersionStart | NothingNew) -> RunSummary:
    """The model version of this run's data, from its profile to the promotion gate and the lists (or, for a
    night with nothing new whose lists were cut off, those lists); the Dask performance report of its work is
    written under it as the cluster stops (entered on `cluster`)."""
    if isinstance(version, NothingNew):
        summary = untrained(run, version.current, version.newest, imported.parts_added, imported.warnings)
        get_run_logger().warning("version %d's night was cut off before its top-K lists; writing them now",
                                 version.newest)
        lists = recommend(config, dataset, run, version.newest, began(run, version.newest).window[0], client)
        clock.done("top-K lists")
        return replace(summary, recommendations=lists)
    name_run(run, f"v{version.version}")
    layout = RunLayout(Path(run))
    paths = layout.version(version.version)
    tidy(paths.version)
    report = Path(paths.version) / DASK_REPORT
    cluster.enter_context(performance_report(report))
    # The plan and its cost model are fitted to what this version's window reads, histories included.
    stats = profile(dataset, paths.profile, client, run, version.window[0], config.model.history,
                    held_events(config.train.patience is not None))
    sparse = unread_hashed_rows(dataset, stats)
    if sparse is not None:
        get_run_logger().warning(sparse)
    clock.done("profile")
    source = version.warm_start_from
    previous_plan = None if source is None else layout.version(source).plan
    strategies, decision = shard(config, paths.profile, paths.plan, previous_plan)
    trained_plan = read_plan_summary(paths.plan)  # the plan that trains: fresh, or the previous one kept
    clock.done("shard")
    trained = _train(config, dataset, paths, run, client, devices, trained_plan.bytes_per_step, version)
    clock.done("train (warm start, epochs, checkpoints, download)")
    metrics = evaluate(paths.model, dataset, config.train.eval_users, config.train.seed, version.window[1],
                       config.train.full_ranking, client)
    clock.done("evaluate")
    figures = plots(paths.version, paths.profile, paths.plan, strategies)
    tidy(paths.version)
    clock.done("plots")
    row_wise = next(r for r in strategies if r.strategy == "row-wise-mod")
    summary = gate(config, dataset, version.version, client, VersionFigures(
        run_dir=run,
        version=version.version,
        trained=True,
        warm_start_from=source,
        parts_added=new_parts(run, version),
        parts=len(version.segments),
        window=version.window,
        held_out=metrics,
        validation=Metrics.read(trained.chosen.validation, VAL),
        eval_users=metrics.users,
        training=TrainingFigures(
            epochs=trained.chosen.epochs,
            best_epoch=trained.chosen.best_epoch,
            patience=config.train.patience,
            epoch_loss=tuple(trained.losses[e] for e in sorted(trained.losses)),
            bytes_per_step=trained.bytes_per_step,
            checkpoints=tuple(checkpoint_paths(paths.version)),
            model=paths.model,
            downloads=trained.downloads,
            resumed_from=trained.resumed.checkpoint,
            skipped_checkpoints=trained.resumed.skipped,
            restarts=trained.restarts,
        ),
        plan=PlanFigures(
            modeled_bytes_per_step=trained_plan.bytes_per_step,
            row_wise_bytes_per_step=row_wise.bytes_per_step,
            comm_time_us_per_step=trained_plan.comm_time_s_per_step * 1e6,
            row_wise_comm_time_us_per_step=row_wise.comm_time_s_per_step * 1e6,
            replanned=decision.replanned,
            replan_reason=decision.reason,
            fresh_plan_comm_time_us_per_step=decision.fresh_comm_time_s * 1e6,
            previous_plan_comm_time_us_per_step=None if decision.previous_comm_time_s is None
            else decision.previous_comm_time_s * 1e6,
        ),
        warnings=(*trained.warnings, *imported.warnings, *([sparse] if sparse else [])),
        plots=tuple(figures),
    ))
    materialize_model(run, summary)  # the version as a Prefect asset, its figures and verdict known
    clock.done("promotion gate")
    lists = recommend(config, dataset, run, version.version, version.window[0], client)
    clock.done("top-K lists")
    return replace(summary, recommendations=lists, dask_report=str(report))


def _tag(config: RetrainConfig) -> None:
    """Tags to filter runs by in the UI: strategy, dataset and (for a deployment run) deployment."""
    from prefect.client.orchestration import get_client
    from prefect.runtime import deployment, flow_run

    tags = {f"strategy:{config.plan.strategy}", f"dataset:{Path(config.data.dataset).name}"}
    if deployment.name:
        tags.add(f"deployment:{deployment.name}")
    with get_client(sync_client=True) as client:
        known = set(client.read_flow_run(flow_run.id).tags)
        client.update_flow_run(flow_run.id, tags=sorted(known | tags))


def _train(config: RetrainConfig, dataset: str, paths: VersionPaths, run: str, client, devices: int, modeled: float,
           version: VersionStart) -> Trained:
    """The epochs left, a checkpoint after each, then the one download.

    One attempt is one set of parameter servers (_attempt). Losing a worker ends the
    attempt: the cluster is restored and the next attempt resumes from the last complete
    checkpoint, at most max_restarts times (_restart). Training is deterministic in
    (seed, step), so the run ends with the parameters of an uninterrupted one.
    """
    kept = Attempts()
    for attempt in itertools.count():
        engine = None
        try:
            engine = start_parameter_servers(config, dataset, paths.plan, client, window=version.window)
            trained = _attempt(engine, config, paths, run, modeled, version, kept)
            # every epoch's loss: those a cut-off run trained from their checkpoints, this run's as it trained them
            losses = {**checkpoint_losses(paths.version), **kept.losses}
            return replace(trained, losses=losses, restarts=attempt, warnings=tuple(kept.warnings))
        except SchedulerLost as e:
            raise TrainingError(f"{e}; {kept_note(paths.version)}") from None
        except WorkerLost as e:
            _restart(e, engine, attempt, config, paths, client, devices, kept.warnings)
        finally:
            release_parameter_servers(engine)


def _attempt(engine, config: RetrainConfig, paths: VersionPaths, run: str, modeled: float, version: VersionStart,
             kept: Attempts) -> Trained:
    """One set of parameter servers: resume from the last complete checkpoint or, with none yet, start from the
    promoted version's model (a warm start) when there is one; the epochs left, each checkpointed; the download."""
    resumed = unless_lost(resume(engine, paths.version))
    source = version.warm_start_from
    if resumed.checkpoint is None and source is not None:
        unless_lost(warm_start(engine, RunLayout(Path(run)).version(source).model, source))
    if kept.progress is None:
        kept.progress = create_progress_artifact(100.0 * resumed.epochs_done / config.train.epochs,
                                                    key=artifact_key("training-progress", run),
                                                    description="epochs done")
    measured = _epochs(engine, config, paths, resumed, kept)
    publish_epoch_metrics(paths.version, run, modeled)  # once a run: every epoch of the version
    chosen = unless_lost(keep_best(engine, paths.version, config.train.patience))
    unless_lost(download(engine, paths.model, chosen.epochs, chosen.best_epoch, config.plan.strategy))
    return Trained(chosen, measured, engine.downloads, resumed)


def _epochs(engine, config: RetrainConfig, paths: VersionPaths, resumed: Resumed, kept: Attempts) -> float | None:
    """The epochs after the resumed checkpoint, each checkpointed: up to config.train.epochs, or with a validation
    split until `patience` epochs have passed without a better score, not before `min_epochs` (read back from the
    version's checkpoints, so a resumed run stops where an uninterrupted one would). The bytes per step measured."""
    steps = 0
    # Measured over this attempt's steps (the engine's counters start at zero); a run
    # with nothing left to train reports what its last checkpoint measured.
    measured = resumed.bytes_per_step
    for epoch in range(resumed.epochs_done + 1, config.train.epochs + 1):  # numbered from 1
        scores = validation_scores(paths.version)
        if config.train.patience is not None and stop_now(scores, config.train.patience, config.train.min_epochs):
            update_progress_artifact(kept.progress, 100.0, description=f"stopped after epoch {epoch - 1}: "
                                     f"no better validation score since epoch {best_epoch(scores)}")
            break
        done = unless_lost(train_epoch(engine, epoch, config.train.epochs, kept.progress))
        kept.losses[epoch] = done.stats.loss
        steps += done.stats.steps
        measured = engine.traffic().modeled_bytes / steps
        unless_lost(checkpoint(engine, paths.version, epoch, done.figures(measured), config.train.keep_checkpoints,
                               config.train.patience is not None))
        update_progress_artifact(kept.progress, 100.0 * epoch / config.train.epochs,
                                 description=f"epoch {epoch}/{config.train.epochs} done · loss {done.stats.loss:.3f}")
    return measured


def _restart(e: WorkerLost, engine, attempt: int, config: RetrainConfig, paths: VersionPaths, client, devices: int,
             warnings: list[str]) -> None:
    """After losing a worker: restore the cluster for the next attempt, or stop in one line (out of memory while
    starting, max_restarts reached, or no cluster to restore)."""
    if engine is None and isinstance(e, WorkerOutOfMemory):
        raise TrainingError(f"the parameter servers ran out of memory while starting ({e}); a restart "
                            f"would run out again, so none was tried; {kept_note(paths.version)}") from None
    if attempt == config.train.max_restarts:
        raise TrainingError(
            f"lost a worker {attempt + 1} times ({e}); max_restarts = {config.train.max_restarts} reached; "
            f"{kept_note(paths.version)}"
        ) from None
    get_run_logger().warning("%s; restoring the cluster and resuming from the last complete checkpoint (restart %d "
                             "of %d)", e, attempt + 1, config.train.max_restarts)
    warnings.append(f"restart {attempt + 1}: {e}; resumed from the last complete checkpoint")
    try:
        restore_cluster(engine, client, devices, attempt + 1, config.train.restart_timeout_s)
    except TrainingError as gone:
        raise TrainingError(f"lost a worker ({e}), and {gone}; {kept_note(paths.version)}") from None
