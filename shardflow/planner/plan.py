"""ShardingPlan: the tier and home of every row of every table, and the memory it takes.

Tiers: SINGLE (one copy, on `home`), NODE (one copy per node), GLOBAL (a copy on every
device). For a replicated row, `home` is its primary copy; in every other node A the
row lives on (or its sync is led by) device start(A) + (j mod devices(A)), where j is
home's index inside its own node. Copies per device are counted from exactly that rule,
which the shard map and the training engine follow too.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from shardflow.errors import InputError
from shardflow.planner.topology import Topology

SINGLE, NODE, GLOBAL = 0, 1, 2
TIERS = ("single", "node", "global")
VALUE_BYTES = 4  # float32 embeddings, gradients and optimizer state
ID_BYTES = 8  # int64 ids on the wire


def row_bytes(dim: int) -> int:
    """A row and its row-wise Adagrad state (one float) in device memory."""
    return VALUE_BYTES * (dim + 1)


@dataclass(frozen=True)
class TablePlan:
    name: str
    tier: np.ndarray  # int8 [rows]
    home: np.ndarray  # int32 [rows]

    @property
    def rows(self) -> int:
        return int(self.tier.size)


@dataclass(frozen=True)
class ShardingPlan:
    strategy: str
    tables: tuple[TablePlan, ...]

    def table(self, name: str) -> TablePlan:
        for t in self.tables:
            if t.name == name:
                return t
        raise InputError(f"no table {name!r} in the plan; accepted: {', '.join(t.name for t in self.tables)}")

    def tier_counts(self) -> dict[str, int]:
        counts = sum(np.bincount(t.tier, minlength=3) for t in self.tables)
        return {name: int(counts[i]) for i, name in enumerate(TIERS)}

    def rows_per_device(self, topology: Topology) -> np.ndarray:
        """Row copies stored on every device, all tables together."""
        return sum(table_rows_per_device(t, topology) for t in self.tables)

    def memory_bytes_per_device(self, topology: Topology, dim: int) -> np.ndarray:
        return self.rows_per_device(topology) * row_bytes(dim)


def replica_device(home: np.ndarray, topology: Topology, node: int) -> np.ndarray:
    """Device in `node` that holds (or leads the sync of) replicated rows with these homes."""
    local = home - topology.node_start[topology.node_of_device[home]]
    return topology.node_start[node] + local % topology.node_devices[node]


def table_rows_per_device(t: TablePlan, topology: Topology) -> np.ndarray:
    P = topology.devices
    counts = np.bincount(t.home[t.tier == SINGLE], minlength=P).astype(np.int64)
    counts += int(np.count_nonzero(t.tier == GLOBAL))
    node_homes = t.home[t.tier == NODE]
    for a in range(len(topology.nodes)):
        counts += np.bincount(replica_device(node_homes, topology, a), minlength=P)
    return counts


def check_plan(plan: ShardingPlan, rows: dict[str, int], topology: Topology) -> None:
    """Every table planned, every row with a valid tier and a home on a real device."""
    if sorted(t.name for t in plan.tables) != sorted(rows):
        raise InputError(f"plan tables {[t.name for t in plan.tables]} do not match {sorted(rows)}")
    for t in plan.tables:
        if t.tier.shape != (rows[t.name],) or t.home.shape != (rows[t.name],):
            raise InputError(f"plan of table '{t.name}' covers {t.tier.size} rows; the table has {rows[t.name]}")
        if t.tier.size and (t.tier.min() < 0 or t.tier.max() > 2):
            raise InputError(f"plan of table '{t.name}': tiers outside 0..2")
        if t.home.size and (t.home.min() < 0 or t.home.max() >= topology.devices):
            raise InputError(
                f"plan of table '{t.name}': homes outside 0..{topology.devices - 1} for {topology.devices} devices"
            )
