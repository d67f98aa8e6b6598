"""The sharding stage without Prefect: profile + topology -> plan store and its summary."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from logging import Logger, LoggerAdapter
from pathlib import Path
from typing import Any

import numpy as np

from shardflow.errors import DamagedStore, InputError
from shardflow.model import sizes
from shardflow.planner.access import TableAccess, sequence_lookups
from shardflow.planner.costmodel import CostModel, StepShape
from shardflow.planner.memory import budget_bytes_per_device
from shardflow.planner.report import PlanSummary, StrategyRefused, bound_and_baseline, summarize
from shardflow.planner.sharding_plan import SINGLE, ShardingPlan, TablePlan, check_plan
from shardflow.planner.strategies import STRATEGIES, propose
from shardflow.planner.topology import Topology, parse_topology
from shardflow.records import parse_record
from shardflow.sharding.touch import fit_touch
from storage.dataset import Dataset
from storage.lock import writer_lock
from storage.manifest import MANIFEST
from storage.plan_store import PlanManifest, read_plan_arrays, read_plan_manifest, read_summary, write_plan
from storage.profile import Profile
from storage.staging import check_destination, staged
from storage.versions import write_record


def accesses_from_profile(profile: Profile, history: int, negatives: int) -> list[TableAccess]:
    """Lookup classes of every profiled table, with lookups per training example from the dataset.

    The sequence table is read by every history item, the positive and the negatives of
    an example (exact counts from the dataset's sequence lengths, or, for a profile of a
    training window, from the lookups it counted); a feature table once per example, a table of token
    sequences (genres) as often as the profiled examples hold its ids on average.
    """
    if history < 1 or negatives < 0:
        raise InputError(f"history = {history}, negatives = {negatives}; accepted: history >= 1, negatives >= 0")
    dataset = Dataset.open(profile.dataset.path)
    if dataset.info.checksum != profile.dataset.checksum:
        raise InputError(
            f"{profile.path} profiles dataset {dataset.path} with checksum {profile.dataset.checksum}, "
            f"but that dataset now has {dataset.info.checksum}; accepted: a profile of the current dataset "
            "(run 'shardflow profile' again)"
        )
    window = profile.dataset.window
    if window.history is not None and window.history != history:
        raise InputError(f"{profile.path} counts the lookups of histories of {window.history} items; this plan's "
                         f"examples read {history}; accepted: a profile made with history {history}")
    accesses = []
    for name in profile.stats:
        if name == dataset.info.sequence_table and window.examples is not None and window.item_lookups is not None:
            per_example = window.item_lookups / max(window.examples, 1) + negatives
            accesses.append(TableAccess.from_counts(name, profile.counts(name), per_example, negatives / per_example))
        elif name == dataset.info.sequence_table:
            per_example, uniform = sequence_lookups(dataset.offsets(), history, negatives)
            accesses.append(TableAccess.from_counts(name, profile.counts(name), per_example, uniform))
        elif name in dataset.info.widths:  # token sequences: the ids the window's examples hold, on average
            counts = profile.counts(name)
            examples = sum(s.events for s in dataset.segments[window.first_part:])
            accesses.append(TableAccess.from_counts(name, counts, max(int(counts.sum()), 1) / max(examples, 1)))
        else:
            accesses.append(TableAccess.from_counts(name, profile.counts(name), 1.0))
    return accesses


def cost_model(profile: Profile, accesses: list[TableAccess], topology: Topology, shape: StepShape, history: int,
               negatives: int) -> CostModel:
    """The cost model with every table's distinct rows fitted to real batches of the profiled dataset
    (shardflow.sharding.touch): of its training window, if the profile counted one, with the validation split
    the profile's examples left out."""
    dataset, window = Dataset.open(profile.dataset.path), profile.dataset.window
    return CostModel(topology, shape, fit_touch(dataset, accesses, topology, shape.batch_size, history, negatives,
                                                first=window.first_part, validation=window.held > 1))


@dataclass(frozen=True)
class PlanInputs:
    """What planning a profile over a topology takes: its accesses, the cost model, the budget per device and
    where they came from (recorded in the plan store)."""

    accesses: list[TableAccess]
    model: CostModel
    budget_bytes: int
    source: dict[str, Any]


def plan_inputs(profile_path: str | Path, topology: Topology, shape: StepShape, memory_slack: float = 0.0,
                history: int = sizes.HISTORY, negatives: int = sizes.NEGATIVES) -> PlanInputs:
    profile = Profile.open(profile_path)
    accesses = accesses_from_profile(profile, history, negatives)
    model = cost_model(profile, accesses, topology, shape, history, negatives)
    budget = budget_bytes_per_device(accesses, topology, shape.dim, memory_slack, shape.row_optimizer)
    source = {"profile_path": profile_path, "profile": profile, "history": history, "negatives": negatives,
              "memory_slack": memory_slack}
    return PlanInputs(accesses, model, budget, source)


def make_plan(
    profile_path: str | Path,
    out: str | Path,
    topology: Topology,
    *,
    strategy: str,
    shape: StepShape,
    memory_slack: float = 0.0,
    history: int = sizes.HISTORY,
    negatives: int = sizes.NEGATIVES,
    overwrite: bool = False,
) -> PlanSummary:
    """Plan, evaluate and store; returns the summary."""
    if strategy not in STRATEGIES:
        raise InputError(f"strategy {strategy!r}; accepted: {', '.join(STRATEGIES)}")
    check_destination(Path(out), overwrite=overwrite, reads=(profile_path,))
    inputs = plan_inputs(profile_path, topology, shape, memory_slack, history, negatives)
    plan = propose(strategy, inputs.accesses, topology, inputs.budget_bytes, inputs.model)
    return store_plan(out, plan, inputs, overwrite=overwrite)


def store_plan(out: str | Path, plan: ShardingPlan, inputs: PlanInputs, *, overwrite: bool = False) -> PlanSummary:
    """Summarise `plan` against the bound and row-wise-mod and write the plan store; the summary."""
    accesses, model, budget, source = inputs.accesses, inputs.model, inputs.budget_bytes, inputs.source
    bound, mod = bound_and_baseline(accesses, model.topology, budget, model)
    summary = summarize(plan, accesses, model.topology, budget, model, bound, mod)
    provenance = {
        "profile": str(Path(source["profile_path"]).resolve()),
        "profile_checksum": source["profile"].manifest.checksum,
        **{k: source[k] for k in ("history", "negatives", "memory_slack")},
    }
    description = {"strategy": plan.strategy, "topology": model.topology.to_dict(),
                   "step": dataclasses.asdict(model.shape), "budget_bytes_per_device": int(budget),
                   "source": provenance}
    with writer_lock(out), staged(Path(out), overwrite=overwrite) as stage:
        write_plan(stage, {t.name: {"tier": t.tier, "home": t.home, "partial_ids": t.partial_ids,
                                    "partial_nodes": t.partial_nodes} for t in plan.tables}, description,
                   summary.to_dict())
    return summary


def read_plan_summary(path: str | Path) -> PlanSummary:
    """The summary kept beside the plan stored at `path`; an InputError naming its first bad key."""
    return parse_record(PlanSummary, read_summary(path), f"{path}/summary.json")


@dataclass(frozen=True)
class StoredPlan:
    """A complete plan store, read back and checked: the plan, the topology and step shape it was made for, and
    its manifest (the profile and dataset it came from)."""

    plan: ShardingPlan
    topology: Topology
    shape: StepShape
    manifest: PlanManifest


def read_plan(path: str | Path) -> StoredPlan:
    """The plan store at `path`, its parts checked against each other."""
    arrays, m = read_plan_arrays(path)
    topology = parse_topology(m.topology, f"{path}/manifest.json topology")
    plan = ShardingPlan(m.strategy, tuple(TablePlan(name, **a) for name, a in arrays.items()))
    check_plan(plan, m.tables, topology)
    return StoredPlan(plan, topology, StepShape(**m.step), m)


def extend_plan(old: ShardingPlan, rows: dict[str, int], devices: int) -> ShardingPlan:
    """`old` grown to `rows` rows per table: the rows it places keep tier and home; a new row
    is stored once, on device id % devices (as row-wise-mod would place it)."""
    tables = []
    for t in old.tables:
        new = np.arange(t.rows, rows[t.name], dtype=np.int64)
        tables.append(TablePlan(t.name, np.concatenate([t.tier, np.full(new.size, SINGLE, dtype=np.int8)]),
                                np.concatenate([t.home, (new % devices).astype(np.int32)]), t.partial_ids,
                                t.partial_nodes))
    return ShardingPlan(old.strategy, tuple(tables))


@dataclass(frozen=True)
class ReplanDecision:
    """Whether a model version trains on a fresh plan or on the previous version's placement, and why.

    Kept beside the version's plan as decision.json (`record`, read back by `parse_decision`).
    """

    replanned: bool
    reason: str
    fresh_comm_time_s: float  # the fresh plan's predicted communication time per step
    previous_comm_time_s: float | None  # the extended previous plan's (None without a comparable one)

    def record(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def parse_decision(record: dict[str, Any], where: str = "decision.json") -> ReplanDecision:
    """A ReplanDecision from its record; an InputError naming the key that is missing or of the wrong kind."""
    return parse_record(ReplanDecision, record, where)


def keep_or_replan(
    profile_path: str | Path,
    out: str | Path,
    topology: Topology,
    previous: str | Path | None,
    *,
    strategy: str,
    shape: StepShape,
    margin: float,
    memory_slack: float = 0.0,
    history: int = sizes.HISTORY,
    negatives: int = sizes.NEGATIVES,
    fresh: ShardingPlan | None = None,
    overwrite: bool = False,
) -> ReplanDecision:
    """Drift-aware planning for a new model version: keep `previous`'s placement unless a fresh plan pays.

    `fresh`: the strategy's plan of this profile if the caller made it already (with the
    same budget and cost model), so it is not made twice. `overwrite`: replace the store at
    `out` (a resumed version's plan of another topology; `previous` may be that store, read
    before it is replaced).

    The previous plan, extended to the new rows (extend_plan), and a fresh plan of the
    new profile are costed by the same model on the new profile. The run re-plans when
    there is no previous plan, the topology, strategy or step shape changed, the extended
    plan no longer fits the memory budget, or the fresh plan's predicted communication
    time beats it by more than `margin` (0.05: 5%). Writes the chosen plan to `out` (its
    summary is in the store) and returns the decision.
    """
    if not 0 <= margin < 1:
        raise InputError(f"replan margin = {margin!r}; accepted: 0 <= margin < 1 (0.05 = 5%)")
    check_destination(Path(out), overwrite=overwrite, reads=(profile_path,))
    inputs = plan_inputs(profile_path, topology, shape, memory_slack, history, negatives)
    accesses, model, budget = inputs.accesses, inputs.model, inputs.budget_bytes
    by_name = {a.name: a for a in accesses}
    if fresh is None:
        fresh = propose(strategy, accesses, topology, budget, model)
    fresh_s = model.evaluate(fresh, by_name).comm_time_s_per_step
    chosen, previous_s, reason = fresh, None, "no previous plan (a cold start)"
    if previous is not None:
        chosen, previous_s, reason = _against_previous(previous, fresh, fresh_s, inputs, topology, strategy, shape,
                                                       margin)
    store_plan(out, chosen, inputs, overwrite=overwrite)
    return ReplanDecision(chosen is fresh, reason, float(fresh_s), None if previous_s is None else float(previous_s))


def _against_previous(previous: str | Path, fresh: ShardingPlan, fresh_s: float, inputs: PlanInputs, topology: Topology,
                      strategy: str, shape: StepShape, margin: float) -> tuple[ShardingPlan, float | None, str]:
    """(the plan chosen, the previous plan's modeled seconds per step if it could be costed, why): the previous
    placement extended to the new rows, kept unless it no longer applies, fits, or pays."""
    try:
        old = read_plan(previous)
    except DamagedStore as e:  # made from a profile: a fresh plan replaces it
        return fresh, None, f"the previous plan is damaged ({e})"
    if old.topology != topology:
        return fresh, None, f"the topology changed ({old.topology.devices} devices → {topology.devices})"
    if (old.manifest.strategy, old.shape) != (strategy, shape):
        return fresh, None, (f"the strategy or step shape changed ({old.manifest.strategy}, {old.shape} → "
                             f"{strategy}, {shape})")
    accesses, model, budget = inputs.accesses, inputs.model, inputs.budget_bytes
    extended = extend_plan(old.plan, {a.name: a.rows for a in accesses}, topology.devices)
    previous_s = model.evaluate(extended, {a.name: a for a in accesses}).comm_time_s_per_step
    need = int(extended.memory_bytes_per_device(topology, shape.dim, shape.row_optimizer).max())
    if need > budget:
        return fresh, previous_s, f"the previous plan no longer fits: {need:,} bytes on a device, budget {budget:,}"
    if fresh_s < previous_s * (1 - margin):
        return fresh, previous_s, (f"a fresh plan predicts {fresh_s * 1e6:.1f} µs/step against "
                                   f"{previous_s * 1e6:.1f}: better by more than {margin:.0%}")
    return extended, previous_s, (f"kept the previous placement: {previous_s * 1e6:.1f} µs/step against a fresh "
                                  f"plan's {fresh_s * 1e6:.1f}, within {margin:.0%}")


def compare_strategies(
    profile_path: str | Path,
    topology: Topology,
    *,
    shape: StepShape,
    memory_slack: float,
    history: int = sizes.HISTORY,
    negatives: int = sizes.NEGATIVES,
) -> tuple[list[PlanSummary | StrategyRefused], dict[str, ShardingPlan]]:
    """(every strategy's summary under the same budget, the plans made); a strategy that fits no plan
    says why and has no plan."""
    inputs = plan_inputs(profile_path, topology, shape, memory_slack, history, negatives)
    accesses, model, budget = inputs.accesses, inputs.model, inputs.budget_bytes
    bound, mod = bound_and_baseline(accesses, topology, budget, model)
    rows: list[PlanSummary | StrategyRefused] = []
    plans: dict[str, ShardingPlan] = {}
    for name in STRATEGIES:
        try:
            plans[name] = propose(name, accesses, topology, budget, model)
        except InputError as e:
            rows.append(StrategyRefused(name, str(e)))
            continue
        rows.append(summarize(plans[name], accesses, topology, budget, model, bound, mod))
    return rows, plans


@dataclass(frozen=True)
class VersionPlan:
    """A model version's planning: every strategy's figures under one budget (a refused one says why), the
    plans made, and the decision that put the version's plan in its store (kept, re-made, or read back)."""

    rows: list[PlanSummary | StrategyRefused]
    plans: dict[str, ShardingPlan]
    decision: ReplanDecision


DECISION = "decision.json"  # beside a version's plan: its ReplanDecision's record


def plan_version(profile_path: str | Path, out: str | Path, topology: Topology, previous: str | Path | None, *,
                 strategy: str, margin: float, log: Logger | LoggerAdapter[Logger], shape: StepShape,
                 memory_slack: float, history: int = sizes.HISTORY, negatives: int = sizes.NEGATIVES) -> VersionPlan:
    """Every strategy compared, and the version's plan at `out`: the promoted one's (`previous`) kept or
    replaced (keep_or_replan).

    A plan already at `out` with its decision, intact and of this topology, is a version
    resumed part-way: it keeps the plan it was trained with. On another topology (devices
    lost or added) a fresh plan of this one replaces it, and the checkpoint's rows move onto
    it (Engine.restore). A damaged plan is logged and made again.
    """
    rows, plans = compare_strategies(profile_path, topology, shape=shape, memory_slack=memory_slack,
                                     history=history, negatives=negatives)
    decision_file, there = Path(out) / DECISION, (Path(out) / MANIFEST).is_file()
    made = there and decision_file.is_file() and _intact(out, log)
    if made and parse_topology(read_plan_manifest(out).topology, f"{out}/manifest.json") == topology:
        log.info("reusing plan %s", out)
        decision = parse_decision(json.loads(decision_file.read_text()), str(decision_file))
    else:
        decision = keep_or_replan(profile_path, out, topology, out if made else previous, strategy=strategy,
                                  margin=margin, fresh=plans.get(strategy), overwrite=there, shape=shape,
                                  memory_slack=memory_slack, history=history, negatives=negatives)
        write_record(decision_file, decision.record())
    log.info("plan: %s", decision.reason)
    return VersionPlan(rows, plans, decision)


def _intact(plan: str | Path, log: Logger | LoggerAdapter[Logger]) -> bool:
    """Whether the plan at `plan` reads back as written; a damaged one is logged, to be made again."""
    try:
        read_plan(plan)
        return True
    except DamagedStore as e:  # derived from the profile: made again, not a failure every night
        log.warning("%s; planning again", e)
        return False
