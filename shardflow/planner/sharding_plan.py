"""ShardingPlan: the tier and home of every row of every table, and the memory it takes.

Tiers: SINGLE (one copy, on `home`), NODE (one copy per node), GLOBAL (a copy on every
device). For a replicated row, `home` is its primary copy; in every other node A the
row lives on (or its sync is led by) device start(A) + (j mod devices(A)), where j is
home's index inside its own node. Copies per device are counted from exactly that rule,
which the shard map and the training engine follow too.

A NODE row may be copied onto some nodes only (`partial_ids`, with a bit per node that
holds a copy in `partial_nodes`; the home's node always among them): a trainer of a node
without a copy reads the row from its home, as it reads a single row.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from shardflow.errors import InputError
from shardflow.planner.topology import Topology

SINGLE, NODE, GLOBAL = 0, 1, 2
TIERS = ("single", "node", "global")
VALUE_BYTES = 4  # float32 embeddings, gradients and optimizer state
ID_BYTES = 8  # int64 ids on the wire
MAX_PARTIAL_NODES = 63  # a node row's copies are named by the bits of an int64



def step_round_names(has_global: bool, replicated: bool, topology: Topology, dedup: str) -> tuple[str, ...]:
    """The rounds every step of a plan takes, in order (the protocol's and the cost model's one rule).

    `has_global`: some row is GLOBAL; `replicated`: some row is GLOBAL or NODE."""
    several_nodes = len(topology.nodes) > 1
    if dedup == "node" and several_nodes:
        rounds = ["request", "relay-request", "relay-reply", "reply", "gradients", "relay-gradients"]
    else:
        rounds = ["request", "reply", "gradients"]
    if topology.devices == 1:
        return tuple(rounds)
    if replicated and exchanges_partials(topology):
        rounds.append("exchange")
    else:
        if replicated and several_nodes:
            rounds.append("to-primary")
        if has_global or (replicated and several_nodes):
            rounds.append("totals")
    if has_global and several_nodes:
        rounds.append("forward")
    return tuple(rounds)


def exchanges_partials(topology: Topology) -> bool:
    """Whether replicas sync in one EXCHANGE round (each node's copy sends its node's partial sum to the other
    node's copy, and both add the two in node order) rather than TO_PRIMARY and TOTALS (partial sums up to the
    home, the total back). On two nodes the exchange is one round fewer for at most the bytes (a row only one
    node read crosses once, not twice); on more, every partial would cross to every other node."""
    return len(topology.nodes) == 2


def _no_ids() -> np.ndarray:
    return np.zeros(0, dtype=np.int64)


ROW_OPTIMIZERS = ("adagrad", "adam")  # the embedding rows' optimizers (shardflow.model.optim)


def row_state_floats(rows: str, dim: int) -> int:
    """The floats of optimizer state a row keeps beside its values (shardflow.model.optim): row-wise Adagrad's
    sum, or Adam's two moments and its count of the row's updates."""
    return 1 if rows == "adagrad" else 2 * dim + 1


def row_bytes(dim: int, rows: str = "adagrad") -> int:
    """A row and its optimizer's state in device memory."""
    return VALUE_BYTES * (dim + row_state_floats(rows, dim))


@dataclass(frozen=True)
class TablePlan:
    name: str
    tier: np.ndarray  # int8 [rows]
    home: np.ndarray  # int32 [rows]
    partial_ids: np.ndarray = field(default_factory=_no_ids)  # int64, ascending: NODE rows on some nodes only
    partial_nodes: np.ndarray = field(default_factory=_no_ids)  # int64: bit A set = node A holds a copy

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

    def node_holds(self, ids: np.ndarray, node: int) -> np.ndarray:
        """For NODE rows `ids`: whether `node` holds a copy of each (every node does, but where
        the plan names the nodes)."""
        ids = np.asarray(ids, dtype=np.int64)
        held = np.ones(ids.shape, dtype=bool)
        if self.partial_ids.size and ids.size:
            at = np.minimum(np.searchsorted(self.partial_ids, ids), self.partial_ids.size - 1)
            named = self.partial_ids[at] == ids
            held[named] = (self.partial_nodes[at[named]] >> node) & 1 == 1
        return held


class _SingleRule:
    """A plan every row of which is single, its home computed from the id by a rule (home_of,
    single_ids): what a device receives of such a plan instead of 2 bytes a row. It answers the
    same questions as a TablePlan."""

    rows: int

    def tier_of(self, ids: np.ndarray) -> np.ndarray:
        return np.full(np.shape(ids), SINGLE, dtype=np.int8)

    def has_tier(self, tier: int) -> bool:
        return tier == SINGLE and self.rows > 0

    def replicated_ids(self, tier: int) -> np.ndarray:
        return np.zeros(0, dtype=np.int64)

    def node_holds(self, ids: np.ndarray, node: int) -> np.ndarray:
        return np.ones(np.shape(ids), dtype=bool)


@dataclass(frozen=True)
class ModuloRows(_SingleRule):
    """A table planned row-wise by `id % devices` (Caffe2's row-wise)."""

    name: str
    rows: int
    devices: int

    def home_of(self, ids: np.ndarray) -> np.ndarray:
        return np.asarray(ids, dtype=np.int64) % self.devices

    def single_ids(self, device: int) -> np.ndarray:
        return np.arange(device, self.rows, self.devices, dtype=np.int64)


@dataclass(frozen=True)
class BlockRows(_SingleRule):
    """A table planned in contiguous blocks: row id on device first + id // block (row-wise-block's
    ranges; a whole table on one device when block >= rows, as table-wise places it)."""

    name: str
    rows: int
    block: int
    first: int = 0

    def home_of(self, ids: np.ndarray) -> np.ndarray:
        return self.first + np.asarray(ids, dtype=np.int64) // self.block

    def single_ids(self, device: int) -> np.ndarray:
        k = device - self.first
        if k < 0:
            return np.zeros(0, dtype=np.int64)
        return np.arange(k * self.block, min((k + 1) * self.block, self.rows), dtype=np.int64)


DevicePlan = TablePlan | ModuloRows | BlockRows  # a table's plan as a device receives it (for_devices)
MODULO_CHECK_ROWS = 1 << 22  # rows compared with the rule at a time


def for_devices(table: TablePlan, devices: int) -> DevicePlan:
    """The table's plan as every device receives it: the rule when the plan is row-wise `id % devices`
    or contiguous blocks (row-wise-block, a whole table on one device); otherwise homes in the
    narrowest integer type that holds the devices (1 byte a row instead of 4 on up to 127 devices:
    2 bytes a row in all with the tier)."""
    for rule in (ModuloRows(table.name, table.rows, devices), _block_rule(table)):
        if rule is not None and _follows(table, rule):
            return rule
    dtype = np.int8 if devices <= 127 else np.int16 if devices <= 32767 else np.int32
    return TablePlan(table.name, table.tier, table.home.astype(dtype, copy=False), table.partial_ids,
                     table.partial_nodes)


def _follows(table: TablePlan, rule: ModuloRows | BlockRows) -> bool:
    """Whether every row of `table` is single and homed where `rule` says (MODULO_CHECK_ROWS at a time)."""
    for start in range(0, table.rows, MODULO_CHECK_ROWS):
        stop = min(start + MODULO_CHECK_ROWS, table.rows)
        if (table.tier[start:stop] != SINGLE).any():
            return False
        if (table.home[start:stop] != rule.home_of(np.arange(start, stop))).any():
            return False
    return True


def _block_rule(table: TablePlan) -> BlockRows | None:
    """The blocks `table` would follow if it is in blocks: its first home, and the length of the run
    that starts it as the block (the last run may be shorter)."""
    if not table.rows:
        return None
    first, block = int(table.home[0]), table.rows
    for start in range(0, table.rows, MODULO_CHECK_ROWS):
        differ = np.flatnonzero(table.home[start : start + MODULO_CHECK_ROWS] != first)
        if differ.size:
            block = start + int(differ[0])
            break
    return BlockRows(table.name, table.rows, block, first)


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
        counts = np.sum([np.bincount(t.tier, minlength=3) for t in self.tables], axis=0)
        return {name: int(counts[i]) for i, name in enumerate(TIERS)}

    def rows_per_device(self, topology: Topology) -> np.ndarray:
        """Row copies stored on every device, all tables together."""
        return np.sum([table_rows_per_device(t, topology) for t in self.tables], axis=0)

    def memory_bytes_per_device(self, topology: Topology, dim: int, rows: str = "adagrad") -> np.ndarray:
        """Each device's rows and their state under row optimizer `rows`."""
        return self.rows_per_device(topology) * row_bytes(dim, rows)

    def for_devices(self, devices: int) -> dict[str, DevicePlan]:
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
    node_ids = np.flatnonzero(t.tier == NODE)
    node_homes = t.home[node_ids].astype(np.int64)
    for a in range(len(topology.nodes)):
        held = t.node_holds(node_ids, a)
        counts += np.bincount(replica_device(node_homes[held], topology, a), minlength=P)
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
        if t.partial_ids.size:
            _check_partial(t, topology)


def _check_partial(t: TablePlan, topology: Topology) -> None:
    """Rows copied onto some nodes: NODE rows named once, in id order, each on its home's node and at least
    one other, on nodes that exist."""
    ids, nodes, N = t.partial_ids, t.partial_nodes, len(topology.nodes)
    where = f"plan of table '{t.name}': rows copied onto some nodes"
    if ids.shape != nodes.shape or ids.ndim != 1:
        raise InputError(f"{where}: {ids.size} ids but {nodes.size} node sets; accepted: one set per id")
    if (ids[1:] <= ids[:-1]).any() or ids.min() < 0 or ids.max() >= t.rows:
        raise InputError(f"{where}: ids not ascending, repeated or outside 0..{t.rows - 1}; accepted: ascending "
                         "distinct row ids")
    if (t.tier[ids] != NODE).any():
        bad = int(ids[t.tier[ids] != NODE][0])
        raise InputError(f"{where}: row {bad} has tier {TIERS[t.tier[bad]]}; accepted: node rows only")
    if N > MAX_PARTIAL_NODES or (nodes >> N).any() or (nodes <= 0).any():
        raise InputError(f"{where}: node sets outside the {N} nodes (bits 0..{N - 1}); accepted: sets of existing "
                         f"nodes, on at most {MAX_PARTIAL_NODES} nodes")
    home_node = topology.node_of_device[t.home[ids].astype(np.int64)]
    if ((nodes >> home_node) & 1 == 0).any() or (np.bitwise_count(nodes.astype(np.uint64)) < 2).any():
        raise InputError(f"{where}: a set without its home's node, or with one node only; accepted: the home's "
                         "node and at least one other (one node is the single tier)")
