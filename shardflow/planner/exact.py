"""The exact optimum of the cost model on small instances: a mixed-integer program over row classes.

Rows of a class are interchangeable (access.py), so a plan is, per class, how many of its
rows take each placement: single on device d, on every node with home d (one copy a node,
where replica_device puts it), on some of the nodes (each set holding d's node), or on
every device with home d. Every quantity the cost model prices is a sum over rows of
what each row's placement adds: the copies on each
device, the bytes each device sends and receives inside its node, the bytes each node's
uplink carries out and in. So with integer counts n[c, placement] all of them are linear,
and the modeled time, the busiest link's seconds, is the least T with T >= every link's
load over its bandwidth: min T over the counts is a mixed-integer linear program, solved
exactly by HiGHS (scipy.optimize.milp).

The coefficients come from the cost model itself (CostModel.evaluate on one row of the
class at a time), so the program optimises exactly what every strategy is judged by; it
searches the plans the plan format can hold. Its size is classes x devices x
(2 + 2^(nodes-1) - 1) variables: for tests and benchmarks on small instances, not for
planning production tables.
"""

from __future__ import annotations

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp

from shardflow.errors import InputError
from shardflow.planner.access import TableAccess
from shardflow.planner.costmodel import CostModel, bandwidths, one_row, row_link_bytes
from shardflow.planner.sharding_plan import GLOBAL, NODE, SINGLE, ShardingPlan, TablePlan, table_rows_per_device
from shardflow.planner.topology import Topology

TIERS = (SINGLE, NODE, GLOBAL)
MAX_VARIABLES = 20_000
MIP_GAP = 1e-4  # the solver stops within 0.01% of the optimum (its proven bound says how far)


def exact_plan(accesses: list[TableAccess], budget_bytes: int, model: CostModel,
               time_limit_s: float = 120.0) -> tuple[ShardingPlan, float]:
    """(a plan of least modeled communication time under the budget, that time as the program found it).

    One integer variable per (row class, placement): how many of the class's rows take it; one
    continuous variable T, the busiest link's microseconds, minimised."""
    topo = model.topology
    P = topo.devices
    placements = _placements(topo)
    classes = [(a, c) for a in accesses for c in range(a.class_prob.size)]
    n_vars = len(classes) * len(placements) + 1
    if n_vars > MAX_VARIABLES:
        raise InputError(f"{len(classes)} row classes on {P} devices make {n_vars:,} variables; accepted: at most "
                         f"{MAX_VARIABLES:,} (the exact program is for small instances)")
    budget_rows = budget_bytes // model.shape.row_bytes
    load = np.zeros((2 * P + 2 * len(topo.nodes), n_vars))
    memory = np.zeros((P, n_vars))
    rows = np.zeros((len(classes), n_vars))
    copies = np.array([table_rows_per_device(one_row("row", t, d, nodes), topo) for t, d, nodes in placements]).T
    for i, (a, c) in enumerate(classes):
        for j, (t, d, nodes) in enumerate(placements):
            load[:, i * len(placements) + j] = row_link_bytes(a, c, t, d, model, nodes)
        memory[:, i * len(placements) : (i + 1) * len(placements)] = copies  # a row's copies: its placement's
        rows[i, i * len(placements) : (i + 1) * len(placements)] = 1
    load = load / bandwidths(topo)[:, None] * 1e6  # microseconds: well above the solver's absolute tolerances
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
    counts_placed = np.rint(result.x[:-1]).astype(np.int64).reshape(len(classes), len(placements))
    return _plan_of(accesses, placements, counts_placed), float(result.fun) / 1e6


def _placements(topo: Topology) -> list[tuple[int, int, int]]:
    """Every (tier, home, node mask) a row may take: each tier on each device, and a node row copied onto its
    home's node and some (not all) others."""
    P, N = topo.devices, len(topo.nodes)
    placements = [(t, d, 0) for t in TIERS for d in range(P)]
    for d in range(P):
        own = 1 << int(topo.node_of_device[d])
        placements += [(NODE, d, own | other) for other in range(1, 1 << N) if not other & own
                       and 1 < (own | other).bit_count() < N]
    return placements


def _plan_of(accesses: list[TableAccess], placements: list[tuple[int, int, int]], n: np.ndarray) -> ShardingPlan:
    """The plan that gives `n[i, j]` rows of row class i (in table order) placement j, rows in id order."""
    placed_tier = np.array([t for t, _, _ in placements], dtype=np.int8)
    placed_home = np.array([d for _, d, _ in placements], dtype=np.int32)
    placed_nodes = np.array([nodes for _, _, nodes in placements], dtype=np.int64)
    tables, i = [], 0
    for a in accesses:
        tier, home, nodes = np.empty(a.rows, np.int8), np.empty(a.rows, np.int32), np.zeros(a.rows, np.int64)
        for c in range(a.class_prob.size):
            members = np.flatnonzero(a.row_class == c)
            at = np.repeat(np.arange(len(placements)), n[i])
            tier[members], home[members], nodes[members] = placed_tier[at], placed_home[at], placed_nodes[at]
            i += 1
        partial = np.flatnonzero(nodes)
        tables.append(TablePlan(a.name, tier, home, partial.astype(np.int64), nodes[partial]))
    return ShardingPlan("exact", tuple(tables))
