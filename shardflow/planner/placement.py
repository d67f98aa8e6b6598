"""Where rows live: tiers from per-class counts, homes for replicated and single rows.

Replicated rows are homed round-robin in order of falling access probability, so
every device leads about the same share of sync. Single rows are dealt out in order of
falling load: the hottest ones by weights that give a node with a slow uplink less of
the traffic (water-filling on the uplinks' bytes), the rest round-robin, and rows a
device has no room for move to devices that have.
"""

from __future__ import annotations

import heapq

import numpy as np

from shardflow.errors import InputError
from shardflow.planner.access import TableAccess
from shardflow.planner.costmodel import CostModel
from shardflow.planner.plan import GLOBAL, NODE, SINGLE, TablePlan, replica_device
from shardflow.planner.topology import Topology

HEAD_ROWS = 1 << 15  # hottest single rows placed one by one (LPT); the rest are dealt vectorised


def tiers_from_counts(access: TableAccess, global_rows: np.ndarray, node_rows: np.ndarray) -> np.ndarray:
    """Per row: the first global_rows[c] rows (by id) of class c are global, the next node_rows[c] node."""
    order = np.argsort(access.row_class, kind="stable")
    starts = np.concatenate([[0], np.cumsum(access.class_rows)[:-1]])
    rank = np.empty(access.rows, dtype=np.int64)
    rank[order] = np.arange(access.rows) - starts[access.row_class[order]]
    g = global_rows[access.row_class]
    return np.where(rank < g, GLOBAL, np.where(rank < g + node_rows[access.row_class], NODE, SINGLE)).astype(np.int8)


def by_falling_probability(access: TableAccess, mask: np.ndarray) -> np.ndarray:
    """Row ids where `mask` holds, most-read first (ties by id)."""
    rows = np.flatnonzero(mask)
    class_rank = np.empty(access.class_prob.size, dtype=np.int32)
    class_rank[np.argsort(-access.class_prob, kind="stable")] = np.arange(access.class_prob.size)
    return rows[np.argsort(class_rank[access.row_class[rows]], kind="stable")]


def serpentine(n: int, P: int) -> np.ndarray:
    """0, 1, ..., P-1, P-1, ..., 0, 0, 1, ...: dealing rows of falling load this way evens the sums."""
    i = np.arange(n, dtype=np.int64)
    lap, pos = np.divmod(i, P)
    return np.where(lap % 2 == 0, pos, P - 1 - pos)


def strided(weights: np.ndarray, n: int) -> np.ndarray:
    """A sequence of n devices where device d appears about n·weights[d] times, evenly spread
    (stride scheduling: the k-th turn of device d comes at (k + 1/2) / weight)."""
    weights = np.asarray(weights, dtype=np.float64) / np.sum(weights)
    per = np.ceil(weights * n).astype(np.int64) + 1
    device = np.repeat(np.arange(weights.size), per)
    k = np.arange(device.size) - np.repeat(np.cumsum(per) - per, per)
    with np.errstate(divide="ignore"):
        finish = (k + 0.5) / weights[device]
    return device[np.argsort(finish, kind="stable")[:n]]


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
    for _ in range(60):
        t = (lo + hi) / 2
        lo, hi = (t, hi) if np.maximum(t * weights - base, 0).sum() < amount else (lo, t)
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
    """Home every single row of one table; `room` (rows free per device) is reduced in place.

    Rows in order of falling load: the hottest HEAD_ROWS by LPT; then warm rows (up to 99%
    of the load) spread by stride scheduling over the devices still below the common
    water level; then the cold rest fills each device's remaining room.
    """
    P = room.size
    rows = by_falling_probability(access, tier == SINGLE)
    if rows.size > room.sum():
        raise InputError(f"table '{access.name}': {rows.size} single rows but room for {int(room.sum())}")
    if rows.size == 0:
        return
    load = x[access.row_class[rows]]
    cum = np.cumsum(load)
    hot = min(int(np.searchsorted(cum, 0.99 * cum[-1])) + 1, rows.size)
    head = min(HEAD_ROWS, hot)
    device = np.empty(rows.size, dtype=np.int64)
    device[:head] = largest_first(load[:head], weights, room, node_of)
    left = room - np.bincount(device[:head], minlength=P)
    # Warm rows may not take the room the cold rows need: stop where the rest just fills it.
    warm_end = max(head, min(hot, rows.size - max(int(left.sum()) - (rows.size - head), 0)))
    # Raise the nodes below the common level first, then share each node's part by weight.
    nodes = int(node_of.max()) + 1
    node_weight = np.bincount(node_of, weights, minlength=nodes)
    node_load = np.bincount(node_of[device[:head]], load[:head], minlength=nodes)
    node_deficit = water_level(node_load, node_weight, float(load[head:warm_end].sum()))
    deficit = node_deficit[node_of] * weights / node_weight[node_of]
    if warm_end > head and deficit.sum() > 0:
        device[head:warm_end] = strided(np.minimum(deficit, deficit.sum()) + 1e-12 * deficit.sum(), warm_end - head)
    else:
        device[head:warm_end] = serpentine(warm_end - head, P)
    taken = np.bincount(device[:warm_end], minlength=P)
    device[warm_end:] = strided(np.maximum(room - taken, 0) + 1e-9, rows.size - warm_end)
    # Move the coldest rows of any device over its room to devices with room to spare.
    count = np.bincount(device, minlength=P)
    excess = np.maximum(count - room, 0)
    if excess.any():
        rank = np.empty(rows.size, dtype=np.int64)
        order = np.argsort(device, kind="stable")
        rank[order] = np.arange(rows.size) - np.repeat(np.cumsum(count) - count, count)
        movers = np.flatnonzero(rank >= (count - excess)[device])
        spare = np.maximum(room - count, 0)
        device[movers] = np.repeat(np.arange(P), spare)[: movers.size]
    home[rows] = device
    room -= np.bincount(device, minlength=P)


def place(
    accesses: list[TableAccess], tiers: list[np.ndarray], topology: Topology, budget_rows: int, model: CostModel
) -> list[TablePlan]:
    P = topology.devices
    homes = [np.zeros(a.rows, dtype=np.int32) for a in accesses]
    room = np.full(P, budget_rows, dtype=np.int64)
    for acc, tier, home in zip(accesses, tiers, homes):
        place_replicated(acc, tier, home, P)
        room -= int(np.count_nonzero(tier == GLOBAL))
        node_homes = home[tier == NODE].astype(np.int64)
        for a in range(len(topology.nodes)):
            room -= np.bincount(replica_device(node_homes, topology, a), minlength=P)
    weights = np.maximum(uplink_weights(topology, model), 1e-9)
    for acc, tier, home in zip(accesses, tiers, homes):
        place_single(acc, tier, home, weights, room, model.rates(acc).x, topology.node_of_device)
    return [TablePlan(a.name, t, h) for a, t, h in zip(accesses, tiers, homes)]


