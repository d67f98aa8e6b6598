"""The numbers a plan is judged by: memory, traffic, modeled time, the bound and the gap closed."""

from __future__ import annotations

import numpy as np

from shardflow.planner.access import TableAccess
from shardflow.planner.costmodel import CostModel
from shardflow.planner.plan import ShardingPlan, row_bytes
from shardflow.planner.relaxation import floor_bound, lower_bound, node_bound, row_floors, tier_costs
from shardflow.planner.strategies import RowWiseMod
from shardflow.planner.topology import Topology


def bound_and_baseline(
    accesses: list[TableAccess], topology: Topology, budget_bytes: int, model: CostModel
) -> tuple[float, float]:
    """(lower bound on communication time, row-wise-mod's time) for this memory, scope and model."""
    spare = topology.devices * (budget_bytes // row_bytes(model.shape.dim)) - sum(a.rows for a in accesses)
    spare = max(spare, 0)
    # Three valid bounds: the fractional relaxation, the floor indivisible hot rows set, and each
    # node's uplink carrying what the node cannot hold. The first two price a trainer's remote reads
    # one by one, so with scope node (one fetch a node) only the third holds.
    bound = node_bound(accesses, model, budget_bytes // row_bytes(model.shape.dim))
    if model.shape.dedup != "node":
        bound = max(bound, lower_bound(tier_costs(accesses, model), spare),
                    floor_bound(row_floors(accesses, model), spare))
    mod = RowWiseMod().plan(accesses, topology, budget_bytes, model)
    return bound, model.evaluate(mod, {a.name: a for a in accesses}).comm_time_s_per_step


def gap_closed(plan_s: float, mod_s: float, bound_s: float) -> float:
    """(mod - plan) / (mod - bound); 1.0 when row-wise-mod already sits on the bound (nothing to close)."""
    if mod_s - bound_s <= 1e-9 * mod_s:
        return 1.0 if plan_s <= mod_s else 0.0
    return (mod_s - plan_s) / (mod_s - bound_s)


def summarize(
    plan: ShardingPlan,
    accesses: list[TableAccess],
    topology: Topology,
    budget_bytes: int,
    model: CostModel,
    bound_s: float,
    mod_s: float,
) -> dict:
    cost = model.evaluate(plan, {a.name: a for a in accesses})
    return {
        "strategy": plan.strategy,
        "dedup": model.shape.dedup,
        "devices": topology.devices,
        "budget_bytes_per_device": int(budget_bytes),
        "memory_bytes_per_device": [int(b) for b in plan.memory_bytes_per_device(topology, model.shape.dim)],
        "lookup_bytes_per_step": cost.lookup_bytes_per_step,
        "sync_bytes_per_step": cost.sync_bytes_per_step,
        "bytes_per_step": cost.bytes_per_step,
        "inter_node_bytes_per_step": cost.inter_node_bytes_per_step,
        "comm_time_s_per_step": cost.comm_time_s_per_step,
        "busiest_link": cost.busiest_link,
        "row_wise_mod_comm_time_s_per_step": mod_s,
        "lower_bound_comm_time_s_per_step": bound_s,
        "gap_closed": gap_closed(cost.comm_time_s_per_step, mod_s, bound_s),
        "tiers": plan.tier_counts(),
        "device_bytes_per_step": [float(b) for b in np.round(cost.device_bytes_per_step(), 3)],
    }
