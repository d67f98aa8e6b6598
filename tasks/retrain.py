"""The retraining run's task groups before and after training: each a named task the Prefect UI shows on its
own, handing its work to the core (shardflow.importing, .profiling, .sharding, .training, .reporting) and
publishing what the operator reads."""

from __future__ import annotations

import contextlib

from distributed import Client
from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NONE

from shardflow import lifecycle
from shardflow.config import RetrainConfig
from shardflow.importing import Imported, bring_in
from shardflow.model.metrics import Metrics
from shardflow.planner.report import PlanSummary, StrategyRefused, table_tiers
from shardflow.profiling.profiles import profile_version
from shardflow.reporting import tables
from shardflow.reporting.run_plots import run_plots
from shardflow.reporting.run_report import artifact_key
from shardflow.sharding.stage import ReplanDecision, plan_version, read_plan_summary
from shardflow.training.evaluate import evaluate_export
from storage.profile import TableStats


@task(name="import-dataset", task_run_name="import-dataset", cache_policy=NONE)
def prepare_dataset(config: RetrainConfig) -> Imported:
    """The dataset store and the parts this run added to it (shardflow.importing.bring_in)."""
    return bring_in(config, get_run_logger())


@task(name="profile", task_run_name="profile", cache_policy=NONE)
def profile(dataset: str, out: str, client: Client, run_dir: str, first: int = 0,
            history: int | None = None, held: int = 1) -> dict[str, TableStats]:
    """Per-row lookups by the training window's examples (each user's last `held` events not trained on), or
    per-row accesses of the whole log (shardflow.profiling.profiles.profile_version); every table's figures,
    published as the profile table."""
    stats = profile_version(dataset, out, client=client, first=first, history=history, log=get_run_logger(),
                            held=held)
    create_table_artifact(tables.profile_rows(stats), key=artifact_key("profile", run_dir),
                          description=tables.profile_description(dataset, first, history))
    return stats


@task(name="shard", task_run_name="shard", cache_policy=NONE)
def shard(config: RetrainConfig, profile_path: str, out: str,
          previous_plan: str | None) -> tuple[list[PlanSummary | StrategyRefused], ReplanDecision]:
    """(every strategy's figures, the drift decision): the version's plan, the promoted one's kept or replaced
    (shardflow.sharding.stage.plan_version); the comparison, refusals and placements published."""
    topology, chosen = config.parsed_topology, config.plan.strategy
    made = plan_version(profile_path, out, topology, previous_plan, strategy=chosen,
                        margin=config.nightly.replan_margin, log=get_run_logger(), **config.plan_options())
    decision = made.decision
    kept = None if decision.replanned else read_plan_summary(out)
    create_table_artifact(
        tables.comparison_rows(made.rows, chosen, decision.replanned, kept),
        key=artifact_key("plan-comparison", config.run_dir),
        description=f"Every strategy on {config.plan.topology}, batch {config.train.batch_size}, dedup "
        f"{config.plan.dedup}; `trains`: the plan this version trains on ({decision.reason})",
    )
    refusals = tables.refusals_markdown(made.rows)
    if refusals is not None:
        create_markdown_artifact(refusals, key=artifact_key("plan-refusals", config.run_dir),
                                 description="Why a strategy made no plan under this budget")
    create_table_artifact(
        table_tiers(made.plans, topology),
        key=artifact_key("plan-tables", config.run_dir),
        description="Where each strategy puts every table: a device (a whole table), or its rows per tier",
    )
    return made.rows, decision


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
                                             worker_log=config.layout.worker_log))
    get_run_logger().info("Dask dashboard: %s", client.dashboard_link)
    return client


@task(name="recommend", task_run_name="recommend", cache_policy=NONE)
def recommend(config: RetrainConfig, dataset: str, run: str, number: int, first_part: int, client) -> str | None:
    """After the gate: the top-K lists (nightly.top_k) of the current model into version `number`'s store
    (shardflow.training.recommend.lists_of_night); its path, or None where none are written."""
    from shardflow.training.recommend import lists_of_night

    out = lists_of_night(run, number, dataset, k=config.nightly.top_k, first_part=first_part,
                         users_from=config.nightly.recommend_users, client=client, log=get_run_logger())
    return None if out is None else str(out)


@task(name="plots", task_run_name="plots", cache_policy=NONE)
def plots(run_dir: str, profile_path: str, plan_path: str,
          strategies: list[PlanSummary | StrategyRefused]) -> list[str]:
    """Access curve with tier boundaries, per-device traffic per strategy, loss and AUC per epoch (SVG)."""
    return [str(f) for f in run_plots(run_dir, profile_path, plan_path, strategies)]


def tidy(run_dir: str) -> None:
    """Remove the unfinished stores a cut-off run left behind (shardflow.lifecycle.remove_leftovers), saying so."""
    left = lifecycle.remove_leftovers(run_dir)
    if left:
        get_run_logger().warning(
            "removed %d unfinished stores a cut-off run left behind: %s", len(left), ", ".join(left)
        )
