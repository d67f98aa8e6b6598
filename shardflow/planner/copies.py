"""The pass that chooses, row by row, which nodes hold a copy of the hottest rows.

A row's cost splits by node (costmodel.py): node A either holds a copy (its trainers
read it inside the node, and the copy syncs with the home: a partial sum up, the total
down) or it does not (its trainers read it from the home over A's uplink, or through
A's proxy with scope node). Only the home's node must hold it. So for a row of class c
homed on h, the seconds it puts on the links are

    L(nodes) = L(single on h) + Σ_{A in nodes, A != H} D_A(c, h)

with D_A what a copy in A adds (the sync) less what it saves (the reads): a vector per
node, linear in the row's rates by the cost model's rules (copy_unit_seconds; checked
against costmodel.row_link_bytes). A copy in A takes one row of room on
replica_device(h, A).

The pass takes the hottest COPY_ROWS single and node rows and, while it lowers the
busiest link, applies the best single change: a copy added on a node with room, or
dropped. When no such change helps, it tries the best trade on a full device: one row's
copy there dropped for another's, or a single row moved off it (refine's vectors price
the move) to make room for a copy. A slow node thus gets copies of the rows its trainers
read most, while fast nodes need not spend memory or sync on them; a row left on its
home's node alone is single again, one on every node is a plain node row.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from shardflow.planner.access import TableAccess
from shardflow.planner.costmodel import CostModel, bandwidths
from shardflow.planner.refine import hottest_rows, single_row_seconds
from shardflow.planner.sharding_plan import (
    ID_BYTES,
    NODE,
    SINGLE,
    VALUE_BYTES,
    TablePlan,
    exchanges_partials,
    replica_device,
)

COPY_ROWS = 256  # hottest single and node rows whose copies the pass may change
COPY_STEPS = 400  # changes at most
TRADE_ROWS = 64  # the hottest of them that may move to make room for a copy


def copy_unit_seconds(model: CostModel) -> np.ndarray:
    """[4, P, N, links]: the seconds a copy in node A adds to a row homed on device h, per unit of each of the
    row's rates: x (a trainer's remote reads), q_A (node A reads it), q_any (anyone reads it), q_H (h's node
    reads it); zero for A = h's node, which always holds it. By costmodel.py's rules (link_bytes' order of
    links): A's trainers read the row from the copy p = replica_device(h, A) if A holds one, and p syncs with
    the home (a partial sum up, q_A; the total down, q_any, or on two nodes the home's node's partial sum,
    q_H); if not, they read it from the home over both uplinks (x each), or with scope node through p, which
    fetches it once for the node (q_A)."""
    topo, P, N = model.topology, model.topology.devices, len(model.topology.nodes)
    a, v = ID_BYTES, VALUE_BYTES * model.shape.dim
    read, msg = 2 * a + v, a + v  # a remote read: id in, row out, id and gradient in; a sync message
    H = topo.node_of_device  # [P]: each home's node
    nodes = np.arange(N)
    out = np.zeros((4, P, N, 2 * P + 2 * N))
    up_out, up_in = 2 * P + nodes, 2 * P + N + nodes  # link index of each node's uplink, out and in
    # q_A: the copy's partial sum, A -> home's node; with scope node, less the fetch it replaces.
    out[1, :, nodes, up_out[nodes]] += msg
    out[1, np.arange(P)[:, None], nodes[None, :], (2 * P + N + H)[:, None]] += msg
    # Back to A: the total (q_any), or on two nodes the home's node's partial sum (q_H).
    back = 3 if exchanges_partials(topo) else 2
    out[back, np.arange(P)[:, None], nodes[None, :], (2 * P + H)[:, None]] += msg
    out[back, :, nodes, up_in[nodes]] += msg
    n = topo.node_devices.astype(np.float64)
    if model.shape.dedup == "node":
        out[1, :, nodes, up_out[nodes]] -= read
        out[1, np.arange(P)[:, None], nodes[None, :], (2 * P + N + H)[:, None]] -= read
        out[1, np.arange(P)[:, None], nodes[None, :], (2 * P + H)[:, None]] -= v
        out[1, :, nodes, up_in[nodes]] -= v
    else:
        # x: inside A, its other trainers read from p (intra ports); no longer over the uplinks from the home.
        for A in range(N):
            p = replica_device(np.arange(P), topo, A)  # [P]: the copy's device for each home
            inside = np.flatnonzero(H == A)
            out[0, :, A, inside] += read  # each of A's trainers sends ...
            out[0, np.arange(P), A, p] -= read  # ... but p itself reads locally
            out[0, np.arange(P), A, p] += (n[A] - 1) * v  # p answers the others
            out[0, :, A, P + inside] += v
            out[0, np.arange(P), A, P + p] -= v
            out[0, np.arange(P), A, P + p] += (n[A] - 1) * read
        out[0, :, nodes, up_out[nodes]] -= (n * read)[:, None]
        out[0, np.arange(P)[:, None], nodes[None, :], (2 * P + N + H)[:, None]] -= (n * read)[None, :]
        out[0, np.arange(P)[:, None], nodes[None, :], (2 * P + H)[:, None]] -= (n * v)[None, :]
        out[0, :, nodes, up_in[nodes]] -= (n * v)[:, None]
    out[:, np.arange(P), H] = 0.0  # the home's own node always holds it
    return out / bandwidths(topo)


@dataclass
class _Candidates:
    """The hottest single and node rows the pass may copy ([K] each, hottest first): their table, row, home
    and its node, the nodes holding a copy ([K, N]) and their rates by the cost model."""

    table_of: np.ndarray
    row: np.ndarray
    home: np.ndarray
    own: np.ndarray
    holds: np.ndarray
    x: np.ndarray
    q: np.ndarray
    q_node: np.ndarray  # [K, N]
    q_any: np.ndarray

    def deltas(self, k: np.ndarray, units: np.ndarray) -> np.ndarray:
        """[len(k), N, links]: what a copy in each node adds to each candidate of `k`, homed where it is now."""
        home, at = self.home[k], (slice(None), None, None)
        return (self.x[k][at] * units[0, home] + self.q_node[k][:, :, None] * units[1, home]
                + self.q_any[k][at] * units[2, home] + self.q_node[k, self.own[k]][at] * units[3, home])


def _candidates(tables: list[TablePlan], accesses: list[TableAccess], model: CostModel) -> _Candidates | None:
    """The COPY_ROWS hottest single and node rows of all tables, with the nodes that hold them now."""
    topo, N = model.topology, len(model.topology.nodes)
    by_name = {a.name: a for a in accesses}
    rates = {t.name: model.rates(by_name[t.name]) for t in tables}
    found = []
    for i, t in enumerate(tables):
        a = by_name[t.name]
        top = hottest_rows(t.tier, a.row_class, rates[t.name].x, COPY_ROWS, tiers=(SINGLE, NODE))
        found += [(i, int(r), float(rates[t.name].x[a.row_class[r]])) for r in top]
    found = sorted(found, key=lambda c: -c[2])[:COPY_ROWS]
    if not found:
        return None
    table_of = np.array([c[0] for c in found])
    row = np.array([c[1] for c in found])
    home = np.array([int(tables[i].home[r]) for i, r in zip(table_of, row, strict=True)], dtype=np.int64)
    own = topo.node_of_device[home]
    holds = np.zeros((len(found), N), dtype=bool)
    holds[np.arange(len(found)), own] = True
    for i, t in enumerate(tables):
        mine = np.flatnonzero(table_of == i)
        node_rows = mine[t.tier[row[mine]] == NODE]
        for node in range(N):
            holds[node_rows, node] = t.node_holds(row[node_rows], node)
    of = [(rates[tables[i].name], by_name[tables[i].name].row_class[r]) for i, r in zip(table_of, row, strict=True)]
    return _Candidates(table_of, row, home, own, holds, x=np.array([r.x[c] for r, c in of]),
                       q=np.array([r.q[c] for r, c in of]), q_node=np.array([r.q_node[:, c] for r, c in of]),
                       q_any=np.array([r.q_any[c] for r, c in of]))


def choose_copies(tables: list[TablePlan], accesses: list[TableAccess], model: CostModel, seconds: np.ndarray,
                  room: np.ndarray) -> list[TablePlan]:
    """`tables` with the copies of their hottest rows chosen node by node (see the module's doc); `seconds`
    is what the plan puts on every link now (costmodel.link_seconds), `room` the rows each device has left."""
    if len(model.topology.nodes) < 2:
        return tables
    c = _candidates(tables, accesses, model)
    if c is None:
        return tables
    _search(c, model, seconds, room.copy())
    for i, r, h in zip(c.table_of, c.row, c.home, strict=True):
        tables[i].home[r] = h
    return [_with_copies(t, c.row[c.table_of == i], c.holds[c.table_of == i]) for i, t in enumerate(tables)]


def _search(c: _Candidates, model: CostModel, seconds: np.ndarray, room: np.ndarray) -> None:
    """While it lowers the busiest link, the best single change to `c` (a copy added or dropped), else the
    best trade on a full device (_best_trade, _best_move_for_copy); at most COPY_STEPS changes."""
    topo, N = model.topology, len(model.topology.nodes)
    units = copy_unit_seconds(model)
    delta = c.deltas(np.arange(c.row.size), units)
    single_vec = single_row_seconds(model, c.x, c.q, c.q_node)
    copy_at = np.stack([replica_device(c.home, topo, a) for a in range(N)], axis=1)  # [K, N]
    holds, home, own = c.holds, c.home, c.own
    for _ in range(COPY_STEPS):
        best, k, a = _best_change(seconds, delta, holds, own, copy_at, room)
        changes: list[tuple[int, int]] | None = [(k, a)]
        move: tuple[int, int] | None = None
        if best >= seconds.max() * (1 - 1e-9):
            changes = _best_trade(seconds, delta, holds, own, copy_at, room)
            if changes is None:
                found = _best_move_for_copy(seconds, delta, single_vec, holds, home, copy_at, room)
                if found is None:
                    break
                move, changes = found
        if move is not None:  # a single row leaves a full device for one with room: new home, new deltas
            j, f = move
            seconds = seconds + single_vec[j, f] - single_vec[j, home[j]]
            room[home[j]] += 1
            room[f] -= 1
            home[j], own[j] = f, topo.node_of_device[f]
            holds[j] = False
            holds[j, own[j]] = True
            copy_at[j] = [replica_device(np.array([f]), topo, a)[0] for a in range(N)]
            delta[j] = c.deltas(np.array([j]), units)[0]
        for k, a in changes or ():
            seconds = seconds + (-1.0 if holds[k, a] else 1.0) * delta[k, a]
            room[copy_at[k, a]] += 1 if holds[k, a] else -1
            holds[k, a] = not holds[k, a]


def _best_change(seconds: np.ndarray, delta: np.ndarray, holds: np.ndarray, own: np.ndarray, copy_at: np.ndarray,
                 room: np.ndarray) -> tuple[float, int, int]:
    """(the busiest link's seconds after the best single change, a copy of row k in node a added or dropped,
    k, a); inf if none lowers the busiest link. A change that does not lower it leaves the maximum at least
    where it is, so only those that do are priced on every link (as refine's _best_move): the same choice,
    ties included, as pricing all."""
    busiest = int(np.argmax(seconds))
    sign = np.where(holds, -1.0, 1.0)  # a held copy is dropped, a missing one added
    lowers = seconds[busiest] + sign * delta[:, :, busiest] < seconds[busiest]
    lowers[np.arange(holds.shape[0]), own] = False
    lowers &= holds | (room[copy_at] > 0)
    ks, as_ = np.nonzero(lowers)  # in row-major order, as argmin over the whole [K, N] would scan
    if ks.size == 0:
        return np.inf, -1, -1
    after = (seconds[None, :] + sign[ks, as_, None] * delta[ks, as_]).max(axis=1)
    i = int(np.argmin(after))
    return float(after[i]), int(ks[i]), int(as_[i])


def _best_trade(seconds: np.ndarray, delta: np.ndarray, holds: np.ndarray, own: np.ndarray, copy_at: np.ndarray,
                room: np.ndarray) -> list[tuple[int, int]] | None:
    """On a full device: the copy to drop and the copy to add in its place that lower the busiest link
    most, as [(row, node) dropped, (row, node) added]; None if no trade lowers it."""
    K, N = holds.shape
    droppable = holds.copy()
    droppable[np.arange(K), own] = False
    busiest = int(np.argmax(seconds))
    best, found = seconds.max() * (1 - 1e-9), None
    for e in np.flatnonzero(room <= 0).tolist():
        adds = np.argwhere(~holds & (copy_at == e))
        drops = np.argwhere(droppable & (copy_at == e))
        if not adds.size or not drops.size:
            continue
        added, dropped = delta[adds[:, 0], adds[:, 1]], delta[drops[:, 0], drops[:, 1]]
        lowers = seconds[busiest] + (added[:, None, busiest] - dropped[None, :, busiest]) < seconds[busiest]
        i, j = np.nonzero(lowers)  # only these can lower the busiest link (_best_change)
        if not i.size:
            continue
        after = (seconds[None, :] + (added[i] - dropped[j])).max(axis=1)
        at = int(np.argmin(after))
        if after[at] < best:
            best, found = after[at], [tuple(drops[j[at]]), tuple(adds[i[at]])]
    return found


def _best_move_for_copy(
    seconds: np.ndarray, delta: np.ndarray, single_vec: np.ndarray, holds: np.ndarray, home: np.ndarray,
    copy_at: np.ndarray, room: np.ndarray,
) -> tuple[tuple[int, int], list[tuple[int, int]]] | None:
    """On a full device e: a single row homed on e moved to another device, and a copy added in its place,
    the pair that lowers the busiest link most (where that device is full too, its least useful copy is
    dropped to make room): ((row, device moved to), [(row, node) dropped there, if any; (row, node) added]);
    None if none lowers it. (No one change of these helps alone: the move and the drop only make room.)"""
    K, N = holds.shape
    P = room.size
    single = holds.sum(axis=1) == 1
    droppable = holds & ~single[:, None]
    droppable[copy_at == home[:, None]] = False  # the home's own copy
    # the copy dropped on each full device to take a moved row: the least harm alone
    drop: list[tuple[int, int] | None] = [None] * P
    drop_vec = np.zeros((P, seconds.size))
    for f in range(P):
        if room[f] > 0:
            continue
        held = np.argwhere(droppable & (copy_at == f))
        if held.size:
            h = int(np.argmin((seconds[None, :] - delta[held[:, 0], held[:, 1]]).max(axis=1)))
            drop[f], drop_vec[f] = (int(held[h, 0]), int(held[h, 1])), -delta[held[h, 0], held[h, 1]]
    to = np.array([room[f] > 0 or drop[f] is not None for f in range(P)])
    busiest = int(np.argmax(seconds))
    best, found = seconds.max() * (1 - 1e-9), None
    hot = np.arange(K) < TRADE_ROWS
    for e in np.flatnonzero(room <= 0).tolist():
        adds = np.argwhere(~holds & (copy_at == e) & hot[:, None])
        movers = np.flatnonzero(single & (home == e) & hot)
        dest = np.flatnonzero(to & (np.arange(P) != e))
        if not adds.size or not movers.size or not dest.size:
            continue
        moved = single_vec[movers][:, dest] - single_vec[movers, e][:, None] + drop_vec[dest][None]
        added = delta[adds[:, 0], adds[:, 1]]
        lowers = seconds[busiest] + (added[:, None, None, busiest] + moved[None, :, :, busiest]) < seconds[busiest]
        lowers[adds[:, 0][:, None] == movers[None, :]] = False  # a row does not make room for its own copy
        i, m, j = np.nonzero(lowers)  # [adds, movers, dest]: only these can lower the busiest link
        if not i.size:
            continue
        after = (seconds + (added[i] + moved[m, j])).max(axis=1)
        at = int(np.argmin(after))
        if after[at] < best:
            best, f = after[at], int(dest[j[at]])
            dropped = drop[f] if room[f] <= 0 else None  # a full destination: its copy that makes room
            added_copy = (int(adds[i[at], 0]), int(adds[i[at], 1]))
            found = ((int(movers[m[at]]), f), ([dropped] if dropped is not None else []) + [added_copy])
    return found


def _with_copies(t: TablePlan, rows: np.ndarray, holds: np.ndarray) -> TablePlan:
    """`t` with `rows` held by the nodes `holds` names: single on one node, node rows on all, else partial."""
    if not rows.size:
        return t
    count = holds.sum(axis=1)
    tier = np.where(count == 1, SINGLE, NODE).astype(np.int8)
    if (t.tier[rows] != tier).any():  # the tiers may be shared with other candidate plans
        t = TablePlan(t.name, t.tier.copy(), t.home, t.partial_ids, t.partial_nodes)
        t.tier[rows] = tier
    bits = (holds.astype(np.int64) << np.arange(holds.shape[1], dtype=np.int64)).sum(axis=1)
    some = (count > 1) & (count < holds.shape[1])
    keep = ~np.isin(t.partial_ids, rows)
    ids = np.concatenate([t.partial_ids[keep], rows[some]])
    nodes = np.concatenate([t.partial_nodes[keep], bits[some]])
    order = np.argsort(ids)
    return TablePlan(t.name, t.tier, t.home, ids[order].astype(np.int64), nodes[order])
