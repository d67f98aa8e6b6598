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

    def tier_of(self, ids: np.ndarray) -> np.ndarray:
        return self.tier[ids]

    def home_of(self, ids: np.ndarray) -> np.ndarray:
        return self.home[ids]

    def has_tier(self, tier: int) -> bool:
        return bool((self.tier == tier).any())

    def single_ids(self, device: int) -> np.ndarray:
        """Ids of the single rows homed on `device`, ascending."""
        return np.flatnonzero((self.tier == SINGLE) & (self.home == device))

    def replicated_ids(self, tier: int) -> np.ndarray:
        """Ids of the rows of tier NODE or GLOBAL, ascending."""
        return np.flatnonzero(self.tier == tier)


@dataclass(frozen=True)
class ModuloRows:
    """A table planned row-wise by `id % devices`, every row single: the rule instead of the rows.
    What a device receives of such a plan (a few bytes, not 2 a row): it answers the same
    questions as a TablePlan, computing each row's home from its id."""

    name: str
    rows: int
    devices: int

    def tier_of(self, ids: np.ndarray) -> np.ndarray:
        return np.full(np.shape(ids), SINGLE, dtype=np.int8)

    def home_of(self, ids: np.ndarray) -> np.ndarray:
        return np.asarray(ids, dtype=np.int64) % self.devices

    def has_tier(self, tier: int) -> bool:
        return tier == SINGLE and self.rows > 0

    def single_ids(self, device: int) -> np.ndarray:
        return np.arange(device, self.rows, self.devices, dtype=np.int64)

    def replicated_ids(self, tier: int) -> np.ndarray:
        return np.zeros(0, dtype=np.int64)


MODULO_CHECK_ROWS = 1 << 22  # rows compared with the rule at a time


def for_devices(table: TablePlan, devices: int) -> TablePlan | ModuloRows:
    """The table's plan as every device receives it: the rule when the plan is row-wise `id % devices`;
    otherwise homes in the narrowest integer type that holds the devices (1 byte a row instead of 4
    on up to 127 devices: 2 bytes a row in all with the tier)."""
    if _is_modulo(table, devices):
        return ModuloRows(table.name, table.rows, devices)
    dtype = np.int8 if devices <= 127 else np.int16 if devices <= 32767 else np.int32
    return TablePlan(table.name, table.tier, table.home.astype(dtype, copy=False))


def _is_modulo(table: TablePlan, devices: int) -> bool:
    for start in range(0, table.rows, MODULO_CHECK_ROWS):
        stop = min(start + MODULO_CHECK_ROWS, table.rows)
        if (table.tier[start:stop] != SINGLE).any():
            return False
        if (table.home[start:stop] != np.arange(start, stop) % devices).any():
            return False
    return True


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

    def for_devices(self, devices: int) -> dict[str, "TablePlan | ModuloRows"]:
        """Every table's plan as the devices receive it (for_devices), by name."""
        return {t.name: for_devices(t, devices) for t in self.tables}


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
