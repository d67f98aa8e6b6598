"""The retraining run's task groups: each a named task the Prefect UI shows on its own."""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from distributed import Client
from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact, update_progress_artifact
from prefect.cache_policies import NONE

from shardflow.config import RetrainConfig
from shardflow.preflight import import_kwargs, imported_source, run_paths, same_source, source_parts, source_warnings
from shardflow.cluster import live_workers
from shardflow.errors import InputError, TrainingError, WorkerLost
from shardflow.planner.report import PlanSummary, StrategyRefused, table_tiers
from shardflow.planner.topology import parse_topology
from shardflow.planning.plans import ReplanDecision, compare_strategies, keep_or_replan, parse_decision, read_plan
from shardflow.profiling.profiles import profile_dataset, profile_window
from shardflow.training.config import EpochStats
from shardflow.training.engine import Engine
from shardflow.training.run import prepare, start_engine
from shardflow.training.evaluate import evaluate_export, metric_values
from shardflow.training.validation import (SCORE_KEYS, VALIDATION_KEYS, best_epoch, score, validation_of,
                                          validation_values)
from storage.checkpoint import checkpoint_dir, complete_checkpoints, read_checkpoint
from storage.dataset import Dataset
from storage.importers import import_dataset
from storage.manifest import MANIFEST
from storage.plan import read_plan_manifest
from storage.profile import Profile, TableStats
from storage import versions
from storage.staging import remove_leftovers
from storage.versions import write_record

T = TypeVar("T")


def artifact_key(kind: str, run_dir: str | Path) -> str:
    """A Prefect artifact key of one kind for one run_dir: runs of other run_dirs keep their own history.

    Keys allow lowercase letters, digits and dashes: the run_dir's name, slugged, and six
    hex digits of its absolute path (two run_dirs of one name stay apart).
    """
    resolved = Path(run_dir).expanduser().resolve()
    slug = re.sub(r"[^a-z0-9]+", "-", resolved.name.lower()).strip("-")[:40] or "run"
    return f"{kind}-{slug}-{hashlib.sha256(str(resolved).encode()).hexdigest()[:6]}"


@dataclass(frozen=True)
class Imported:
    """The dataset store a run trains on, the names of the parts it added, and what it warned of."""

    path: str
    parts_added: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()


@task(name="import-dataset", task_run_name="import-dataset", cache_policy=NONE)
def prepare_dataset(config: RetrainConfig) -> Imported:
    """The dataset store and the parts this run added to it.

    `dataset` itself if it is a store (grown, if at all, by 'shardflow import --append'),
    else its import into RUN_DIR/dataset. A source the run_dir imported before gets its
    new finished parts appended (the append refuses, under the store's lock, parts that
    vanished or changed); check_run has refused another source on a run_dir with model
    versions. The warnings name what the source holds that is not a part, and the parts
    left for a later night because they may still be being written.
    """
    source, dest = Path(config.data.dataset), run_paths(config)["dataset"]
    if (source / MANIFEST).is_file():
        return Imported(str(source))
    known = imported_source(config)
    warnings = tuple(source_warnings(source, source_parts(config, known)))
    for w in warnings:
        get_run_logger().warning("%s", w)
    if known is not None and same_source(known, config):
        added = import_dataset(config.data.dataset_format, source, dest, append=True,
                               settle_s=config.data.part_settle_s, **import_kwargs(config))["parts_added"]
        get_run_logger().info("%s %s (imported from %s)", f"appended {len(added)} parts to" if added else "reusing",
                              dest, source)
        return Imported(str(dest), tuple(Path(p).name for p in added), warnings)
    done = import_dataset(config.data.dataset_format, source, dest, overwrite=(dest / MANIFEST).is_file(),
                          settle_s=config.data.part_settle_s, **import_kwargs(config))
    return Imported(str(dest), tuple(Path(p).name for p in done["parts_added"]), warnings)


@task(name="profile", task_run_name="profile", cache_policy=NONE)
def profile(dataset: str, out: str, client: Client, run_dir: str, first: int = 0,
            history: int | None = None) -> dict[str, TableStats]:
    """Per-row lookups by the training window's examples (parts `first` on, with their `history`-item
    histories), or, without `history`, per-row accesses of the whole log; a complete profile of this very
    dataset and window is reused. Every table's figures."""
    log = get_run_logger()
    checksum = Dataset.open(dataset).info.checksum
    kept = Profile.open(out) if (Path(out) / MANIFEST).is_file() else None
    made = kept and kept.dataset
    if made and (made.checksum, made.window.first_part, made.window.history) == (checksum, first, history):
        log.info("reusing profile %s", out)
    elif history is None:
        profile_dataset(dataset, out, client=client, overwrite=kept is not None, first=first)
    else:
        profile_window(dataset, out, client=client, first=first, history=history, overwrite=kept is not None)
    stats = Profile.open(out).stats
    create_table_artifact(
        [
            {"table": name, "rows": s.rows, "accesses": s.accesses, "rows_read": s.distinct,
             "top_1pct_rows_share_of_accesses": round(s.top1pct_share, 3),
             "top_10pct_rows_share_of_accesses": round(s.top10pct_share, 3), "zipf_slope": round(s.zipf_slope, 2)}
            for name, s in stats.items()
        ],
        key=artifact_key("profile", run_dir),
        description=f"Row access skew of {dataset}" + ("" if history is None else
                    f", as the training examples of parts {first + 1}.. read it (histories of up to {history} items)")
        + " (shares: of all accesses, to the most-read 1% / 10% of the rows read)",
    )
    return stats


@task(name="shard", task_run_name="shard", cache_policy=NONE)
def shard(config: RetrainConfig, profile_path: str, out: str,
          previous_plan: str | None) -> tuple[list[PlanSummary | StrategyRefused], ReplanDecision]:
    """(every strategy's figures, the drift decision): the version's plan, the promoted one's kept or replaced.

    A version resumed part-way keeps the plan it was trained with, unless it resumes on
    another topology (devices lost or added): then a fresh plan of this topology replaces
    it, and the checkpoint's rows move onto it (Engine.restore).
    """
    topology, kwargs = config.parsed_topology, config.plan_options()
    rows, plans = compare_strategies(profile_path, topology, **kwargs)
    decision_file = Path(out) / "decision.json"
    made = (Path(out) / MANIFEST).is_file() and decision_file.is_file()
    if made and parse_topology(read_plan_manifest(out).topology, f"{out}/manifest.json") == topology:
        get_run_logger().info("reusing plan %s", out)
        decision = parse_decision(json.loads(decision_file.read_text()), str(decision_file))
    else:
        decision = keep_or_replan(profile_path, out, topology, out if made else previous_plan,
                                  strategy=config.plan.strategy, margin=config.nightly.replan_margin,
                                  fresh=plans.get(config.plan.strategy), overwrite=made, **kwargs)
        write_record(decision_file, decision.record())
    get_run_logger().info("plan: %s", decision.reason)
    create_table_artifact(
        [_comparison_row(r) for r in rows],
        key=artifact_key("plan-comparison", config.run_dir),
        description=f"Every strategy on {config.plan.topology}, batch {config.train.batch_size}, "
        f"dedup {config.plan.dedup}",
    )
    refused = [r for r in rows if isinstance(r, StrategyRefused)]
    if refused:  # long reasons in their own artifact: a table cuts them off at the UI's width
        create_markdown_artifact("\n".join(["# Strategies that made no plan", ""]
                                           + [f"- **{r.strategy}**: {r.error}" for r in refused]),
                                 key=artifact_key("plan-refusals", config.run_dir),
                                 description="Why a strategy made no plan under this budget")
    create_table_artifact(
        table_tiers(plans, topology),
        key=artifact_key("plan-tables", config.run_dir),
        description="Where each strategy puts every table: a device (a whole table), or its rows per tier",
    )
    return rows, decision


def _comparison_row(r: PlanSummary | StrategyRefused) -> dict:
    """One strategy's figures; every row has every column (the UI takes its columns from the first row), and
    short ones: the whole table fits the UI's 1600 px (a strategy with no plan says so in `plan`)."""
    if isinstance(r, StrategyRefused):
        return {"strategy": r.strategy, "plan": "none: see plan-refusals",
                **dict.fromkeys(("MB_per_step", "inter_node_MB", "comm_us", "bound_us", "max_MB_per_device"))}
    mb = 1e6
    return {
        "strategy": r.strategy,
        "plan": "made",
        "MB_per_step": round(r.bytes_per_step / mb, 3),
        "inter_node_MB": round(r.inter_node_bytes_per_step / mb, 3),
        "comm_us": round(r.comm_time_s_per_step * 1e6, 2),
        "bound_us": round(r.lower_bound_comm_time_s_per_step * 1e6, 2),
        "max_MB_per_device": round(max(r.memory_bytes_per_device) / mb, 3),
    }


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
    """A lost worker, handed to the flow as a task's result (see _lost): why, in one line."""

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
    for epochs_done, path in reversed(complete_checkpoints(run_dir)):
        try:
            m, moved = engine.restore(path)
        except WorkerLost as e:
            return _lost("resume", e)
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
    the UI keeps its history night after night.
    """
    mb, rows = 1e6, []
    for epoch, path in complete_checkpoints(version_dir):
        info = read_checkpoint(path).figures
        rounded = {
            k: None if info[k] is None else round(info[k], digits)
            for k, digits in (
                ("loss", 4),
                ("auc", 4),
                ("hr_at_10", 4),
                ("ndcg_at_10", 4),
                ("logloss", 4),
                *((k, 4) for k in VALIDATION_KEYS),
                ("examples_per_s", 0),
                ("seconds", 1),
            )
        }
        measured = info["bytes_per_step"]
        rows.append({"epoch": epoch, **rounded,
                     "bytes_per_step_MB_measured": None if measured is None else round(measured / mb, 3),
                     "bytes_per_step_MB_modeled": round(modeled_bytes_per_step / mb, 3)})
    create_table_artifact(
        rows,
        key=artifact_key("epoch-metrics", run_dir),
        description=f"Per epoch: loss, held-out AUC, HR@10 and NDCG@10 or log-loss (val_: on the validation split, "
                    f"with one), speed, traffic ({version_dir})",
    )


PROGRESS_EVERY_S = 2.0  # how often a training epoch moves its progress artifact


@dataclass(frozen=True)
class EpochDone:
    """A trained epoch: what it did, the model's held-out metrics after it, and its validation split's (val_
    keys; none without a split)."""

    stats: EpochStats
    metrics: dict
    validation: dict

    def figures(self, bytes_per_step: float) -> dict:
        """What its checkpoint keeps (storage.checkpoint.CheckpointManifest's figures), with the bytes per step
        measured so far."""
        return {"loss": self.stats.loss, **metric_values(self.metrics), **validation_of(self.validation),
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
        return _lost(f"epoch {epoch}", e)
    get_run_logger().info("epoch %d: %d steps, loss %.4f, AUC %.4f, %.0f examples/s", epoch, stats.steps,
                          stats.loss, done.metrics["auc"], stats.examples_per_s)
    return done


@task(name="checkpoint", task_run_name="checkpoint-epoch-{epoch}", cache_policy=NONE)
def checkpoint(engine: Engine, run_dir: str, epoch: int, figures: dict) -> str | Lost:
    """The checkpoint after epoch `epoch` (numbered from 1), with what it measured (`figures`,
    storage.checkpoint.CheckpointManifest's): its path, or Lost (see _lost)."""
    path = checkpoint_dir(run_dir, epoch)
    try:
        engine.checkpoint(path, epoch, figures)
    except WorkerLost as e:
        return _lost(f"checkpoint {epoch}", e)
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
    or Lost (see _lost)."""
    found = dict(complete_checkpoints(version_dir))
    epochs = max(found, default=0)
    best = best_epoch(validation_scores(version_dir)) if patience is not None else None
    if best is None:
        return Kept(epochs, None, {})
    if best != epochs:
        try:
            engine.restore(found[best])
        except WorkerLost as e:
            return _lost("restoring the best epoch", e)
        get_run_logger().info("kept epoch %d of %d: the best validation score", best, epochs)
    return Kept(epochs, best, validation_of(read_checkpoint(found[best]).figures))


@task(name="download", task_run_name="download", cache_policy=NONE)
def download(engine: Engine, out: str, epochs: int, best_epoch: int | None, strategy: str) -> str | Lost:
    """The one parameter download of a run, after the last epoch: the model's path, or Lost (see _lost)."""
    try:
        engine.export(out, epochs, best_epoch, strategy)
    except WorkerLost as e:
        return _lost("download", e)
    get_run_logger().info("model exported to %s", out)
    return out


def unless_lost(result: T | Lost) -> T:
    """A task's result, or the WorkerLost it handed back (see _lost), raised in the flow that recovers it."""
    if isinstance(result, Lost):
        raise WorkerLost(result.why)
    return result


def _lost(what: str, e: WorkerLost) -> Lost:
    """A lost worker, handed to the flow as a result: it restores the cluster and resumes from the last
    checkpoint, so the loss is a warning in the run's summary, not a red task inside a Completed run."""
    get_run_logger().warning("%s stopped: %s", what, e)
    return Lost(str(e))


@task(name="evaluate", task_run_name="evaluate", cache_policy=NONE)
def evaluate(model_dir: str, dataset: str, users: int | None, seed: int, eval_from: int = 0) -> dict:
    return evaluate_export(model_dir, dataset, users, seed, eval_from)


@task(name="exit", task_run_name="exit", cache_policy=NONE)
def release_parameter_servers(engine: Engine | None) -> None:
    if engine is not None:
        engine.close()


@task(name="plots", task_run_name="plots", cache_policy=NONE)
def plots(run_dir: str, profile_path: str, plan_path: str,
          strategies: list[PlanSummary | StrategyRefused]) -> list[str]:
    """Access curve with tier boundaries, per-device traffic per strategy, loss and AUC per epoch (SVG)."""
    import numpy as np

    from shardflow.planner.plan import GLOBAL, NODE
    from shardflow.reporting.plots import bar_chart, line_chart, stacked_chart

    out = Path(run_dir) / "plots"
    out.mkdir(parents=True, exist_ok=True)
    plan, _, _, _ = read_plan(plan_path)
    prof = Profile.open(profile_path)
    curves, marks = {}, {}
    for t in plan.tables:
        counts = np.sort(prof.counts(t.name))[::-1]
        ranks = np.unique(np.geomspace(1, counts.size, 400).astype(np.int64))
        curves[t.name] = (ranks.tolist(), np.maximum(counts[ranks - 1], 1).tolist())
        n_global, n_node = int((t.tier == GLOBAL).sum()), int((t.tier == NODE).sum())
        if n_global:
            marks[f"{t.name}: global | node"] = n_global
        if n_node:
            marks[f"{t.name}: node | single"] = n_global + n_node
    files = [line_chart(out / "access.svg", curves, title="Accesses per row, most-read first (tiers dashed)",
                        xlabel="row rank", ylabel="accesses", log=True, marks=marks)]
    groups = {r.strategy: [b / 1e6 for b in r.device_bytes_per_step] for r in strategies if isinstance(r, PlanSummary)}
    files.append(bar_chart(out / "traffic.svg", groups, title="Bytes sent + received per device per step (cost model)",
                           xlabel="device", ylabel="MB per step"))
    epochs = [read_checkpoint(p) for _, p in complete_checkpoints(run_dir)]
    if epochs:
        x = [m.epochs_done for m in epochs]
        files.append(stacked_chart(out / "training.svg",
                                   [("training loss", {"training loss": (x, [m.loss for m in epochs])}),
                                    ("held-out AUC", {"AUC (held out)": (x, [m.auc for m in epochs])})],
                                   title="Loss and AUC per epoch", xlabel="epochs done", integer_x=True))
    return [str(f) for f in files]


def tidy(run_dir: str) -> None:
    """Remove the unfinished stores a cut-off run left behind (under the run's lock).

    Called at the start and again at the end: workers of a killed run finish the write
    they were in (a second or so) and may leave a few files after the first sweep.
    """
    left = remove_leftovers(run_dir) + remove_leftovers(Path(run_dir) / "checkpoints") + (
        versions.sweep_temporary(run_dir) if (Path(run_dir) / versions.VERSIONS).is_dir() else [])
    if left:
        get_run_logger().warning(
            "removed %d unfinished stores a cut-off run left behind: %s", len(left), ", ".join(left)
        )


def kept_note(version: str) -> str:
    """What a stopped run leaves for the next one."""
    if complete_checkpoints(version):
        return (f"the checkpoints in {version} are kept: a new run resumes from the last complete one (on a new "
                "plan if its topology has other devices)")
    return f"no checkpoint of {version} was complete yet: a new run starts it from the beginning"


def checkpoint_paths(version: str) -> list[str]:
    """The complete checkpoints of a version directory, oldest first."""
    return [str(p) for _, p in complete_checkpoints(version)]
