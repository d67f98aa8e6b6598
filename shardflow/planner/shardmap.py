"""The shard map: global id <-> (device, local row), derived from any plan, vectorised both ways.

Each device lays out one table's rows it stores as
    [global rows] [node rows whose copy in this node is here] [single rows homed here]
each part in id order. For row-wise-mod this gives local = id // S, as in Caffe2.
A trainer reads a row from the copy nearest to it: its own (global rows), its node's
(node rows its node holds) or the home (single rows, and node rows its node does not hold).

The map keeps nothing but the plan as devices receive it (tier and home, 2 bytes a row; for a
row-wise `id % S` plan, contiguous blocks or a whole table on one device only that rule):
where a trainer reads a row is computed from it per lookup, and the ids a device stores are
listed when asked (a shard asks once, when it is made), so no device holds a per-row
index of the whole table beside its shard.
"""

from __future__ import annotations

import numpy as np

from shardflow.errors import InputError
from shardflow.planner.sharding_plan import GLOBAL, NODE, SINGLE, DevicePlan, replica_device
from shardflow.planner.topology import Topology


class ShardMap:
    def __init__(self, table: DevicePlan, topology: Topology) -> None:
        self.table, self.topology = table, topology

    def _checked(self, ids: np.ndarray) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= self.table.rows):
            bad = ids[(ids < 0) | (ids >= self.table.rows)][0]
            raise InputError(f"table '{self.table.name}': id {int(bad)}; accepted: 0 <= id < {self.table.rows}")
        return ids

    def read_from(self, ids: np.ndarray, device: int) -> np.ndarray:
        """For a trainer on `device`: the device holding the copy of each id that it reads."""
        ids = self._checked(ids)
        tier = self.table.tier_of(ids)
        owner = self.table.home_of(ids).astype(np.int64)
        owner[tier == GLOBAL] = device
        here = int(self.topology.node_of_device[device])
        node = np.flatnonzero(tier == NODE)
        node = node[self.table.node_holds(ids[node], here)]
        if node.size:
            owner[node] = replica_device(owner[node], self.topology, here)
        return owner

    def held_in(self, ids: np.ndarray, node: int) -> np.ndarray:
        """Whether `node` holds a copy of each id: global rows everywhere, node rows on the nodes the
        plan puts them (every node, or some), single rows on their home's node only."""
        ids = np.asarray(ids, dtype=np.int64)
        tier = self.table.tier_of(ids)
        held = tier == GLOBAL
        single = np.flatnonzero(tier == SINGLE)
        held[single] = self.topology.node_of_device[self.table.home_of(ids[single]).astype(np.int64)] == node
        replicated = np.flatnonzero(tier == NODE)
        held[replicated] = self.table.node_holds(ids[replicated], node)
        return held

    def stored(self, device: int) -> np.ndarray:
        """Global ids of the rows `device` stores, in local-row order (local row -> id)."""
        node = int(self.topology.node_of_device[device])
        node_ids = self.table.replicated_ids(NODE)
        node_ids = node_ids[self.table.node_holds(node_ids, node)]
        here = replica_device(self.table.home_of(node_ids).astype(np.int64), self.topology, node) == device
        return np.concatenate([self.table.replicated_ids(GLOBAL), node_ids[here], self.table.single_ids(device)])

    def locate(self, ids: np.ndarray, device: int) -> tuple[np.ndarray, np.ndarray]:
        """For a trainer on `device`: (device holding the copy it reads, local row there) per id."""
        owner = self.read_from(ids, device)
        ids = np.asarray(ids, dtype=np.int64)
        local = np.empty(ids.size, dtype=np.int64)
        for d in np.unique(owner).tolist():
            stored = self.stored(d)
            order = np.argsort(stored, kind="stable")
            sel = owner == d
            local[sel] = order[np.searchsorted(stored[order], ids[sel])]
        return owner, local
