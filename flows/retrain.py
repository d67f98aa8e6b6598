"""One retraining run, top to bottom: profile → shard → train epochs → download → evaluate → exit.

Every stage is its own named task on one shared Dask cluster (a LocalCluster, an existing
scheduler, or any cluster class). Each epoch ends in a checkpoint every shard writes
itself; a run started again on the same run_dir resumes from the last complete one. The
parameter download happens once, after the last epoch; the parameter servers are
released by the exit task whether the run succeeds, fails or is cancelled. The run holds
the run directory's lock throughout; a lost worker is recovered from the last checkpoint
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
from shardflow.errors import TrainingError, WorkerLost
from shardflow.planner.topology import load_topology
from storage.checkpoint import complete_checkpoints
from storage.lock import run_lock
from storage.staging import remove_leftovers
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
    paths = {k: str(v) for k, v in run_paths(config).items()}
    devices = load_topology(config.topology).devices
    with run_lock(paths["run"]), run_cluster(config.scheduler_address, config.cluster_class, config.cluster_kwargs,
                                             devices, gpus=config.device == "cuda") as client:
        log.info("Dask dashboard: %s", client.dashboard_link)
        _tidy(paths["run"])
        dataset = prepare_dataset(config)
        profile(dataset, paths["profile"], client, paths["run"])
        strategies = shard(config, paths["profile"], paths["plan"])
        chosen = next(r for r in strategies if r["strategy"] == config.strategy)
        trained = _train(config, dataset, paths, client, devices, chosen["bytes_per_step"])
        metrics = evaluate(paths["model"], dataset, config.eval_users, config.seed)
        figures = plots(paths["run"], paths["profile"], paths["plan"], strategies)
        _tidy(paths["run"])
    row_wise = next(r for r in strategies if r["strategy"] == "row-wise-mod")
    summary = {
        "run_dir": paths["run"],
        "epochs": config.epochs,
        "auc": metrics["auc"],
        "hr_at_10": metrics["hr_at_10"],
        "bytes_per_step": trained["bytes_per_step"],
        "modeled_bytes_per_step": chosen["bytes_per_step"],
        "row_wise_bytes_per_step": row_wise["bytes_per_step"],
        "comm_time_us_per_step": chosen["comm_time_s_per_step"] * 1e6,
        "row_wise_comm_time_us_per_step": row_wise["comm_time_s_per_step"] * 1e6,
        "checkpoints": [str(p) for _, p in complete_checkpoints(paths["run"])],
        "model": paths["model"],
        "downloads": trained["downloads"],
        "epoch_loss": [trained["losses"][e] for e in sorted(trained["losses"])],
        "resumed_from": trained["resumed"]["checkpoint"],
        "skipped_checkpoints": trained["resumed"]["skipped"],
        "restarts": trained["restarts"],
        "warnings": trained["warnings"],
        "plots": figures,
    }
    create_markdown_artifact(_markdown(summary, config), key=artifact_key("retrain-summary", paths["run"]),
                             description="Retraining run summary")
    return summary


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


def _train(config: RetrainConfig, dataset: str, paths: dict, client, devices: int, modeled: float) -> dict:
    """The epochs left, a checkpoint after each, then the one download.

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
            engine = start_parameter_servers(config, dataset, paths["plan"], client)
            resumed = unless_lost(resume(engine, paths["run"]))
            if progress is None:
                progress = create_progress_artifact(100.0 * resumed["epochs_done"] / config.epochs,
                                                    key=artifact_key("training-progress", paths["run"]),
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
                unless_lost(checkpoint(engine, paths["run"], epoch, {
                    "loss": stats["loss"], "auc": stats["auc"], "hr_at_10": stats["hr_at_10"], "seed": config.seed,
                    "bytes_per_step": measured, "examples_per_s": stats["examples"] / stats["seconds"],
                    "seconds": stats["seconds"],
                }))
                publish_epoch_metrics(paths["run"], modeled)
                update_progress_artifact(progress, 100.0 * epoch / config.epochs,
                                         description=f"epoch {epoch}/{config.epochs} done · loss {stats['loss']:.3f}")
            unless_lost(download(engine, paths["model"], {"epochs": config.epochs, "strategy": config.strategy}))
            return {"losses": losses, "steps": steps, "bytes_per_step": measured, "downloads": engine.downloads,
                    "resumed": resumed, "restarts": attempt, "warnings": warnings}
        except WorkerLost as e:
            if attempt == config.max_restarts:
                raise TrainingError(
                    f"lost a worker {attempt + 1} times ({e}); max_restarts = {config.max_restarts} reached. "
                    f"Checkpoints in {paths['run']} are kept: a new run resumes from the last complete one"
                ) from e
            log.warning("%s; restoring the cluster and resuming from the last complete checkpoint (restart %d of %d)",
                        e, attempt + 1, config.max_restarts)
            warnings.append(f"restart {attempt + 1}: {e}; resumed from the last complete checkpoint")
            restore_cluster(engine, client, devices, attempt + 1, config.restart_timeout_s)
        finally:
            release_parameter_servers(engine)


def _markdown(s: dict, config: RetrainConfig) -> str:
    mb = 1e6
    lines = [
        f"# Retraining run `{s['run_dir']}`",
        "",
        f"- strategy **{config.strategy}** on `{config.topology}`, {s['epochs']} epochs, batch {config.batch_size}",
        f"- **AUC {s['auc']:.4f}**, **HR@10 {s['hr_at_10']:.4f}** (leave-last-out, exported model)",
        # Like for like: measured against this plan's model; the plan's model against row-wise-mod's.
        (f"- traffic **{s['bytes_per_step'] / mb:.3f} MB/step measured** (the last epochs trained) against "
         if s["bytes_per_step"] is not None else "- traffic not measured (no checkpoint recorded it); ")
        + f"{s['modeled_bytes_per_step'] / mb:.3f} MB/step that the cost model predicts for this plan",
        f"- modeled communication time per step: **{s['comm_time_us_per_step']:.1f} µs** with {config.strategy}, "
        f"{s['row_wise_comm_time_us_per_step']:.1f} µs with row-wise-mod "
        f"({s['row_wise_comm_time_us_per_step'] / max(s['comm_time_us_per_step'], 1e-12):.2f}× its time); "
        f"{s['row_wise_bytes_per_step'] / mb:.3f} MB/step with row-wise-mod",
        f"- loss per epoch (this run): {', '.join(f'{x:.4f}' for x in s['epoch_loss']) or 'none (resumed at the end)'}",
        f"- exported model: `{s['model']}`",
        f"- resumed from: `{s['resumed_from']}`" if s["resumed_from"] else "- started from the initial parameters",
        *(f"- **skipped damaged checkpoint** `{k['checkpoint']}`: {k['reason']}" for k in s["skipped_checkpoints"]),
        f"- worker losses recovered from a checkpoint: {s['restarts']} (max_restarts {config.max_restarts})",
        *(f"- **warning**: {w}" for w in s["warnings"]),
        "- checkpoints: " + (", ".join(f"`{c}`" for c in s["checkpoints"]) or "none"),
        "- checkpoints, model and plots (SVG files) on the machine that ran it: `" + s["run_dir"] + "`",
        "",
        # Embedded, not linked: a path on the worker host is no picture in a browser elsewhere.
        *(f"![{Path(p).stem}](data:image/svg+xml;base64,{base64.b64encode(Path(p).read_bytes()).decode()})"
          for p in s["plots"]),
    ]
    return "\n".join(lines)
