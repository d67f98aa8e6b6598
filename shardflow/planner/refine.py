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
base + Σ_h W_h·L(h), and the modeled time is the busiest link's seconds. With scope
node a row adds its trainers' reads (q, to the home or to their node's proxy) and each
other node's one fetch (q_node of that node) through vectors per home of their own
(relayed_unit_loads); the search below is the same. Placement by
classes deals load by water levels; on a few lumpy rows or uneven uplinks that can miss
the best split. This pass takes the hottest REFINE_ROWS single rows and, while it helps,
applies the best single move (to a device with room) or swap (of two rows on different
devices), exactly under the cost model.
"""

from __future__ import annotations

import numpy as np

from shardflow.planner.access import CHUNK_ROWS, TableAccess
from shardflow.planner.costmodel import CostModel, bandwidths, link_seconds
from shardflow.planner.sharding_plan import (
    ID_BYTES,
    SINGLE,
    VALUE_BYTES,
    ShardingPlan,
    TablePlan,
    table_rows_per_device,
)
from shardflow.planner.topology import Topology

REFINE_ROWS = 256  # hottest single rows the pass may move
SWAP_ROWS = 64  # the hottest of them that may also swap homes
REFINE_STEPS = 400  # moves and swaps at most


def _single_row_parts(topology: Topology, dim: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Bytes a single row homed on each device adds to the links (costmodel.py's rules), in three parts:
    ([P, links] per unit of each trainer's reads, served inside the home's node by the home;
    [P, links] the same, inside every other node by that node's proxy for the home (replica_device);
    [P, N, links] per unit of node A's reads crossing its uplink and the home's: one fetch).
    Links ordered [intra out per device, intra in per device, uplink out per node, uplink in per node]."""
    P, N = topology.devices, len(topology.nodes)
    a, v = ID_BYTES, VALUE_BYTES * dim
    node, n, start = topology.node_of_device, topology.node_devices, topology.node_start
    own, proxied = np.zeros((P, 2 * P + 2 * N)), np.zeros((P, 2 * P + 2 * N))
    fetch = np.zeros((P, N, 2 * P + 2 * N))
    for h in range(P):
        H = node[h]
        for A in range(N):
            server = h if A == H else int(start[A] + (h - start[H]) % n[A])  # the home, or A's proxy
            part = own if A == H else proxied
            readers = (node == A) & (np.arange(P) != server)
            part[h, :P][readers] += 2 * a + v
            part[h, P : 2 * P][readers] += v
            part[h, server] += (n[A] - 1) * v
            part[h, P + server] += (n[A] - 1) * (2 * a + v)
            if A != H:
                fetch[h, A, 2 * P + A] += 2 * a + v
                fetch[h, A, 2 * P + N + A] += v
                fetch[h, A, 2 * P + H] += v
                fetch[h, A, 2 * P + N + H] += 2 * a + v
    return own, proxied, fetch


def unit_loads(topology: Topology, dim: int) -> np.ndarray:
    """[P, links]: the bytes one unit of single-row load homed on each device adds to every link, with
    scopes none and device: the home's node reads it inside, every other node's trainers each over
    their uplink."""
    own, _, fetch = _single_row_parts(topology, dim)
    return own + np.einsum("pnl,n->pl", fetch, topology.node_devices.astype(np.float64))


def relayed_unit_loads(topology: Topology, dim: int) -> tuple[np.ndarray, np.ndarray]:
    """Scope node: ([P, links] bytes per unit of a trainer's reads of a single row homed on each device,
    [P, N, links] bytes per unit of node A's one fetch of it). A trainer reads a row of its own node from
    the home and one of another node from its node's proxy (replica_device), which fetches it once."""
    own, proxied, fetch = _single_row_parts(topology, dim)
    return own + proxied, fetch


def hottest_rows(tier: np.ndarray, row_class: np.ndarray, x: np.ndarray, k: int,
                 tiers: tuple[int, ...] = (SINGLE,)) -> np.ndarray:
    """Ids of the (at most) k rows of most load x[class] among those of `tiers` (single rows unless told),
    most first, ties by id. Two passes a chunk at a time: count those rows per class, which gives the k-th
    load; then take the rows above it and the first tied ones (a 10^8-row table is never sorted or copied
    whole)."""
    wanted = np.zeros(3, dtype=bool)
    wanted[list(tiers)] = True
    counts = np.zeros(x.size, dtype=np.int64)
    for s in range(0, tier.size, CHUNK_ROWS):
        cls = row_class[s : s + CHUNK_ROWS][wanted[tier[s : s + CHUNK_ROWS]]]
        counts += np.bincount(cls, minlength=x.size)
    k = min(k, int(counts.sum()))
    if k == 0:
        return np.zeros(0, dtype=np.int64)
    order = np.argsort(-x, kind="stable")
    cut = x[order[int(np.searchsorted(np.cumsum(counts[order]), k))]]  # the k-th largest load
    above, tied = x > cut, x == cut
    ties_left = k - int(counts[above].sum())
    ids = []
    for s in range(0, tier.size, CHUNK_ROWS):
        cls = row_class[s : s + CHUNK_ROWS]
        single = wanted[tier[s : s + CHUNK_ROWS]]
        ids.append(np.flatnonzero(single & above[cls]) + s)
        if ties_left:
            first = np.flatnonzero(single & tied[cls])[:ties_left] + s
            ids.append(first)
            ties_left -= first.size
    found = np.concatenate(ids)
    return found[np.lexsort((found, -x[row_class[found]]))]


def single_row_seconds(model: CostModel, x: np.ndarray, q: np.ndarray, q_node: np.ndarray) -> np.ndarray:
    """[K, P, links]: the seconds each candidate row (rates x, q [K], q_node [K, N]) adds to every link as a
    single row homed on each device (the unit vectors, scaled by the row's rates)."""
    topo, bw = model.topology, bandwidths(model.topology)
    if model.shape.dedup == "node" and len(topo.nodes) > 1:
        per_read, per_fetch = relayed_unit_loads(topo, model.shape.dim)
        return (q[:, None, None] * per_read[None] + np.einsum("kn,pnl->kpl", q_node, per_fetch)) / bw
    return x[:, None, None] * (unit_loads(topo, model.shape.dim) / bw)[None]


def refine(tables: list[TablePlan], accesses: list[TableAccess], budget_rows: int,
           model: CostModel) -> tuple[np.ndarray, np.ndarray]:
    """Improve the homes of the hottest single rows of `tables` in place (see the module's doc); (the seconds
    the plan then puts on every link, the rows of room left on every device)."""
    topo = model.topology
    by_name = {a.name: a for a in accesses}
    cost = model.evaluate(ShardingPlan("refine", tuple(tables)), by_name)
    seconds = link_seconds(cost.lookup_pairs + cost.sync_pairs, topo)
    room = budget_rows - np.sum([table_rows_per_device(t, topo) for t in tables], axis=0)
    # The hottest single rows of all tables: (table index, row, load).
    candidates = []
    for i, t in enumerate(tables):
        a = by_name[t.name]
        x = model.rates(a).x
        top = hottest_rows(t.tier, a.row_class, x, REFINE_ROWS)
        candidates += [(i, int(r), float(x[a.row_class[r]])) for r in top]
    candidates = sorted(candidates, key=lambda c: -c[2])[:REFINE_ROWS]
    if not candidates:
        return seconds, room
    table_of = np.array([c[0] for c in candidates])
    row = np.array([c[1] for c in candidates])
    home = np.array([int(tables[i].home[r]) for i, r in zip(table_of, row, strict=True)])
    rates = {name: model.rates(by_name[name]) for name in {tables[i].name for i in table_of}}
    of = [(rates[tables[i].name], by_name[tables[i].name].row_class[r]) for i, r in zip(table_of, row, strict=True)]
    vec = single_row_seconds(model, np.array([c[2] for c in candidates]), np.array([r.q[c] for r, c in of]),
                             np.array([r.q_node[:, c] for r, c in of]))  # vec[k, e]: row k homed on e
    seconds = _moves_and_swaps(vec, home, seconds, room)
    for i, r, h in zip(table_of, row, home, strict=True):
        tables[i].home[r] = h
    return seconds, room


def _moves_and_swaps(vec: np.ndarray, home: np.ndarray, seconds: np.ndarray, room: np.ndarray) -> np.ndarray:
    """While it lowers the busiest link, the best move of a row (to a device with room) or swap of two of
    the hottest SWAP_ROWS (on different devices), at most REFINE_STEPS; `home` and `room` change in place;
    the links' seconds after. Ties go to the first move (row, then device) and the first swap in that order."""
    K = home.size
    own = vec[np.arange(K), home]  # [K, links]
    S = min(SWAP_ROWS, K)
    for _ in range(REFINE_STEPS):
        busiest = int(np.argmax(seconds))
        now = seconds[busiest]
        best, k, e = _best_move(vec, own, home, seconds, room, busiest)
        swapped, k2, j2 = _best_swap(vec[:S], own[:S], home[:S], seconds, busiest)
        if min(best, swapped) >= now * (1 - 1e-9):
            break
        if swapped < best:
            seconds = seconds + vec[k2, home[j2]] - own[k2] + vec[j2, home[k2]] - own[j2]
            home[k2], home[j2] = home[j2], home[k2]
            own[k2], own[j2] = vec[k2, home[k2]], vec[j2, home[j2]]
        else:
            seconds = seconds + vec[k, e] - own[k]
            room[home[k]] += 1
            room[e] -= 1
            home[k], own[k] = e, vec[k, e]
    return seconds


def _best_move(vec: np.ndarray, own: np.ndarray, home: np.ndarray, seconds: np.ndarray, room: np.ndarray,
               busiest: int) -> tuple[float, int, int]:
    """(the busiest link's seconds after the best move of row k to device e, k, e); inf if none lowers it.

    A move that does not lower the busiest link leaves the maximum at least where it is, so only those
    that do are priced on every link: the same choice as pricing all, at a fraction of the work."""
    at_busiest = seconds[busiest] + vec[:, :, busiest] - own[:, busiest, None]  # [K, devices]
    lowers = (at_busiest < seconds[busiest]) & (room > 0)[None, :]
    lowers[np.arange(home.size), home] = False
    ks, es = np.nonzero(lowers)  # in row-major order, as argmin over the whole [K, devices] would scan
    if ks.size == 0:
        return np.inf, -1, -1
    moved = (seconds[None, :] + vec[ks, es] - own[ks]).max(axis=1)
    i = int(np.argmin(moved))
    return float(moved[i]), int(ks[i]), int(es[i])


def _best_swap(vec: np.ndarray, own: np.ndarray, home: np.ndarray, seconds: np.ndarray,
               busiest: int) -> tuple[float, int, int]:
    """(the busiest link's seconds after the best swap of rows k and j on different devices, k, j); inf if
    no swap lowers the busiest link (as in _best_move)."""
    at_other = vec[:, home, busiest]  # [k, j]: row k homed where row j is, on the busiest link
    at_busiest = seconds[busiest] + (at_other - own[:, None, busiest] + at_other.T - own[None, :, busiest])
    lowers = (at_busiest < seconds[busiest]) & (home[:, None] != home[None, :])
    ks, js = np.nonzero(lowers)
    if ks.size == 0:
        return np.inf, -1, -1
    change = vec[ks, home[js]] - own[ks] + vec[js, home[ks]] - own[js]
    swapped = (seconds[None, :] + change).max(axis=1)
    i = int(np.argmin(swapped))
    return float(swapped[i]), int(ks[i]), int(js[i])


def table_home_seconds(accesses: list[TableAccess], model: CostModel) -> np.ndarray:
    """[T, P, links]: the seconds a whole table homed (every row single) on each device adds to every link,
    the sum of its rows' vectors above: additive, so placing whole tables is priced exactly."""
    topo = model.topology
    bw = bandwidths(topo)
    out = []
    for a in accesses:
        r = model.rates(a)
        if model.shape.dedup == "node" and len(topo.nodes) > 1:
            per_read, per_fetch = relayed_unit_loads(topo, model.shape.dim)
            q, q_node = float(a.class_rows @ r.q), r.q_node @ a.class_rows  # [N]
            out.append((q * per_read + np.einsum("n,pnl->pl", q_node, per_fetch)) / bw)
        else:
            out.append(float(a.class_rows @ r.x) * unit_loads(topo, model.shape.dim) / bw)
    return np.array(out)


def pack_tables(vec: np.ndarray, rows: np.ndarray, budget_rows: int) -> np.ndarray | None:
    """Homes of whole tables (vec: table_home_seconds, rows: their sizes) that fit budget_rows per device
    and keep the busiest link's seconds low; None if no packing is found.

    Tables go heaviest first, each to the device with room where the busiest link ends up least busy
    (largest first by rows if that leaves a table without room); then the best single move or swap
    of two tables is applied while it lowers the busiest link.
    """
    T, P, _ = vec.shape
    weight = vec.max(axis=(1, 2))
    for order in (np.argsort(-weight, kind="stable"), np.argsort(-rows, kind="stable")):
        home, seconds, room = np.full(T, -1), np.zeros(vec.shape[2]), np.full(P, budget_rows, dtype=np.int64)
        for t in order.tolist():
            fits = np.flatnonzero(room >= rows[t])
            if not fits.size:
                break
            d = int(fits[np.argmin((seconds[None, :] + vec[t, fits]).max(axis=1))])
            home[t], seconds, room[d] = d, seconds + vec[t, d], room[d] - rows[t]
        if (home >= 0).all():
            break
    else:
        return None
    for _ in range(REFINE_STEPS):
        now = seconds.max()
        own = vec[np.arange(T), home]
        moved = (seconds[None, None, :] + vec - own[:, None, :]).max(axis=2)
        moved[room[None, :] < rows[:, None]] = np.inf
        moved[np.arange(T), home] = np.inf
        k, e = np.unravel_index(np.argmin(moved), moved.shape)
        at_other = vec[:, home, :]  # [k, j]: table k homed where table j is
        swapped = (seconds[None, None, :] + at_other - own[:, None, :] + at_other.transpose(1, 0, 2)
                   - own[None, :, :]).max(axis=2)
        free = room[home]  # room left where each table is homed
        fits = (free[None, :] + rows[None, :] >= rows[:, None]) & (free[:, None] + rows[:, None] >= rows[None, :])
        swapped[~fits | (home[:, None] == home[None, :])] = np.inf
        k2, j2 = np.unravel_index(np.argmin(swapped), swapped.shape)
        if min(moved[k, e], swapped[k2, j2]) >= now * (1 - 1e-9):
            break
        if moved[k, e] <= swapped[k2, j2]:
            seconds = seconds + vec[k, e] - own[k]
            room[home[k]] += rows[k]
            room[e] -= rows[k]
            home[k] = e
        else:
            hk, hj = home[k2], home[j2]
            seconds = seconds + vec[k2, hj] - own[k2] + vec[j2, hk] - own[j2]
            room[hk] += rows[k2] - rows[j2]
            room[hj] += rows[j2] - rows[k2]
            home[k2], home[j2] = hj, hk
    return home
