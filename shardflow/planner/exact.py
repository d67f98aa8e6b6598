"""The exact optimum of the cost model on small instances: a mixed-integer program over row classes.

Rows of a class are interchangeable (access.py), so a plan is, per class, how many of its
rows take each placement: single on device d, on every node with home d (one copy a node,
where replica_device puts it), or on every device with home d. Every quantity the cost
model prices is a sum over rows of what each row's placement adds: the copies on each
device, the bytes each device sends and receives inside its node, the bytes each node's
uplink carries out and in. So with integer counts n[c, placement] all of them are linear,
and the modeled time, the busiest link's seconds, is the least T with T >= every link's
load over its bandwidth: min T over the counts is a mixed-integer linear program, solved
exactly by HiGHS (scipy.optimize.milp).

The coefficients come from the cost model itself (CostModel.evaluate on one row of the
class at a time), so the program optimises exactly what every strategy is judged by; it
searches the plans the plan format can hold. Its size is classes x 3 x devices
variables: for tests and benchmarks on small instances, not for planning production
tables.
"""

from __future__ import annotations

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp

from shardflow.errors import InputError
from shardflow.planner.access import TableAccess
from shardflow.planner.costmodel import CostModel
from shardflow.planner.plan import GLOBAL, NODE, SINGLE, ShardingPlan, TablePlan, replica_device, row_bytes

TIERS = (SINGLE, NODE, GLOBAL)
MAX_VARIABLES = 20_000
MIP_GAP = 1e-4  # the solver stops within 0.01% of the optimum (its proven bound says how far)


def link_loads(access: TableAccess, cls: int, tier: int, home: int, model: CostModel) -> np.ndarray:
    """Bytes one row of class `cls` placed at (tier, home) adds to each link direction, in the order
    [intra out of every device, intra into every device, uplink out of every node, uplink into every node]."""
    one = TableAccess(access.name, 1, access.lookups_per_example, access.class_prob[cls : cls + 1],
                      np.ones(1, dtype=np.int64), np.zeros(1, dtype=np.int32))
    plan = ShardingPlan("one row", (TablePlan(access.name, np.array([tier], np.int8), np.array([home], np.int32)),))
    cost = model.evaluate(plan, {access.name: one})
    pairs = cost.lookup_pairs + cost.sync_pairs
    intra, inter = pairs * cost.same_node, pairs * ~cost.same_node
    starts = model.topology.node_start
    return np.concatenate([intra.sum(axis=1), intra.sum(axis=0),
                           np.add.reduceat(inter.sum(axis=1), starts), np.add.reduceat(inter.sum(axis=0), starts)])


def copies(tier: int, home: int, model: CostModel) -> np.ndarray:
    """Copies per device of a row placed at (tier, home)."""
    topo = model.topology
    if tier == GLOBAL:
        return np.ones(topo.devices)
    out = np.zeros(topo.devices)
    if tier == SINGLE:
        out[home] = 1
    else:
        for node in range(len(topo.nodes)):
            out[int(replica_device(np.array([home]), topo, node)[0])] += 1
    return out


def exact_plan(accesses: list[TableAccess], budget_bytes: int, model: CostModel,
               time_limit_s: float = 120.0) -> tuple[ShardingPlan, float]:
    """(a plan of least modeled communication time under the budget, that time)."""
    topo = model.topology
    P, N = topo.devices, len(topo.nodes)
    placements = [(t, d) for t in TIERS for d in range(P)]
    classes = [(a, c) for a in accesses for c in range(a.class_prob.size)]
    n_vars = len(classes) * len(placements) + 1
    if n_vars > MAX_VARIABLES:
        raise InputError(f"{len(classes)} row classes on {P} devices make {n_vars:,} variables; accepted: at most "
                         f"{MAX_VARIABLES:,} (the exact program is for small instances)")
    budget_rows = budget_bytes // row_bytes(model.shape.dim)
    links = 2 * P + 2 * N
    load = np.zeros((links, n_vars))
    memory = np.zeros((P, n_vars))
    rows = np.zeros((len(classes), n_vars))
    for i, (a, c) in enumerate(classes):
        for j, (t, d) in enumerate(placements):
            k = i * len(placements) + j
            load[:, k] = link_loads(a, c, t, d, model)
            memory[:, k] = copies(t, d, model)
            rows[i, k] = 1
    bandwidth = np.concatenate([np.full(2 * P, topo.intra_bytes_per_s), topo.uplink_bytes_per_s,
                                topo.uplink_bytes_per_s])
    load = load / bandwidth[:, None] * 1e6  # microseconds: well above the solver's absolute tolerances
    load[:, -1] = -1.0  # a link's microseconds - T <= 0
    counts = np.array([a.class_rows[c] for a, c in classes], dtype=np.float64)
    objective = np.zeros(n_vars)
    objective[-1] = 1.0
    integrality = np.ones(n_vars)
    integrality[-1] = 0
    result = milp(
        objective,
        constraints=[LinearConstraint(rows, counts, counts), LinearConstraint(memory, -np.inf, budget_rows),
                     LinearConstraint(load, -np.inf, 0.0)],
        integrality=integrality,
        bounds=Bounds(0, np.inf),
        options={"time_limit": time_limit_s, "mip_rel_gap": MIP_GAP},
    )
    if result.status != 0 or result.x is None:
        raise InputError(f"the exact program found no optimal plan: {result.message}; accepted: an instance whose "
                         f"tables fit {P} devices x {budget_rows:,} rows, solved within {time_limit_s:g} s")
    n = np.rint(result.x[:-1]).astype(np.int64).reshape(len(classes), len(placements))
    tables, i = [], 0
    for a in accesses:
        tier, home = np.empty(a.rows, np.int8), np.empty(a.rows, np.int32)
        for c in range(a.class_prob.size):
            members = np.flatnonzero(a.row_class == c)
            at = np.repeat(np.arange(len(placements)), n[i])
            tier[members] = np.array([placements[j][0] for j in at], dtype=np.int8)
            home[members] = np.array([placements[j][1] for j in at], dtype=np.int32)
            i += 1
        tables.append(TablePlan(a.name, tier, home))
    plan = ShardingPlan("exact", tuple(tables))
    return plan, model.evaluate(plan, {a.name: a for a in accesses}).comm_time_s_per_step
