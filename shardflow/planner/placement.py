"""Where rows live: tiers from per-class counts, homes for replicated and single rows.

Replicated rows are homed round-robin (serpentine) in order of falling access
probability, so every device leads about the same share of sync. Single rows are dealt
in order of falling load, by positions: the hottest HEAD_ROWS one by one (LPT: to the
least-loaded node, then device, weighted so that a node with a slow uplink gets less);
warm rows in proportion to how far each device is below the common water level; the
cold rest (the last 0.01% of load) in proportion to the room left. Rows of one class
are interchangeable, so positions map back to rows by class and rank within class,
chunk by chunk: no pass over a 10^8-row table holds more than a few 10^6-row buffers.
"""

from __future__ import annotations

import heapq
import math

import numpy as np

from shardflow.errors import InputError
from shardflow.planner.access import CHUNK_ROWS, TableAccess
from shardflow.planner.copies import choose_copies
from shardflow.planner.costmodel import CostModel
from shardflow.planner.refine import refine
from shardflow.planner.sharding_plan import GLOBAL, NODE, SINGLE, TablePlan, replica_device
from shardflow.planner.topology import Topology

HEAD_ROWS = 1 << 15  # hottest single rows placed one by one (LPT); the rest are dealt vectorised


def tiers_from_counts(access: TableAccess, global_rows: np.ndarray, node_rows: np.ndarray) -> np.ndarray:
    """Per row: the first global_rows[c] rows (by id) of class c are global, the next node_rows[c] node."""
    tier = np.empty(access.rows, dtype=np.int8)
    for s in range(0, access.rows, CHUNK_ROWS):
        c = access.row_class[s : s + CHUNK_ROWS]
        rank = access.rank_in_class[s : s + CHUNK_ROWS]
        g = global_rows[c]
        tier[s : s + CHUNK_ROWS] = np.where(rank < g, GLOBAL, np.where(rank < g + node_rows[c], NODE, SINGLE))
    return tier


def by_falling_probability(access: TableAccess, mask: np.ndarray) -> np.ndarray:
    """Row ids where `mask` holds, most-read first (ties by id)."""
    rows = np.flatnonzero(mask)
    class_rank = np.empty(access.class_prob.size, dtype=np.int32)
    class_rank[access.class_order] = np.arange(access.class_prob.size)
    return rows[np.argsort(class_rank[access.row_class[rows]], kind="stable")]


def serpentine(n: int, P: int) -> np.ndarray:
    """0, 1, ..., P-1, P-1, ..., 0, 0, 1, ...: dealing rows of falling load this way evens the sums."""
    i = np.arange(n, dtype=np.int64)
    lap, pos = np.divmod(i, P)
    return np.where(lap % 2 == 0, pos, P - 1 - pos)


def interleave(counts: np.ndarray, n: int) -> np.ndarray:
    """A sequence of n devices, device d `counts[d]` times, spread evenly: the block sequence
    read with a stride coprime to n (golden-ratio step), chunk by chunk."""
    blocks = np.repeat(np.arange(counts.size, dtype=np.int32), counts)[:n]
    if n <= 1:
        return blocks
    step = max(1, round(n * 0.6180339887))
    while math.gcd(step, n) != 1:
        step += 1
    out = np.empty(n, dtype=np.int32)
    for s in range(0, n, CHUNK_ROWS):
        out[s : s + CHUNK_ROWS] = blocks[(np.arange(s, min(n, s + CHUNK_ROWS), dtype=np.int64) * step) % n]
    return out


def shares(amounts: np.ndarray, n: int) -> np.ndarray:
    """n split in proportion to `amounts` (largest remainders), as whole counts."""
    exact = amounts / amounts.sum() * n
    counts = np.floor(exact).astype(np.int64)
    counts[np.argsort(counts - exact, kind="stable")[: n - int(counts.sum())]] += 1
    return counts


def uplink_weights(topology: Topology, model: CostModel) -> np.ndarray:
    """Share of single-row load per device that evens out the uplinks' time.

    Node A's uplink carries about n_A·W (its trainers' reads from elsewhere) plus
    (P - 2·n_A)·W_A (others' reads from it, net of its own) for single-row load W_A of W.
    Water-filling on that when every node has P > 2·n_A; otherwise (one or two nodes)
    the split does not change the uplinks and devices share equally.
    """
    P, n = topology.devices, topology.node_devices
    coef = P - 2 * n
    bw = topology.uplink_bytes_per_s
    if len(n) < 3 or (coef <= 0).any() or np.allclose(bw, bw[0]):
        return np.full(P, 1.0 / P)
    lo, hi = 0.0, float(((n + coef) / bw).max())
    for _ in range(60):
        t = (lo + hi) / 2
        share = np.clip((t * bw - n) / coef, 0.0, None)
        lo, hi = (t, hi) if share.sum() < 1 else (lo, t)
    share = np.clip((hi * bw - n) / coef, 0.0, None)
    share /= share.sum()
    return np.repeat(share / n, n)


def place_replicated(access: TableAccess, tier: np.ndarray, home: np.ndarray, P: int) -> None:
    rows = by_falling_probability(access, tier != SINGLE)
    home[rows] = serpentine(rows.size, P)


def largest_first(load: np.ndarray, weights: np.ndarray, room: np.ndarray, node_of: np.ndarray) -> np.ndarray:
    """LPT in two levels: each row, largest first, to the node whose load relative to its weight
    is smallest (uplinks are the slow links), and there to the least-loaded device with room.
    A loop, so it is only run on the few hottest rows (at most HEAD_ROWS)."""
    nodes = int(node_of.max()) + 1
    node_weight = np.bincount(node_of, weights, minlength=nodes)
    devices = [[(0.0, d) for d in np.flatnonzero(node_of == a).tolist() if room[d] > 0] for a in range(nodes)]
    for heap in devices:
        heapq.heapify(heap)
    node_heap = [(0.0, a) for a in range(nodes) if devices[a]]
    heapq.heapify(node_heap)
    node_load = np.zeros(nodes)
    left = room.copy()
    device = np.empty(load.size, dtype=np.int64)
    for i, x in enumerate(load.tolist()):
        _, a = heapq.heappop(node_heap)
        total, d = heapq.heappop(devices[a])
        device[i] = d
        left[d] -= 1
        if left[d] > 0:
            heapq.heappush(devices[a], (total + x / weights[d], d))
        node_load[a] += x
        if devices[a]:
            heapq.heappush(node_heap, (node_load[a] / node_weight[a], a))
    return device


def water_level(base: np.ndarray, weights: np.ndarray, amount: float) -> np.ndarray:
    """Loads to add to `base` so that the devices below the level T·weight are raised to it."""
    lo, hi = 0.0, float(((base + amount) / weights).max())
    for _ in range(60):  # with nothing to add (most calls), no sum of raises is below it: only hi halves
        t = (lo + hi) / 2
        lo, hi = (t, hi) if amount > 0 and np.maximum(t * weights - base, 0).sum() < amount else (lo, t)
    return np.maximum(hi * weights - base, 0)


def place_single(
    access: TableAccess,
    tier: np.ndarray,
    home: np.ndarray,
    weights: np.ndarray,
    room: np.ndarray,
    x: np.ndarray,
    node_of: np.ndarray,
) -> None:
    """Home every single row of one table; `room` (rows free per device) is reduced in place."""
    classes = access.class_prob.size
    singles = np.zeros(classes, dtype=np.int64)
    for s in range(0, access.rows, CHUNK_ROWS):
        singles += np.bincount(
            access.row_class[s : s + CHUNK_ROWS][tier[s : s + CHUNK_ROWS] == SINGLE], minlength=classes
        )
    n = int(singles.sum())
    if n > room.sum():
        raise InputError(f"table '{access.name}': {n} single rows but room for {int(room.sum())}")
    if n == 0:
        return
    # Positions: single rows in order of falling load, class by class.
    order = access.class_order
    per_class = singles[order]
    starts = np.cumsum(per_class) - per_class
    device = _devices_of_positions(per_class, x[order], starts, weights, room, node_of)
    # Back from positions to rows: class start + rank among the class's single rows.
    replicated = access.class_rows - singles
    position_of_class = np.empty(classes, dtype=np.int64)
    position_of_class[order] = starts
    for s in range(0, access.rows, CHUNK_ROWS):
        single = tier[s : s + CHUNK_ROWS] == SINGLE
        c = access.row_class[s : s + CHUNK_ROWS][single]
        pos = position_of_class[c] + access.rank_in_class[s : s + CHUNK_ROWS][single] - replicated[c]
        home[s : s + CHUNK_ROWS][single] = device[pos]
    room -= np.bincount(device, minlength=room.size)


def _devices_of_positions(per_class: np.ndarray, unit: np.ndarray, starts: np.ndarray, weights: np.ndarray,
                          room: np.ndarray, node_of: np.ndarray) -> np.ndarray:
    """The device of every single row's position (`per_class` rows of load `unit` each, class by class in
    order of falling load): the hottest largest first, the warm ones filling each node and then each device
    up to a common level, the cold ones spread over the room left, none over a device's room."""
    P, n = room.size, int(per_class.sum())
    cum = np.cumsum(per_class * unit)
    last_hot = int(np.searchsorted(cum, 0.9999 * cum[-1]))
    hot = int(starts[last_hot] + per_class[last_hot])
    head = min(HEAD_ROWS, hot)
    head_load = unit[np.searchsorted(starts, np.arange(head), side="right") - 1]

    device = np.empty(n, dtype=np.int32)
    device[:head] = largest_first(head_load, weights, room, node_of)
    left = room - np.bincount(device[:head], minlength=P)
    # Warm rows may not take the room the cold rows need: stop where the rest just fills it.
    warm_end = max(head, min(hot, n - max(int(left.sum()) - (n - head), 0)))
    warm_load = float(cum[last_hot] - head_load.sum()) if warm_end > head else 0.0
    # Raise the nodes below the common level first, then the devices below it inside each node.
    nodes = int(node_of.max()) + 1
    node_weight = np.bincount(node_of, weights, minlength=nodes)
    node_deficit = water_level(np.bincount(node_of[device[:head]], head_load, minlength=nodes), node_weight, warm_load)
    device_load = np.bincount(device[:head], head_load, minlength=P)
    deficit = np.zeros(P)
    for a in range(nodes):
        inside = node_of == a
        deficit[inside] = water_level(device_load[inside], weights[inside], float(node_deficit[a]))
    if warm_end > head:
        device[head:warm_end] = interleave(
            shares(deficit + 1e-12 * deficit.sum() + 1e-300, warm_end - head), warm_end - head
        )
    taken = np.bincount(device[:warm_end], minlength=P)
    if warm_end < n:
        device[warm_end:] = interleave(shares(np.maximum(room - taken, 0) + 1e-9, n - warm_end), n - warm_end)
    # Move the coldest rows of any device over its room to devices with room to spare.
    count = np.bincount(device, minlength=P)
    spare = np.repeat(np.arange(P, dtype=np.int32), np.maximum(room - count, 0))
    used = 0
    for d in np.flatnonzero(count > room):
        movers = np.flatnonzero(device == d)[room[d] :]
        device[movers] = spare[used : used + movers.size]
        used += movers.size
    return device


def place(
    accesses: list[TableAccess], tiers: list[np.ndarray], topology: Topology, budget_rows: int, model: CostModel,
    copies: bool = True,
) -> list[TablePlan]:
    """Homes for `tiers` under budget_rows per device: replicated rows dealt round-robin, single rows by
    load, refine's moves and swaps, then (with `copies`) the copy pass choosing which nodes hold the
    hottest rows (copies.py)."""
    P = topology.devices
    homes = [np.zeros(a.rows, dtype=np.int32) for a in accesses]
    room = np.full(P, budget_rows, dtype=np.int64)
    for acc, tier, home in zip(accesses, tiers, homes, strict=True):
        place_replicated(acc, tier, home, P)
        room -= int(np.count_nonzero(tier == GLOBAL))
        node_homes = home[tier == NODE].astype(np.int64)
        for a in range(len(topology.nodes)):
            room -= np.bincount(replica_device(node_homes, topology, a), minlength=P)
    weights = np.maximum(uplink_weights(topology, model), 1e-9)
    for acc, tier, home in zip(accesses, tiers, homes, strict=True):
        place_single(acc, tier, home, weights, room, model.rates(acc).x, topology.node_of_device)
    tables = [TablePlan(a.name, t, h) for a, t, h in zip(accesses, tiers, homes, strict=True)]
    seconds, room = refine(tables, accesses, budget_rows, model)
    return choose_copies(tables, accesses, model, seconds, room) if copies else tables


