"""The numbers a plan is judged by: memory, traffic, modeled time, the bound and the gap closed."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import numpy as np

from shardflow.planner.access import TableAccess
from shardflow.planner.costmodel import CostModel, PlanCost
from shardflow.planner.relaxation import floor_bound, lower_bound, node_bound, row_floors, tier_costs
from shardflow.planner.sharding_plan import GLOBAL, NODE, SINGLE, ShardingPlan, TablePlan
from shardflow.planner.strategies import RowWiseMod
from shardflow.planner.topology import Topology
from shardflow.records import plain


def bound_and_baseline(
    accesses: list[TableAccess], topology: Topology, budget_bytes: int, model: CostModel
) -> tuple[float, PlanCost]:
    """(a lower bound on the busiest link's time per step, row-wise-mod's cost) for this memory, scope and
    model. The bound holds for comm_time_s_per_step too: rounds one after another take at least as long as
    their bytes on the busiest link, and the wire's factor and fixed costs only add."""
    spare = topology.devices * (budget_bytes // model.shape.row_bytes) - sum(a.rows for a in accesses)
    spare = max(spare, 0)
    # Three valid bounds: the fractional relaxation, the floor indivisible hot rows set, and each
    # node's uplink carrying what the node cannot hold. The first two price a trainer's remote reads
    # one by one, so with scope node (one fetch a node) only the third holds. The relaxation knows
    # single, node and global copies; a node row copied onto k of N nodes costs what its mix
    # (k-1)/(N-1) of node and the rest single costs only when nodes are the same size, so on three or
    # more nodes of different sizes it is left out.
    bound = node_bound(accesses, model, budget_bytes // model.shape.row_bytes)
    if model.shape.dedup != "node":
        bound = max(bound, floor_bound(row_floors(accesses, model), spare))
        if len(topology.nodes) <= 2 or len(set(topology.node_devices.tolist())) == 1:
            bound = max(bound, lower_bound(tier_costs(accesses, model), spare))
    mod = RowWiseMod().plan(accesses, topology, budget_bytes, model)
    return bound, model.evaluate(mod, {a.name: a for a in accesses})


def gap_closed(plan_s: float, mod_s: float, bound_s: float) -> float:
    """(mod - plan) / (mod - bound); 1.0 when row-wise-mod already sits on the bound (nothing to close)."""
    if mod_s - bound_s <= 1e-9 * mod_s:
        return 1.0 if plan_s <= mod_s else 0.0
    return (mod_s - plan_s) / (mod_s - bound_s)


@dataclass(frozen=True, kw_only=True)
class PlanSummary:
    """What a plan is judged by, under one budget and cost model: what `shardflow plan --json` prints and the
    plan store keeps as summary.json (`to_dict`; read back by shardflow.sharding.stage.read_plan_summary)."""

    strategy: str
    dedup: str  # the de-duplication scope the cost model priced
    devices: int
    budget_bytes_per_device: int
    memory_bytes_per_device: tuple[int, ...]
    lookup_bytes_per_step: float
    sync_bytes_per_step: float
    bytes_per_step: float  # lookup + sync
    inter_node_bytes_per_step: float
    comm_time_s_per_step: float  # the rounds one after another, on their busiest links
    round_payload_s_per_step: dict[str, float]  # round -> its payload's seconds on its busiest link
    link_time_s_per_step: float  # the busiest link's bytes over the whole step
    busiest_link: str
    row_wise_mod_comm_time_s_per_step: float
    lower_bound_comm_time_s_per_step: float
    gap_closed: float  # of row-wise-mod's link time down to the bound (gap_closed)
    tiers: dict[str, int]  # tier name -> rows, all tables together
    node_rows_on_some_nodes: int
    device_bytes_per_step: tuple[float, ...]

    def to_dict(self) -> dict[str, Any]:
        """The JSON form: tuples as lists."""
        return cast(dict[str, Any], plain(self))


@dataclass(frozen=True)
class StrategyRefused:
    """A strategy that made no plan under the budget, and why (its InputError's line)."""

    strategy: str
    error: str


def summarize(
    plan: ShardingPlan,
    accesses: list[TableAccess],
    topology: Topology,
    budget_bytes: int,
    model: CostModel,
    bound_s: float,
    mod: PlanCost,
) -> PlanSummary:
    cost = model.evaluate(plan, {a.name: a for a in accesses})
    return PlanSummary(
        strategy=plan.strategy,
        dedup=model.shape.dedup,
        devices=topology.devices,
        budget_bytes_per_device=int(budget_bytes),
        memory_bytes_per_device=tuple(
            int(b) for b in plan.memory_bytes_per_device(topology, model.shape.dim, model.shape.row_optimizer)),
        lookup_bytes_per_step=cost.lookup_bytes_per_step,
        sync_bytes_per_step=cost.sync_bytes_per_step,
        bytes_per_step=cost.bytes_per_step,
        inter_node_bytes_per_step=cost.inter_node_bytes_per_step,
        comm_time_s_per_step=cost.comm_time_s_per_step,
        round_payload_s_per_step=cost.round_payload_s,
        link_time_s_per_step=cost.link_time_s_per_step,
        busiest_link=cost.busiest_link,
        row_wise_mod_comm_time_s_per_step=mod.comm_time_s_per_step,
        lower_bound_comm_time_s_per_step=bound_s,
        gap_closed=gap_closed(cost.link_time_s_per_step, mod.link_time_s_per_step, bound_s),
        tiers=plan.tier_counts(),
        node_rows_on_some_nodes=int(sum(t.partial_ids.size for t in plan.tables)),
        device_bytes_per_step=tuple(float(b) for b in np.round(cost.device_bytes_per_step(), 3)),
    )


def tier_text(t: TablePlan, devices: int) -> str:
    """Where one table's rows are: 'device 2' (a whole table on one device), or its tiers' row counts,
    e.g. 'global 120 · node 4,000 (300 of them on some nodes only) · single 95,880 on 4 devices'."""
    tiers = np.bincount(t.tier, minlength=3)
    homes = np.flatnonzero(np.bincount(t.home[t.tier == SINGLE], minlength=devices))
    if tiers[SINGLE] == t.rows and homes.size == 1:
        return f"device {int(homes[0])}"
    parts = [f"{name} {int(tiers[k]):,}" for name, k in (("global", GLOBAL), ("node", NODE)) if tiers[k]]
    if t.partial_ids.size:
        parts[-1] += f" ({t.partial_ids.size:,} of them on some nodes only)"
    if tiers[SINGLE]:
        parts.append(f"single {int(tiers[SINGLE]):,} on {homes.size} device{'s' if homes.size > 1 else ''}")
    return " · ".join(parts)


def table_tiers(plans: dict[str, ShardingPlan], topology: Topology) -> list[dict[str, str | int]]:
    """One row per table, a column per strategy: where each plan puts the table's rows (tier_text)."""
    names = [t.name for t in next(iter(plans.values())).tables] if plans else []
    return [{"table": name, "rows": plans[next(iter(plans))].table(name).rows,
             **{s: tier_text(p.table(name), topology.devices) for s, p in plans.items()}} for name in names]
