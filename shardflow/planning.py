"""The planning stage without Prefect: profile + topology -> plan store and its summary."""

from __future__ import annotations

from pathlib import Path

from shardflow.errors import InputError
from shardflow.planner.access import TableAccess, sequence_lookups
from shardflow.planner.costmodel import CostModel, StepShape
from shardflow.planner.report import bound_and_baseline, summarize
from shardflow.planner.strategies import STRATEGIES, budget_bytes_per_device, propose
from shardflow.planner.topology import Topology
from storage.dataset import Dataset
from storage.plan import write_plan
from storage.profile import Profile
from storage.lock import writer_lock
from storage.staging import check_destination, staged

DEFAULT_HISTORY = 20
DEFAULT_NEGATIVES = 4


def accesses_from_profile(profile: Profile, history: int, negatives: int) -> list[TableAccess]:
    """Lookup classes of every profiled table, with lookups per training example from the dataset.

    The sequence table is read by every history item, the positive and the negatives of
    an example (exact counts from the dataset's sequence lengths); a feature table once
    per example.
    """
    if history < 1 or negatives < 0:
        raise InputError(f"history = {history}, negatives = {negatives}; accepted: history >= 1, negatives >= 0")
    dataset = Dataset.open(profile.manifest["dataset"]["path"])
    if dataset.info.checksum != profile.manifest["dataset"]["checksum"]:
        raise InputError(
            f"{profile.path} profiles dataset {dataset.path} with checksum {profile.manifest['dataset']['checksum']}, "
            f"but that dataset now has {dataset.info.checksum}; accepted: a profile of the current dataset "
            "(run 'shardflow profile' again)"
        )
    accesses = []
    for name in profile.stats:
        if name == dataset.info.sequence_table:
            per_example, uniform = sequence_lookups(dataset.offsets(), history, negatives)
            accesses.append(TableAccess.from_counts(name, profile.counts(name), per_example, uniform))
        else:
            accesses.append(TableAccess.from_counts(name, profile.counts(name), 1.0))
    return accesses


def make_plan(
    profile_path: str | Path,
    out: str | Path,
    topology: Topology,
    *,
    strategy: str,
    shape: StepShape,
    memory_slack: float = 0.0,
    history: int = DEFAULT_HISTORY,
    negatives: int = DEFAULT_NEGATIVES,
    overwrite: bool = False,
) -> dict:
    """Plan, evaluate and store; returns the summary."""
    if strategy not in STRATEGIES:
        raise InputError(f"strategy {strategy!r}; accepted: {', '.join(STRATEGIES)}")
    profile = Profile.open(profile_path)
    check_destination(Path(out), overwrite=overwrite)
    accesses = accesses_from_profile(profile, history, negatives)
    model = CostModel(topology, shape)
    budget = budget_bytes_per_device(accesses, topology, shape.dim, memory_slack)
    plan = propose(strategy, accesses, topology, budget, model)
    bound, mod = bound_and_baseline(accesses, topology, budget, model)
    summary = summarize(plan, accesses, topology, budget, model, bound, mod)
    source = {
        "profile": str(Path(profile_path).resolve()),
        "profile_checksum": profile.manifest["checksum"],
        "history": history,
        "negatives": negatives,
        "memory_slack": memory_slack,
    }
    with writer_lock(out), staged(Path(out), overwrite=overwrite) as stage:
        write_plan(stage, plan, topology, shape, budget, source, summary)
    return summary


def compare_strategies(
    profile_path: str | Path,
    topology: Topology,
    *,
    shape: StepShape,
    memory_slack: float,
    history: int = DEFAULT_HISTORY,
    negatives: int = DEFAULT_NEGATIVES,
) -> list[dict]:
    """Every strategy's summary under the same budget; a strategy that fits no plan says why."""
    accesses = accesses_from_profile(Profile.open(profile_path), history, negatives)
    model = CostModel(topology, shape)
    budget = budget_bytes_per_device(accesses, topology, shape.dim, memory_slack)
    bound, mod = bound_and_baseline(accesses, topology, budget, model)
    rows = []
    for name in STRATEGIES:
        try:
            plan = propose(name, accesses, topology, budget, model)
        except InputError as e:
            rows.append({"strategy": name, "error": str(e)})
            continue
        rows.append(summarize(plan, accesses, topology, budget, model, bound, mod))
    return rows
