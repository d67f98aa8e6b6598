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

import base64
import itertools
from datetime import datetime, timezone
from pathlib import Path

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact, create_progress_artifact, update_progress_artifact

from shardflow.cluster import run_cluster
from shardflow.config import RetrainConfig
from shardflow.errors import SchedulerLost, TrainingError, WorkerLost, WorkerOutOfMemory
from shardflow.planner.topology import load_topology
from shardflow.training.evaluate import metric_text, metric_values
from storage.checkpoint import complete_checkpoints
from storage.lock import run_lock
from storage.staging import remove_leftovers
from storage import versions
from tasks.retrain import (
    artifact_key,
    publish_epoch_metrics,
    check_run,
    checkpoint,
    download,
    evaluate,
    plots,
    prepare_dataset,
    profile,
    release_parameter_servers,
    restore_cluster,
    resume,
    run_paths,
    shard,
    start_parameter_servers,
    train_epoch,
    unless_lost,
)
from tasks.versions import gate, open_version, publish_versions, version_paths, warm_start


def _run_name() -> str:
    """`<run_dir name>-<UTC date>-<strategy>`: nightly runs of different run_dirs and days stay apart."""
    from prefect.runtime import flow_run

    config = flow_run.parameters.get("config") or RetrainConfig()
    values = config if isinstance(config, dict) else config.model_dump()
    run_dir = Path(values.get("run_dir") or RetrainConfig().run_dir).expanduser().resolve()
    strategy = values.get("strategy") or RetrainConfig().strategy
    return f"{run_dir.name}-{datetime.now(timezone.utc):%Y-%m-%d}-{strategy}"


@flow(name="retrain", flow_run_name=_run_name, log_prints=True)
def retrain(config: RetrainConfig = RetrainConfig()) -> dict:
    log = get_run_logger()
    check_run(config)
    _tag(config)
    run = str(run_paths(config)["run"])
    devices = load_topology(config.topology).devices
    with run_lock(run), run_cluster(config.scheduler_address, config.cluster_class, config.cluster_kwargs,
                                    devices, gpus=config.device == "cuda") as client:
        log.info("Dask dashboard: %s", client.dashboard_link)
        _tidy(run)
        imported = prepare_dataset(config)
        dataset = imported["path"]
        version = open_version(config, dataset)
        if not version["train"]:
            summary = _untrained(run, version, imported["parts_added"])
        else:
            paths = version_paths(version["path"])
            _tidy(paths["version"])
            profile(dataset, paths["profile"], client, run)
            source = version["warm_start_from"]
            previous_plan = None if source is None else str(versions.version_dir(run, source) / "plan")
            strategies, decision = shard(config, paths["profile"], paths["plan"], previous_plan)
            chosen = next(r for r in strategies if r["strategy"] == config.strategy)
            trained = _train(config, dataset, paths, run, client, devices, chosen["bytes_per_step"], version)
            metrics = evaluate(paths["model"], dataset, config.eval_users, config.seed, version["window"][1])
            figures = plots(paths["version"], paths["profile"], paths["plan"], strategies)
            _tidy(paths["version"])
            row_wise = next(r for r in strategies if r["strategy"] == "row-wise-mod")
            summary = gate(config, dataset, version["version"], {
                "run_dir": run,
                "version": version["version"],
                "trained": True,
                "warm_start_from": source,
                "parts_added": imported["parts_added"],
                "parts": len(version["segments"]),
                "window": version["window"],
                "epochs": config.epochs,
                **metric_values(metrics),
                "eval_users": metrics["users"],
                "bytes_per_step": trained["bytes_per_step"],
                "modeled_bytes_per_step": chosen["bytes_per_step"],
                "row_wise_bytes_per_step": row_wise["bytes_per_step"],
                "comm_time_us_per_step": chosen["comm_time_s_per_step"] * 1e6,
                "row_wise_comm_time_us_per_step": row_wise["comm_time_s_per_step"] * 1e6,
                "replanned": decision["replanned"],
                "replan_reason": decision["reason"],
                "fresh_plan_comm_time_us_per_step": decision["fresh_comm_time_s"] * 1e6,
                "previous_plan_comm_time_us_per_step": None if decision["previous_comm_time_s"] is None
                else decision["previous_comm_time_s"] * 1e6,
                "checkpoints": [str(p) for _, p in complete_checkpoints(paths["version"])],
                "model": paths["model"],
                "downloads": trained["downloads"],
                "epoch_loss": [trained["losses"][e] for e in sorted(trained["losses"])],
                "resumed_from": trained["resumed"]["checkpoint"],
                "skipped_checkpoints": trained["resumed"]["skipped"],
                "restarts": trained["restarts"],
                "warnings": trained["warnings"],
                "plots": figures,
            })
    publish_versions(run)
    create_markdown_artifact(_markdown(summary, config), key=artifact_key("retrain-summary", run),
                             description="Retraining run summary")
    return summary


def _untrained(run: str, version: dict, parts_added: list[str]) -> dict:
    """A run that found no new data: the current version's figures, nothing trained, nothing downloaded."""
    current = versions.result(run, version["number"]) if version["number"] else None
    if current is None:
        raise TrainingError(f"run_dir {run} has no promoted model version and no new data to make one from")
    return {**current, "trained": False, "parts_added": parts_added, "current": version["number"], "downloads": 0,
            "epoch_loss": [], "resumed_from": None, "skipped_checkpoints": [], "restarts": 0, "warnings": [],
            "message": f"no new data since version {current['version']}: nothing trained"}


def _tag(config: RetrainConfig) -> None:
    """Tags to filter runs by in the UI: strategy, dataset and (for a deployment run) deployment."""
    from prefect.client.orchestration import get_client
    from prefect.runtime import deployment, flow_run

    tags = {f"strategy:{config.strategy}", f"dataset:{Path(config.dataset).name}"}
    if deployment.name:
        tags.add(f"deployment:{deployment.name}")
    with get_client(sync_client=True) as client:
        known = set(client.read_flow_run(flow_run.id).tags)
        client.update_flow_run(flow_run.id, tags=sorted(known | tags))


def _tidy(run_dir: str) -> None:
    """Remove the unfinished stores a cut-off run left behind (under the run's lock).

    Called at the start and again at the end: workers of a killed run finish the write
    they were in (a second or so) and may leave a few files after the first sweep.
    """
    left = remove_leftovers(run_dir) + remove_leftovers(Path(run_dir) / "checkpoints")
    if left:
        get_run_logger().warning("removed %d unfinished stores a cut-off run left behind: %s", len(left), ", ".join(left))


def _train(config: RetrainConfig, dataset: str, paths: dict, run: str, client, devices: int, modeled: float,
           version: dict) -> dict:
    """The epochs left, a checkpoint after each, then the one download.

    A version with no checkpoint yet starts from the promoted version's model (a warm
    start) when it has one, else from the initial parameters.

    One attempt is one set of parameter servers. Losing a worker ends the attempt: the
    cluster is restored and the next attempt resumes from the last complete checkpoint,
    at most max_restarts times. Training is deterministic in (seed, step), so the run
    ends with the parameters of an uninterrupted one.
    """
    log = get_run_logger()
    losses: dict[int, float] = {}
    warnings: list[str] = []
    progress = None
    for attempt in itertools.count():
        engine = None
        try:
            engine = start_parameter_servers(config, dataset, paths["plan"], client, window=version["window"])
            resumed = unless_lost(resume(engine, paths["version"]))
            source = version["warm_start_from"]
            if resumed["checkpoint"] is None and source is not None:
                unless_lost(warm_start(engine, str(versions.version_dir(run, source) / "model"), source))
            if progress is None:
                progress = create_progress_artifact(100.0 * resumed["epochs_done"] / config.epochs,
                                                    key=artifact_key("training-progress", run),
                                                    description="epochs done")
            steps = 0
            # Measured over this attempt's steps (the engine's counters start at zero); a run
            # with nothing left to train reports what its last checkpoint measured.
            measured = resumed["bytes_per_step"]
            for epoch in range(resumed["epochs_done"] + 1, config.epochs + 1):  # numbered from 1
                stats = unless_lost(train_epoch(engine, epoch, config.epochs, progress))
                losses[epoch] = stats["loss"]
                steps += stats["steps"]
                traffic = engine.traffic()
                measured = sum(float(traffic[k].sum()) for k in ("lookup", "sync")) / steps
                unless_lost(checkpoint(engine, paths["version"], epoch, {
                    "loss": stats["loss"], **metric_values(stats), "seed": config.seed,
                    "bytes_per_step": measured, "examples_per_s": stats["examples"] / stats["seconds"],
                    "seconds": stats["seconds"],
                }))
                publish_epoch_metrics(paths["version"], run, modeled)
                update_progress_artifact(progress, 100.0 * epoch / config.epochs,
                                         description=f"epoch {epoch}/{config.epochs} done · loss {stats['loss']:.3f}")
            unless_lost(download(engine, paths["model"], {"epochs": config.epochs, "strategy": config.strategy}))
            return {"losses": losses, "steps": steps, "bytes_per_step": measured, "downloads": engine.downloads,
                    "resumed": resumed, "restarts": attempt, "warnings": warnings}
        except SchedulerLost as e:
            raise TrainingError(f"{e}; {_kept(paths['version'])}") from None
        except WorkerLost as e:
            if engine is None and isinstance(e, WorkerOutOfMemory):
                raise TrainingError(f"the parameter servers ran out of memory while starting ({e}); a restart "
                                    f"would run out again, so none was tried; {_kept(paths['version'])}") from None
            if attempt == config.max_restarts:
                raise TrainingError(
                    f"lost a worker {attempt + 1} times ({e}); max_restarts = {config.max_restarts} reached; "
                    f"{_kept(paths['version'])}"
                ) from None
            log.warning("%s; restoring the cluster and resuming from the last complete checkpoint (restart %d of %d)",
                        e, attempt + 1, config.max_restarts)
            warnings.append(f"restart {attempt + 1}: {e}; resumed from the last complete checkpoint")
            try:
                restore_cluster(engine, client, devices, attempt + 1, config.restart_timeout_s)
            except TrainingError as gone:
                raise TrainingError(f"lost a worker ({e}), and {gone}; {_kept(paths['version'])}") from None
        finally:
            release_parameter_servers(engine)


def _kept(version: str) -> str:
    """What a stopped run leaves for the next one."""
    if complete_checkpoints(version):
        return f"the checkpoints in {version} are kept: a new run resumes from the last complete one"
    return f"no checkpoint of {version} was complete yet: a new run starts it from the beginning"


def _markdown(s: dict, config: RetrainConfig) -> str:
    mb, us = 1e6, "µs"
    held_out = "the held-out last rows" if s.get("logloss") is not None else "leave-last-out"
    auc = f"**{metric_text(s)}** ({held_out} of the version's newest parts, exported model)"
    if not s["trained"]:
        head = [f"- **no new data**: nothing trained; version **{s['current']}** stays current", f"- version {s['version']}: {auc}"]
    else:
        start = f"warm start from version {s['warm_start_from']}" if s["warm_start_from"] else "cold start"
        verdict = ("**promoted** (now current)" if s["promoted"] else f"**not promoted**: {s['message']}")
        previous = "" if s["previous_auc"] is None else f"; the version it started from: AUC {s['previous_auc']:.4f}"
        old = s["previous_plan_comm_time_us_per_step"]
        head = [
            f"- version **{s['version']}** ({start}), parts {s['window'][0] + 1}..{s['parts']} trained, "
            f"{len(s['parts_added'])} part(s) imported by this run: {verdict}",
            f"- {auc}{previous}",
            f"- plan: **{'kept' if not s['replanned'] else 'made' if not s['warm_start_from'] else 're-made'}** — "
            f"{s['replan_reason']} (fresh plan "
            f"{s['fresh_plan_comm_time_us_per_step']:.1f} {us}" + ("" if old is None else f", kept plan {old:.1f} {us}")
            + " per step, modeled)",
        ]
    lines = [
        f"# Retraining run `{s['run_dir']}`",
        "",
        f"- strategy **{config.strategy}** on `{config.topology}`, {s['epochs']} epochs, batch {config.batch_size}",
        *head,
        # Like for like: measured against this plan's model; the plan's model against row-wise-mod's.
        (f"- traffic **{s['bytes_per_step'] / mb:.3f} MB/step measured** (the last epochs trained) against "
         if s["bytes_per_step"] is not None else "- traffic not measured (no checkpoint recorded it); ")
        + f"{s['modeled_bytes_per_step'] / mb:.3f} MB/step that the cost model predicts for this plan",
        f"- modeled communication time per step: **{s['comm_time_us_per_step']:.1f} {us}** with {config.strategy}, "
        f"{s['row_wise_comm_time_us_per_step']:.1f} {us} with row-wise-mod "
        f"({s['row_wise_comm_time_us_per_step'] / max(s['comm_time_us_per_step'], 1e-12):.2f}× its time); "
        f"{s['row_wise_bytes_per_step'] / mb:.3f} MB/step with row-wise-mod",
        f"- loss per epoch (this run): {', '.join(f'{x:.4f}' for x in s['epoch_loss']) or 'none'}",
        f"- exported model: `{s['model']}`",
        f"- resumed from: `{s['resumed_from']}`" if s["resumed_from"] else "- resumed from no checkpoint",
        *(f"- **skipped damaged checkpoint** `{k['checkpoint']}`: {k['reason']}" for k in s["skipped_checkpoints"]),
        f"- worker losses recovered from a checkpoint: {s['restarts']} (max_restarts {config.max_restarts})",
        *(f"- **warning**: {w}" for w in s["warnings"]),
        "- checkpoints: " + (", ".join(f"`{c}`" for c in s["checkpoints"]) or "none"),
        "- versions, checkpoints, models and plots (SVG files) on the machine that ran it: `" + s["run_dir"] + "`",
        "",
        # Embedded, not linked: a path on the worker host is no picture in a browser elsewhere.
        *(f"![{Path(p).stem}](data:image/svg+xml;base64,{base64.b64encode(Path(p).read_bytes()).decode()})"
          for p in s["plots"] if Path(p).is_file()),
    ]
    return "\n".join(lines)
