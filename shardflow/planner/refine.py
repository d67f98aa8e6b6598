"""The last pass of placement: moves and swaps of the hottest single rows that lower the modeled time.

A single row with remote-read load x homed on device h adds x times a fixed vector L(h)
to the links (costmodel.py: every other trainer sends it (2·id + 4·dim) bytes a unit,
h sends each 4·dim back):

    intra out   h: (n_H - 1)·v        i in H, i != h: (2a + v)
    intra in    h: (n_H - 1)·(2a + v) i in H, i != h: v
    uplink out  H: (P - n_H)·v        A != H: n_A·(2a + v)
    uplink in   H: (P - n_H)·(2a + v) A != H: n_A·v

(a = id bytes, v = 4·dim, H the node of h, n_A devices in node A). So the single rows
reach the links only through the load homed on each device, W_h: the links carry
base + Σ_h W_h·L(h), and the modeled time is the busiest link's seconds. Placement by
classes deals load by water levels; on a few lumpy rows or uneven uplinks that can miss
the best split. This pass takes the hottest REFINE_ROWS single rows and, while it helps,
applies the best single move (to a device with room) or swap (of two rows on different
devices), exactly under the cost model.
"""

from __future__ import annotations

import numpy as np

from shardflow.planner.access import TableAccess
from shardflow.planner.costmodel import CostModel
from shardflow.planner.plan import ID_BYTES, SINGLE, VALUE_BYTES, ShardingPlan, TablePlan, table_rows_per_device
from shardflow.planner.topology import Topology

REFINE_ROWS = 256  # hottest single rows the pass may move
SWAP_ROWS = 64  # the hottest of them that may also swap homes
REFINE_STEPS = 400  # moves and swaps at most


def unit_loads(topology: Topology, dim: int) -> np.ndarray:
    """[P, links]: the bytes one unit of single-row load homed on each device adds to every link,
    links ordered [intra out per device, intra in per device, uplink out per node, uplink in per node]."""
    P, N = topology.devices, len(topology.nodes)
    a, v = ID_BYTES, VALUE_BYTES * dim
    node, n = topology.node_of_device, topology.node_devices
    L = np.zeros((P, 2 * P + 2 * N))
    for h in range(P):
        H = node[h]
        peers = (node == H) & (np.arange(P) != h)
        L[h, :P][peers] = 2 * a + v
        L[h, h] = (n[H] - 1) * v
        L[h, P : 2 * P][peers] = v
        L[h, P + h] = (n[H] - 1) * (2 * a + v)
        L[h, 2 * P : 2 * P + N] = n * (2 * a + v)
        L[h, 2 * P + H] = (P - n[H]) * v
        L[h, 2 * P + N :] = n * v
        L[h, 2 * P + N + H] = (P - n[H]) * (2 * a + v)
    return L


def link_seconds(pairs: np.ndarray, topology: Topology) -> np.ndarray:
    """The links' bytes of a [P, P] byte matrix, in unit_loads' order, over their bandwidths."""
    same = topology.node_of_device[:, None] == topology.node_of_device[None, :]
    intra, inter = pairs * same, pairs * ~same
    starts = topology.node_start
    loads = np.concatenate([intra.sum(axis=1), intra.sum(axis=0), np.add.reduceat(inter.sum(axis=1), starts),
                            np.add.reduceat(inter.sum(axis=0), starts)])
    return loads / bandwidths(topology)


def bandwidths(topology: Topology) -> np.ndarray:
    P = topology.devices
    return np.concatenate([np.full(2 * P, topology.intra_bytes_per_s), topology.uplink_bytes_per_s,
                           topology.uplink_bytes_per_s])


def refine(tables: list[TablePlan], accesses: list[TableAccess], budget_rows: int, model: CostModel) -> None:
    """Improve the homes of the hottest single rows of `tables` in place (see the module's doc)."""
    topo = model.topology
    by_name = {a.name: a for a in accesses}
    cost = model.evaluate(ShardingPlan("refine", tuple(tables)), by_name)
    unit = unit_loads(topo, model.shape.dim) / bandwidths(topo)  # seconds per unit of load, per home
    seconds = link_seconds(cost.lookup_pairs + cost.sync_pairs, topo)
    # The hottest single rows of all tables: (table index, row, load).
    candidates = []
    for i, t in enumerate(tables):
        a = by_name[t.name]
        x = model.rates(a).x
        single = np.flatnonzero(t.tier == SINGLE)
        if single.size == 0:
            continue
        load = x[a.row_class[single]]
        top = single[np.argsort(-load, kind="stable")[:REFINE_ROWS]]
        candidates += [(i, int(r), float(x[a.row_class[r]])) for r in top]
    candidates = sorted(candidates, key=lambda c: -c[2])[:REFINE_ROWS]
    if not candidates:
        return
    table_of = np.array([c[0] for c in candidates])
    row = np.array([c[1] for c in candidates])
    load = np.array([c[2] for c in candidates])
    home = np.array([int(tables[i].home[r]) for i, r in zip(table_of, row)])
    room = budget_rows - sum(table_rows_per_device(t, topo) for t in tables)
    for _ in range(REFINE_STEPS):
        now = seconds.max()
        # moves: row k from home[k] to e (where e has room)
        delta = load[:, None, None] * (unit[None, :, :] - unit[home][:, None, :])  # [K, P, links]
        moved = (seconds[None, None, :] + delta).max(axis=2)
        moved[:, room <= 0] = np.inf
        moved[np.arange(home.size), home] = np.inf
        k, e = np.unravel_index(np.argmin(moved), moved.shape)
        best, kind = moved[k, e], ("move", int(k), int(e))
        # swaps: rows k and j on different devices exchange homes
        s_load, s_home = load[:SWAP_ROWS], home[:SWAP_ROWS]
        diff = unit[s_home]  # [K, links]
        change = (s_load[:, None, None] - s_load[None, :, None]) * (diff[None, :, :] - diff[:, None, :])
        swapped = (seconds[None, None, :] + change).max(axis=2)
        swapped[s_home[:, None] == s_home[None, :]] = np.inf
        k2, j2 = np.unravel_index(np.argmin(swapped), swapped.shape)
        if swapped[k2, j2] < best:
            best, kind = swapped[k2, j2], ("swap", int(k2), int(j2))
        if best >= now * (1 - 1e-9):
            break
        if kind[0] == "move":
            _, k, e = kind
            seconds = seconds + load[k] * (unit[e] - unit[home[k]])
            room[home[k]] += 1
            room[e] -= 1
            home[k] = e
        else:
            _, k, j = kind
            seconds = seconds + (load[k] - load[j]) * (unit[home[j]] - unit[home[k]])
            home[k], home[j] = home[j], home[k]
    for i, r, h in zip(table_of, row, home):
        tables[i].home[r] = h

