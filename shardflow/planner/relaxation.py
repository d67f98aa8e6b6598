"""The fractional tier choice: FlexShard's tiers, and the lower bound on communication time.

Per class of rows and per tier, the bytes a row causes on inter-node links (I) and on
intra-node links (J), at their least over every placement (perfect balance):

    single  I = x·w·(P - n_max)          J = x·w·(n_min - 1)
    node    I = s·(Σ_A qA - max_A qA + (N-1)·q_any)   (two nodes: s·Σ_A qA, plan.exchanges_partials)
            J = x·w·(P - N)
    global  I = same as node              J = s·(P - N)·(q + q_any)

with w = 2·id + 2·4·dim (one remote read and its gradient), s = id + 4·dim (one sync
message), x, q, qA, q_any the class rates of costmodel.py. Every byte leaves through one
device port (intra) or one node uplink (inter), so any plan's time is at least
T = max(ΣI / Σ uplinks, ΣJ / (P · intra)). Replication costs memory: a node row takes N
slots, a global row P, a single row 1, against the budget summed over devices.

Relaxing tiers to fractions gives a linear program; for a weight θ its scalarised form
min θ·ΣI/ΣBW + (1-θ)·ΣJ/(P·bw) is a multiple-choice knapsack whose LP optimum the
greedy below finds exactly (upgrades along each class's lower convex hull, best saving
per slot first, the last one fractional). Every LP(θ) is a lower bound on T over all
plans with the memory, scope and cost model given; the bound is their maximum over θ
(LP(θ) is concave). FlexShard takes the greedy's integral solution (a split class is
split by whole rows: its rows are interchangeable) at the θ whose solution has the
smallest T.

A plan may also copy a node row onto some nodes only (sharding_plan.py). On nodes of one size such
a row on k of N nodes costs exactly the mix (k-1)/(N-1) node, the rest single (reads
fall and sync grows by one node's share per copy), so every LP(θ) still bounds those
plans; on three or more nodes of different sizes it need not, and the report leaves it
out there (report.bound_and_baseline).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from shardflow.planner.access import TableAccess
from shardflow.planner.costmodel import CostModel
from shardflow.planner.sharding_plan import GLOBAL, ID_BYTES, NODE, SINGLE, VALUE_BYTES, exchanges_partials

GOLDEN = (np.sqrt(5) - 1) / 2


@dataclass(frozen=True)
class RowFloors:
    """What one indivisible row puts on its home's busiest link, per class.

    A single row's home receives every remote read of it; its own trainer meanwhile
    receives the rows it reads from elsewhere. If single rows carry load X per trainer
    (at least the total less the most the spare memory can replicate), the home's link
    carries at least  own · X + extra · x_r  (`own` seconds per unit of its trainer's
    remote reads, `extra` per unit of the row's reads by others beyond that).
    """

    rows: np.ndarray
    x: np.ndarray  # remote-read units per trainer
    own: np.ndarray  # per node shape: seconds per unit of X
    extra: np.ndarray  # per node shape: seconds per unit of the row's own load
    replicated: np.ndarray  # least floor of a replicated copy (node or global)
    extra_slots: int  # the fewest extra copies a replicated row needs (one: a node row on two nodes)


@dataclass(frozen=True)
class TierCosts:
    """Classes of all tables, concatenated: rows, and inter/intra bytes per row for each tier."""

    rows: np.ndarray  # int64 [C]
    inter: np.ndarray  # float64 [3, C], by tier SINGLE, NODE, GLOBAL
    intra: np.ndarray  # float64 [3, C]
    slots: np.ndarray  # int64 [3]: copies per row in each tier
    allowed: np.ndarray  # bool [3]: tiers this topology distinguishes
    up_bytes_per_s: float  # all uplinks together
    intra_bytes_per_s: float  # all device ports together

    def time(self, tier_rows: np.ndarray) -> float:
        """Lower-bound time of a (possibly fractional) assignment: rows of each class per tier [3, C]."""
        inter = float((tier_rows * self.inter).sum()) / self.up_bytes_per_s
        intra = float((tier_rows * self.intra).sum()) / self.intra_bytes_per_s
        return max(inter, intra)


def row_floors(accesses: list[TableAccess], model: CostModel) -> RowFloors:
    topo = model.topology
    P, N, n = topo.devices, len(topo.nodes), topo.node_devices
    a, v = ID_BYTES, VALUE_BYTES * model.shape.dim
    read = 2 * a + v  # into the home per remote read: the id, then the id and the gradient
    intra, up = topo.intra_bytes_per_s, float(topo.uplink_bytes_per_s.max())
    node_allowed = 1 < N < P
    # The home's link (its intra port with one node, else its node's uplink in) carries the
    # row's reads by the `others` trainers elsewhere (`read` each) and its own `mine` trainers'
    # reads of the single load not held there (v each): with L the load held there,
    # mine·v·(X - L) + others·read·L, at least mine·v·X + (others·read - mine·v)·x_r when the
    # coefficient is >= 0, else others·read·X (as L <= X). Least over node sizes.
    if N == 1:
        shapes, bandwidth = [(1, P - 1)], intra
    else:
        shapes, bandwidth = [(int(k), P - int(k)) for k in (n.min(), n.max())], up
    own, extra = np.array(
        [
            (mine * v, others * read - mine * v) if others * read >= mine * v else (others * read, 0.0)
            for mine, others in shapes
        ]
    ).T / bandwidth
    xs, replicated = [], []
    for acc in accesses:
        r = model.rates(acc)
        xs.append(r.x)
        node_floor = r.x * read * (n.min() - 1) / intra if node_allowed else np.full(r.x.size, np.inf)
        global_floor = np.maximum(
            (n.min() - 1) * r.q * (a + v) / intra, (N - 1) * r.q_node.min(axis=0) * (a + v) / up
        )
        replicated.append(np.minimum(node_floor, global_floor))
    return RowFloors(
        rows=np.concatenate([a.class_rows for a in accesses]),
        x=np.concatenate(xs),
        own=own,
        extra=extra,
        replicated=np.concatenate(replicated),
        extra_slots=1 if node_allowed else (P - 1),  # a node row may be copied onto just one more node
    )


def floor_bound(floors: RowFloors, spare_slots: int) -> float:
    """Least time over plans with indivisible rows: the most-read single row is the top of class k
    once the k most-read classes are replicated (which must fit the spare slots), and the
    replicated copies have floors of their own."""
    order = np.argsort(-floors.x, kind="stable")
    x, rows = floors.x[order], floors.rows[order]
    # The single load cannot fall below the total less the hottest rows the spare slots can copy.
    copyable = spare_slots // floors.extra_slots if floors.extra_slots else 0
    taken = np.minimum(rows, np.maximum(copyable - (np.cumsum(rows) - rows), 0))
    least_single_load = float((rows * x).sum() - (taken * x).sum())
    top = np.append(x, 0.0)  # the most-read single class once k are replicated
    single = (floors.own[:, None] * least_single_load + floors.extra[:, None] * top[None, :]).min(axis=0)
    if floors.extra_slots == 0:
        return float(single[0])
    slots = np.concatenate([[0], np.cumsum(rows * floors.extra_slots)])
    replicated = np.concatenate([[0.0], np.maximum.accumulate(floors.replicated[order])])
    feasible = slots <= spare_slots
    return float(np.maximum(single, replicated)[feasible].min())


def tier_costs(accesses: list[TableAccess], model: CostModel) -> TierCosts:
    topo = model.topology
    P, N = topo.devices, len(topo.nodes)
    n = topo.node_devices
    a, v = ID_BYTES, VALUE_BYTES * model.shape.dim
    read, msg = 2 * a + 2 * v, a + v
    parts = []
    for acc in accesses:
        r = model.rates(acc)
        if exchanges_partials(topo):
            repl_inter = msg * r.q_node.sum(axis=0)
        else:
            repl_inter = msg * (r.q_node.sum(axis=0) - r.q_node.max(axis=0) + (N - 1) * r.q_any)
        parts.append(
            (
                acc.class_rows,
                np.stack([r.x * read * (P - n.max()), repl_inter, repl_inter]),
                np.stack([r.x * read * (n.min() - 1), r.x * read * (P - N), msg * (P - N) * (r.q + r.q_any)]),
            )
        )
    return TierCosts(
        rows=np.concatenate([p[0] for p in parts]),
        inter=np.concatenate([p[1] for p in parts], axis=1),
        intra=np.concatenate([p[2] for p in parts], axis=1),
        slots=np.array([1, N, P], dtype=np.int64),
        # With one node a node copy is a single copy; with one device per node it is a global one.
        allowed=np.array([True, 1 < N < P, P > 1]),
        up_bytes_per_s=float(topo.uplink_bytes_per_s.sum()) if N > 1 else np.inf,
        intra_bytes_per_s=topo.intra_bytes_per_s * P,
    )


def greedy(costs: TierCosts, theta: float, spare_slots: int) -> tuple[np.ndarray, float]:
    """LP optimum of the θ-scalarised problem: (rows of each class per tier [3, C], LP value).

    The assignment is integral except that the last upgrade may cover only part of a
    class's rows (a whole number of them).
    """
    inter_w = theta / costs.up_bytes_per_s if np.isfinite(costs.up_bytes_per_s) else 0.0
    cost = inter_w * costs.inter + (1 - theta) / costs.intra_bytes_per_s * costs.intra
    cost[~costs.allowed] = np.inf
    s = costs.slots
    C = costs.rows.size
    # Upgrade steps along each class's lower convex hull: single -> node -> global, or single -> global.
    with np.errstate(invalid="ignore", divide="ignore"):
        e_sn = (cost[SINGLE] - cost[NODE]) / max(s[NODE] - s[SINGLE], 1)
        e_ng = (cost[NODE] - cost[GLOBAL]) / max(s[GLOBAL] - s[NODE], 1)
        e_sg = (cost[SINGLE] - cost[GLOBAL]) / max(s[GLOBAL] - s[SINGLE], 1)
    via_node = costs.allowed[NODE] & (e_sn >= e_sg) & (e_sn > 0)
    steps_class = np.concatenate([np.flatnonzero(via_node), np.flatnonzero(via_node), np.flatnonzero(~via_node)])
    steps_from = np.repeat([SINGLE, NODE, SINGLE], [via_node.sum(), via_node.sum(), C - via_node.sum()])
    steps_to = np.repeat([NODE, GLOBAL, GLOBAL], [via_node.sum(), via_node.sum(), C - via_node.sum()])
    eff = np.concatenate([e_sn[via_node], e_ng[via_node], e_sg[~via_node]])
    keep = (eff > 0) & np.isfinite(eff)
    steps_class, steps_from, steps_to, eff = steps_class[keep], steps_from[keep], steps_to[keep], eff[keep]
    order = np.lexsort((steps_to, -eff))  # best saving per slot first; for a class, node before global
    steps_class, steps_from, steps_to, eff = steps_class[order], steps_from[order], steps_to[order], eff[order]

    per_row = s[steps_to] - s[steps_from]
    need = costs.rows[steps_class] * per_row
    done = np.cumsum(need) <= spare_slots
    full = int(done.sum())  # the cumulative need only grows: the first `full` steps fit
    tier_rows = np.zeros((3, C), dtype=np.int64)
    tier_rows[SINGLE] = costs.rows
    fraction_saving = 0.0
    _apply(tier_rows, steps_class[:full], steps_from[:full], steps_to[:full], costs.rows[steps_class[:full]])
    if full < steps_class.size:
        left = spare_slots - int(need[:full].sum())
        k = min(int(left // per_row[full]), int(costs.rows[steps_class[full]]))
        if k > 0:
            last = slice(full, full + 1)
            _apply(tier_rows, steps_class[last], steps_from[last], steps_to[last], np.array([k]))
        # The LP takes the rest of the spare slots as a fraction of one more row.
        fraction_saving = float(eff[full]) * (left - k * int(per_row[full]))
    value = float((tier_rows * np.where(np.isfinite(cost), cost, 0.0)).sum()) - fraction_saving
    return tier_rows, value


def _apply(tier_rows: np.ndarray, cls: np.ndarray, src: np.ndarray, dst: np.ndarray, k: np.ndarray) -> None:
    np.subtract.at(tier_rows, (src, cls), k)
    np.add.at(tier_rows, (dst, cls), k)


def lower_bound(costs: TierCosts, spare_slots: int, iterations: int = 40) -> float:
    """max over θ of LP(θ): golden-section search on a concave function of θ."""
    if not np.isfinite(costs.up_bytes_per_s):
        return greedy(costs, 0.0, spare_slots)[1]
    lo, hi = 0.0, 1.0
    best = max(greedy(costs, 0.0, spare_slots)[1], greedy(costs, 1.0, spare_slots)[1])
    x1, x2 = hi - GOLDEN * (hi - lo), lo + GOLDEN * (hi - lo)
    f1, f2 = greedy(costs, x1, spare_slots)[1], greedy(costs, x2, spare_slots)[1]
    for _ in range(iterations):
        if f1 < f2:
            lo, x1, f1 = x1, x2, f2
            x2 = lo + GOLDEN * (hi - lo)
            f2 = greedy(costs, x2, spare_slots)[1]
        else:
            hi, x2, f2 = x2, x1, f1
            x1 = hi - GOLDEN * (hi - lo)
            f1 = greedy(costs, x1, spare_slots)[1]
    return max(best, f1, f2)


def node_bound(accesses: list[TableAccess], model: CostModel, budget_rows: int) -> float:
    """Each node's uplink: what the node cannot hold its trainers read over it.

    Node A holds at most n_A · budget_rows rows (a row held there, on any tier, takes at
    least one of its slots). Every read by one of its n_A trainers of a row it does not
    hold crosses its uplink: (2·id + 4·dim) bytes out and 4·dim in a unit of remote-read
    load x (costmodel.py). So A's uplink carries at least n_A·(2·id + 4·dim)·X_A out, X_A
    the load of every row but its n_A · budget_rows most-read; any plan's time is at
    least the largest of those over the uplinks' bandwidths. On uneven links this is
    what the slow node alone forces, which the pooled bounds above average away. With
    scope `node` the node fetches such a row once for all its trainers: q_node units.
    """
    topo = model.topology
    if len(topo.nodes) < 2:
        return 0.0
    unit = 2 * ID_BYTES + VALUE_BYTES * model.shape.dim
    rows = np.concatenate([a.class_rows for a in accesses]).astype(np.float64)
    rates = [model.rates(a) for a in accesses]
    per_trainer = np.concatenate([r.x for r in rates])
    worst = 0.0
    nodes = zip(topo.node_devices.tolist(), topo.uplink_bytes_per_s.tolist(), strict=True)
    for node, (n, bandwidth) in enumerate(nodes):
        if model.shape.dedup == "node":  # the node fetches a row once for all its trainers
            x, per_unit = np.concatenate([r.q_node[node] for r in rates]), unit
        else:
            x, per_unit = per_trainer, n * unit
        order = np.argsort(-x, kind="stable")
        x, r = x[order], rows[order]
        held_rows, held_load = np.cumsum(r), np.cumsum(r * x)
        total = float(held_load[-1])
        hold = n * budget_rows
        k = int(np.searchsorted(held_rows, hold, side="right"))  # whole classes held
        load = float(held_load[k - 1]) if k else 0.0
        if k < x.size:
            load += (hold - (float(held_rows[k - 1]) if k else 0.0)) * float(x[k])
        worst = max(worst, per_unit * max(total - load, 0.0) / bandwidth)
    return worst


def best_tiers(costs: TierCosts, spare_slots: int, grid: int = 33) -> np.ndarray:
    """The greedy's integral solution with the smallest lower-bound time over a grid of θ."""
    thetas = np.linspace(0.0, 1.0, grid) if np.isfinite(costs.up_bytes_per_s) else [0.0]
    candidates = [greedy(costs, t, spare_slots)[0] for t in thetas]
    times = [costs.time(c) for c in candidates]
    return candidates[int(np.argmin(times))]
