"""The shard map: global id <-> (device, local row), derived from any plan, vectorised both ways.

Each device lays out one table's rows it stores as
    [global rows] [node rows whose copy in this node is here] [single rows homed here]
each part in id order. For row-wise-mod this gives local = id // S, as in Caffe2.
A trainer reads a row from the copy nearest to it: its own (global rows), its node's
(node rows) or the home (single rows).
"""

from __future__ import annotations

import numpy as np

from shardflow.errors import InputError
from shardflow.planner.plan import GLOBAL, NODE, SINGLE, TablePlan, replica_device
from shardflow.planner.topology import Topology


def _rank_within(groups: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    """(rank of each element among equal group values in order, count per group)."""
    order = np.argsort(groups, kind="stable")
    counts = np.bincount(groups, minlength=size)
    rank = np.empty(groups.size, dtype=np.int64)
    rank[order] = np.arange(groups.size) - np.repeat(np.cumsum(counts) - counts, counts)
    return rank, counts


class ShardMap:
    def __init__(self, table: TablePlan, topology: Topology) -> None:
        self.table, self.topology = table, topology
        P = topology.devices
        tier, home = table.tier, table.home.astype(np.int64)
        self.global_ids = np.flatnonzero(tier == GLOBAL)
        self.node_ids = np.flatnonzero(tier == NODE)
        single = np.flatnonzero(tier == SINGLE)
        # Per node: the device holding each node row's copy there, and its local row on it.
        self._node_device, self._node_local = [], []
        node_rows_on = np.zeros(P, dtype=np.int64)
        for a in range(len(topology.nodes)):
            device = replica_device(home[self.node_ids], topology, a)
            rank, counts = _rank_within(device, P)
            self._node_device.append(device)
            self._node_local.append(self.global_ids.size + rank)
            node_rows_on += counts
        self.node_rows_on = node_rows_on
        rank, self.single_rows_on = _rank_within(home[single], P)
        self._single_ids = single
        self._single_local = self.global_ids.size + node_rows_on[home[single]] + rank

    def rows_on(self, device: int) -> int:
        return int(self.global_ids.size + self.node_rows_on[device] + self.single_rows_on[device])

    def locate(self, ids: np.ndarray, device: int) -> tuple[np.ndarray, np.ndarray]:
        """For a trainer on `device`: (device holding the copy it reads, local row there) per id."""
        ids = np.asarray(ids, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= self.table.rows):
            bad = ids[(ids < 0) | (ids >= self.table.rows)][0]
            raise InputError(f"table '{self.table.name}': id {int(bad)}; accepted: 0 <= id < {self.table.rows}")
        tier = self.table.tier[ids]
        owner = self.table.home[ids].astype(np.int64)
        local = np.empty(ids.size, dtype=np.int64)
        g = tier == GLOBAL
        owner[g] = device
        local[g] = np.searchsorted(self.global_ids, ids[g])
        n = tier == NODE
        node = int(self.topology.node_of_device[device])
        k = np.searchsorted(self.node_ids, ids[n])
        owner[n] = self._node_device[node][k]
        local[n] = self._node_local[node][k]
        s = tier == SINGLE
        local[s] = self._single_local[np.searchsorted(self._single_ids, ids[s])]
        return owner, local

    def stored(self, device: int) -> np.ndarray:
        """Global ids of the rows `device` stores, in local-row order (local row -> id)."""
        node = int(self.topology.node_of_device[device])
        here = self._node_device[node] == device
        node_part = np.empty(int(here.sum()), dtype=np.int64)
        node_part[self._node_local[node][here] - self.global_ids.size] = self.node_ids[here]
        singles = self._single_ids[self.table.home[self._single_ids] == device]
        return np.concatenate([self.global_ids, node_part, singles])

    def to_global(self, device: int, local: np.ndarray) -> np.ndarray:
        stored = self.stored(device)
        local = np.asarray(local, dtype=np.int64)
        if local.size and (local.min() < 0 or local.max() >= stored.size):
            raise InputError(f"device {device} stores {stored.size} rows of '{self.table.name}'; local rows outside")
        return stored[local]
