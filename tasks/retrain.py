"""The retraining run's task groups: each a named task the Prefect UI shows on its own."""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path

from distributed import Client
from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NONE

from shardflow.config import RetrainConfig
from shardflow.errors import DamagedStore, InputError
from shardflow.model.metrics import Metrics
from shardflow.planner.report import PlanSummary, StrategyRefused, table_tiers
from shardflow.planner.topology import parse_topology
from shardflow.preflight import import_kwargs, imported_source, run_layout, same_source, source_parts, source_warnings
from shardflow.profiling.profiles import profile_dataset, profile_window
from shardflow.reporting.run_report import artifact_key
from shardflow.reporting.tables import number
from shardflow.sharding.stage import (
    ReplanDecision,
    compare_strategies,
    keep_or_replan,
    parse_decision,
    read_plan,
    read_plan_summary,
)
from shardflow.training.evaluate import evaluate_export
from storage import versions
from storage.checkpoint import complete_checkpoints, read_checkpoint
from storage.dataset import Dataset
from storage.importers import import_dataset, repair_command
from storage.manifest import MANIFEST
from storage.plan_store import read_plan_manifest
from storage.profile import Profile, TableStats
from storage.staging import remove_leftovers
from storage.versions import write_record


@dataclass(frozen=True)
class Imported:
    """The dataset store a run trains on, the names of the parts it added, and what it warned of."""

    path: str
    parts_added: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()


def verify_dataset(store: Path) -> None:
    """Hash every array of the dataset store a run trains on, every run: a chunk changed in place leaves the
    manifest as it was. A damaged segment stops the run with the command that rebuilds it from its part."""
    ds = Dataset.open(store, hashed=False)
    try:
        ds.verify()
    except DamagedStore as e:
        raise InputError(f"{e}. To rebuild it from its part: {repair_command(ds.info.source, e.segment, store)}") \
            from None


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
    source, dest = Path(config.data.dataset), run_layout(config).dataset
    if (source / MANIFEST).is_file():
        verify_dataset(source)
        return Imported(str(source))
    known = imported_source(config)
    warnings = tuple(source_warnings(source, source_parts(config, known)))
    for w in warnings:
        get_run_logger().warning("%s", w)
    if known is not None and same_source(known, config):
        verify_dataset(dest)  # before the append: its new parts are hashed as they are written
        added = import_dataset(config.data.dataset_format, source, dest, append=True,
                               settle_s=config.data.part_settle_s, **import_kwargs(config)).parts_added
        get_run_logger().info("%s %s (imported from %s)", f"appended {len(added)} parts to" if added else "reusing",
                              dest, source)
        return Imported(str(dest), tuple(Path(p).name for p in added), warnings)
    done = import_dataset(config.data.dataset_format, source, dest, overwrite=(dest / MANIFEST).is_file(),
                          settle_s=config.data.part_settle_s, **import_kwargs(config))
    return Imported(str(dest), tuple(Path(p).name for p in done.parts_added), warnings)


@task(name="profile", task_run_name="profile", cache_policy=NONE)
def profile(dataset: str, out: str, client: Client, run_dir: str, first: int = 0,
            history: int | None = None) -> dict[str, TableStats]:
    """Per-row lookups by the training window's examples (parts `first` on, with their `history`-item
    histories), or, without `history`, per-row accesses of the whole log; a complete profile of this very
    dataset and window is reused. Every table's figures."""
    log = get_run_logger()
    checksum = Dataset.open(dataset).info.checksum
    there = (Path(out) / MANIFEST).is_file()
    kept = None
    if there:
        try:
            kept = Profile.open(out)
        except DamagedStore as e:  # derived from the dataset: made again, not a failure every night
            log.warning("%s; profiling again", e)
    made = kept and kept.dataset
    if made and (made.checksum, made.window.first_part, made.window.history) == (checksum, first, history):
        log.info("reusing profile %s", out)
        stats = kept.stats
    elif history is None:
        stats = profile_dataset(dataset, out, client=client, overwrite=there, first=first).tables
    else:
        stats = profile_window(dataset, out, client=client, first=first, history=history,
                               overwrite=there).tables
    create_table_artifact(
        [
            {"table": name, "rows": number(s.rows, 0), "accesses": number(s.accesses, 0),
             "rows_read": number(s.distinct, 0), "top_1pct_share": number(s.top1pct_share, 3),
             "top_10pct_share": number(s.top10pct_share, 3), "zipf_slope": number(s.zipf_slope, 2)}
            for name, s in stats.items()
        ],
        key=artifact_key("profile", run_dir),
        description=f"Row access skew of {dataset}" + ("" if history is None else
                    f", as the training examples of parts {first + 1}.. read it (histories of up to {history} items)")
        + " (top_1pct_share / top_10pct_share: the share of all accesses that reads the most-read 1% / 10% of the "
        "rows read)",
    )
    return stats


def _intact(plan: str) -> bool:
    """Whether the plan at `plan` reads back as written; a damaged one is logged, to be made again."""
    try:
        read_plan(plan)
        return True
    except DamagedStore as e:  # derived from the profile: made again, not a failure every night
        get_run_logger().warning("%s; planning again", e)
        return False


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
    there = (Path(out) / MANIFEST).is_file()
    made = there and decision_file.is_file() and _intact(out)
    if made and parse_topology(read_plan_manifest(out).topology, f"{out}/manifest.json") == topology:
        get_run_logger().info("reusing plan %s", out)
        decision = parse_decision(json.loads(decision_file.read_text()), str(decision_file))
    else:
        decision = keep_or_replan(profile_path, out, topology, out if made else previous_plan,
                                  strategy=config.plan.strategy, margin=config.nightly.replan_margin,
                                  fresh=plans.get(config.plan.strategy), overwrite=there, **kwargs)
        write_record(decision_file, decision.record())
    get_run_logger().info("plan: %s", decision.reason)
    chosen = config.plan.strategy
    table = [_comparison_row(r, trains=r.strategy == chosen and decision.replanned) for r in rows]
    if not decision.replanned:  # the previous version's plan, extended, trains: its own figures, not the fresh one's
        table.append(_comparison_row(read_plan_summary(out), trains=True, plan="kept"))
    create_table_artifact(
        table,
        key=artifact_key("plan-comparison", config.run_dir),
        description=f"Every strategy on {config.plan.topology}, batch {config.train.batch_size}, dedup "
        f"{config.plan.dedup}; `trains`: the plan this version trains on ({decision.reason})",
    )
    refused = [r for r in rows if isinstance(r, StrategyRefused)]
    if refused:  # long reasons in their own artifact: a table cuts them off at the UI's width
        create_markdown_artifact("\n".join(["# Strategies that made no plan", ""]
                                           + [f"- **{r.strategy}**: {r.error.removeprefix(f'{r.strategy}: ')}"
                                              for r in refused]),
                                 key=artifact_key("plan-refusals", config.run_dir),
                                 description="Why a strategy made no plan under this budget")
    create_table_artifact(
        table_tiers(plans, topology),
        key=artifact_key("plan-tables", config.run_dir),
        description="Where each strategy puts every table: a device (a whole table), or its rows per tier",
    )
    return rows, decision


def _comparison_row(r: PlanSummary | StrategyRefused, trains: bool = False, plan: str = "made") -> dict:
    """One strategy's figures; every row has every column (the UI takes its columns from the first row), and
    short ones: the whole table fits the UI's artifact width (a strategy with no plan says so in `plan`)."""
    if isinstance(r, StrategyRefused):
        return {"strategy": r.strategy, "plan": "none: see plan-refusals", "trains": "",
                **dict.fromkeys(("MB_per_step", "inter_node_MB", "comm_us", "bound_us", "max_MB_per_device"), "")}
    mb = 1e6
    return {
        "strategy": r.strategy,
        "plan": plan,
        "trains": "yes" if trains else "",
        "MB_per_step": number(r.bytes_per_step / mb, 3),
        "inter_node_MB": number(r.inter_node_bytes_per_step / mb, 3),
        "comm_us": number(r.comm_time_s_per_step * 1e6, 1),
        "bound_us": number(r.lower_bound_comm_time_s_per_step * 1e6, 1),
        "max_MB_per_device": number(max(r.memory_bytes_per_device) / mb, 3),
    }


@task(name="evaluate", task_run_name="evaluate", cache_policy=NONE)
def evaluate(model_dir: str, dataset: str, users: int | None, seed: int, eval_from: int = 0,
             full_ranking: str = "exclude-seen", client=None) -> Metrics:
    """The export's held-out metrics; a sequence model's also over the whole catalog, block by block on the
    cluster's workers (shardflow.model.ranking)."""
    return evaluate_export(model_dir, dataset, users, seed, eval_from, full_ranking, client)


@task(name="start-cluster", task_run_name="start-cluster", cache_policy=NONE)
def start_cluster(config: RetrainConfig, stack: contextlib.ExitStack) -> Client:
    """The run's Dask cluster (shardflow.cluster.run_cluster: the config's scheduler, cluster class or a local
    cluster of one worker per device), entered on `stack`: it is closed when the flow leaves the stack. Its own
    task so that the run graph shows the seconds a cluster takes to start."""
    from shardflow.cluster import run_cluster

    client = stack.enter_context(run_cluster(**dict(config.cluster), workers=config.parsed_topology.devices,
                                             gpus=config.train.device == "cuda",
                                             worker_log=run_layout(config).worker_log))
    get_run_logger().info("Dask dashboard: %s", client.dashboard_link)
    return client


@task(name="recommend", task_run_name="recommend", cache_policy=NONE)
def recommend(config: RetrainConfig, dataset: str, run: str, number: int, first_part: int, client) -> str | None:
    """After the gate: the top-K lists (nightly.top_k) of the users seen in version `number`'s training window
    (or every user) from the current model, into the version's recommendations store; its path, or None where
    none are written (top_k 0, a click log, a model with event features)."""
    from shardflow.data.clicks import config_from_record
    from shardflow.training.recommend import recommend_export, why_no_lists
    from storage.checkpoint import read_export_manifest

    log, current = get_run_logger(), versions.current(run)
    if config.nightly.top_k == 0 or current is None:
        return None
    model = str(versions.version_dir(run, current) / "model")
    why = why_no_lists(config_from_record(read_export_manifest(model).model))  # recommend_export verifies
    if why is not None:
        log.info("no top-K lists: %s", why)
        return None
    out = versions.version_dir(run, number) / "recommendations"
    made = recommend_export(model, dataset, out, k=config.nightly.top_k, first_part=first_part,
                            users_from=config.nightly.recommend_users, version=current, client=client,
                            overwrite=out.exists())
    log.info("top-%d lists of %d users from version %d: %s", made["k"], made["users"], current, out)
    return str(out)


@task(name="plots", task_run_name="plots", cache_policy=NONE)
def plots(run_dir: str, profile_path: str, plan_path: str,
          strategies: list[PlanSummary | StrategyRefused]) -> list[str]:
    """Access curve with tier boundaries, per-device traffic per strategy, loss and AUC per epoch (SVG)."""
    import numpy as np

    from shardflow.planner.sharding_plan import GLOBAL, NODE
    from shardflow.reporting.plots import bar_chart, line_chart, stacked_chart

    out = Path(run_dir) / "plots"
    out.mkdir(parents=True, exist_ok=True)
    plan = read_plan(plan_path).plan
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
