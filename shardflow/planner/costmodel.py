"""Expected bytes per training step between every pair of devices, and the time they take.

This is the contract the training engine keeps. One step: a global batch of B examples,
B/P per trainer; a table with lookups-per-example λ gives each trainer m = λ·B/P
lookups, row r read by each with probability p_r (profile classes, access.py).

All-to-all ("lookup") part. A trainer reads every row it needs from the nearest copy:
its own device (global rows, and rows whose copy lives on it: no traffic), its node's
replica (node rows), or the row's home (single rows, and node rows copied onto some
nodes only, read by a node without a copy). For every row read remotely it
sends the id (ID_BYTES), receives the row (4·dim), and after backward sends the id and
the gradient (ID_BYTES + 4·dim). With de-duplication scope `none` this happens once
per occurrence (m·p_r expected per trainer), with scope `device` once per distinct row
of the sub-batch (probability q_r = 1 - (1 - p_r)^(f·m)). f (Touch, fitted to real
batches by shardflow.sharding.touch; 1 for independent draws) is how many independent draws per
lookup would touch as many distinct rows as the data's own batches do: below 1 where an
example's lookups repeat items, as sessions do. Nodes and whole batches have their own f.

Sync part. Replicas must apply identical updates, so a replicated row's gradient is
reduced to one place and the sum sent back to every copy, one message of
(ID_BYTES + 4·dim) per hop:
  node rows   each non-primary node's replica sends its node's partial sum to the
              primary copy if any trainer of that node read the row; the primary sends
              the total to every other node's replica if anyone read it (only the nodes
              holding a copy, for a row copied onto some nodes);
  global rows inside each node, every device that read the row sends its partial sum
              to the node's leader, the leaders reduce to the primary and get the total
              back as above, and each leader sends the total to the other devices of its
              node. Single rows need no sync: their one owner applies the update.
  two nodes   (plan.exchanges_partials) the primary sends its own node's partial sum back,
              if a trainer of its node read the row, instead of the total: each copy adds
              the two partial sums itself.
Partial sums are per row and device, whatever the scope.

Time. A byte between two devices of one node uses the sender's and the receiver's
intra-node ports; between nodes, the sender node's uplink out and the receiver node's
uplink in (full duplex). A step's rounds (plan.step_round_names: request, reply, gradients,
and to-primary, totals where rows are replicated, or on two nodes exchange and forward) run
one after another, each as long as its busiest link takes for its bytes (ids in request;
rows in reply; ids and gradients in gradients; partial sums in to-primary and exchange;
totals in totals and forward). The modeled communication time
per step is the sum over the rounds of that payload time times the wire's bytes factor,
plus the wire's fixed cost per round (Wire: frames and headers, each round's latency,
serialisation and wait, fitted on the emulated cluster). `link_time_s_per_step` is the
busiest link's bytes of the whole step over its bandwidth: what the placement, the
relaxation's bound and the exact program price; it never exceeds the modeled time.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from shardflow.errors import InputError
from shardflow.planner.access import TableAccess
from shardflow.planner.sharding_plan import (
    GLOBAL,
    ID_BYTES,
    NODE,
    ROW_OPTIMIZERS,
    SINGLE,
    VALUE_BYTES,
    ShardingPlan,
    TablePlan,
    exchanges_partials,
    replica_device,
    row_bytes,
    step_round_names,
)
from shardflow.planner.topology import Topology

DEDUP_SCOPES = ("none", "device", "node")


def check_dedup(scope: str) -> str:
    """A de-duplication scope: `none` (every id occurrence travels), `device` (each distinct id of a trainer
    once) or `node` (as device, and a node fetches each row from another node once for all its trainers)."""
    if scope not in DEDUP_SCOPES:
        raise InputError(f"dedup scope {scope!r}; accepted: {', '.join(DEDUP_SCOPES)}")
    return scope
ROWS_PER_PASS = 1 << 24  # rows aggregated at a time: bounds memory for 10^8-row tables


@dataclass(frozen=True)
class StepShape:
    batch_size: int
    dim: int
    dedup: str = "device"
    row_optimizer: str = "adagrad"  # what a row's state costs in memory (row_bytes); a plan from before: Adagrad

    def __post_init__(self) -> None:
        for name in ("batch_size", "dim"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise InputError(f"{name} = {v!r}; accepted: an integer >= 1")
        check_dedup(self.dedup)
        if self.row_optimizer not in ROW_OPTIMIZERS:
            raise InputError(f"row_optimizer = {self.row_optimizer!r}; accepted: {', '.join(ROW_OPTIMIZERS)}")

    @property
    def row_bytes(self) -> int:
        """A row and its optimizer state in device memory."""
        return row_bytes(self.dim, self.row_optimizer)

    @property
    def message_bytes(self) -> int:
        """One id with one row or gradient."""
        return ID_BYTES + VALUE_BYTES * self.dim


@dataclass(frozen=True)
class Wire:
    """What a round costs beyond its payload: `bytes_factor` times the payload crosses each link (frame, IP
    and TCP headers, Dask's framing), and each round adds `round_s` whatever its bytes (a message's
    latency, serialisation and the wait for the last sender). Fitted on the emulated cluster
    (bench/emulated_cluster.py --fit), in the topology's time: seconds there over the time scale."""

    bytes_factor: float = 1.0
    round_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.bytes_factor >= 1.0 or not self.round_s >= 0.0:
            raise InputError(f"wire {self.bytes_factor!r}, {self.round_s!r}; accepted: bytes_factor >= 1, round_s >= 0")


BYTES_ONLY = Wire()
# Fitted by `python bench/emulated_cluster.py --fit` (docs/emulation.md, 2026-11-24): shardflow's rounds over
# TCP carry 1.06 bytes per byte of payload (headers, Dask's framing), and each round costs 9.1 µs more (4.6 ms
# emulated at time scale 500: a message's latency, serialisation, the wait for the last sender); non-negative
# least squares over 48 cells: 2 × 2 with equal and with uneven uplinks, batches 512-8192, two logs.
FITTED_WIRE = Wire(bytes_factor=1.06, round_s=9.1e-6)


@dataclass(frozen=True)
class Touch:
    """Distinct rows real batches touch, as a factor of independent draws (fitted by shardflow.sharding.touch).

    A factor f says that the lookups of a trainer's sub-batch (or of a node's trainers, or of a whole
    batch) touch as many distinct rows as f times as many independent draws would: 1 on data whose
    lookups are independent, below 1 where a user's examples share their history or repeat items.
    """

    trainer: float = 1.0
    node: dict[int, float] = field(default_factory=dict)  # devices in a node -> factor (1.0 where absent)
    batch: float = 1.0


INDEPENDENT = Touch()


@dataclass(frozen=True)
class ClassRates:
    """Per class of rows of one table: expected wire units and touch probabilities per step."""

    x: np.ndarray  # remote-read units per trainer: occurrences (none) or P(read) (device)
    q: np.ndarray  # P(one trainer reads the row)
    q_node: np.ndarray  # [nodes, C]: P(some trainer of the node reads it)
    q_any: np.ndarray  # P(some trainer reads it)


def touched(access: TableAccess, draws: float) -> np.ndarray:
    """Per class: the probability that `draws` independent lookups read a given row."""
    log_miss = np.log1p(-np.minimum(access.class_prob, 1.0 - 2.0**-53))
    return -np.expm1(draws * log_miss)


def class_rates(access: TableAccess, topology: Topology, shape: StepShape, touch: Touch = INDEPENDENT) -> ClassRates:
    m = access.lookups_per_example * shape.batch_size / topology.devices
    q = touched(access, m * touch.trainer)
    return ClassRates(
        x=m * access.class_prob if shape.dedup == "none" else q,
        q=q,
        q_node=np.stack([touched(access, m * n * touch.node.get(int(n), 1.0)) for n in topology.node_devices]),
        q_any=touched(access, m * topology.devices * touch.batch),
    )


@dataclass(frozen=True)
class PlanCost:
    lookup_pairs: np.ndarray  # [P, P] expected bytes per step, sender -> receiver
    sync_pairs: np.ndarray
    same_node: np.ndarray  # [P, P] bool
    comm_time_s_per_step: float  # on the wire: the rounds one after another, each with the wire's costs
    busiest_link: str  # over the whole step
    link_time_s_per_step: float  # the busiest link's bytes of the whole step over its bandwidth (what bounds price)
    # round -> its payload's seconds on its busiest link
    round_payload_s: dict[str, float] = field(default_factory=dict)

    @property
    def lookup_bytes_per_step(self) -> float:
        return float(self.lookup_pairs.sum())

    @property
    def sync_bytes_per_step(self) -> float:
        return float(self.sync_pairs.sum())

    @property
    def bytes_per_step(self) -> float:
        return self.lookup_bytes_per_step + self.sync_bytes_per_step

    @property
    def inter_node_bytes_per_step(self) -> float:
        return float(((self.lookup_pairs + self.sync_pairs) * ~self.same_node).sum())

    def device_bytes_per_step(self) -> np.ndarray:
        """Bytes each device sends plus receives."""
        pairs = self.lookup_pairs + self.sync_pairs
        return pairs.sum(axis=1) + pairs.sum(axis=0)


def link_bytes(pairs: np.ndarray, topology: Topology) -> np.ndarray:
    """The bytes of a [P, P] sender -> receiver matrix on every link direction, ordered [intra-node port
    out of each device, into each device, uplink out of each node, into each node]: inside a node a
    byte uses both devices' ports, between nodes both nodes' uplinks."""
    same = topology.node_of_device[:, None] == topology.node_of_device[None, :]
    intra, inter = pairs * same, pairs * ~same
    starts = topology.node_start
    return np.concatenate([intra.sum(axis=1), intra.sum(axis=0), np.add.reduceat(inter.sum(axis=1), starts),
                           np.add.reduceat(inter.sum(axis=0), starts)])


def bandwidths(topology: Topology) -> np.ndarray:
    """Bytes per second of every link direction, in link_bytes' order."""
    P = topology.devices
    return np.concatenate([np.full(2 * P, topology.intra_bytes_per_s), topology.uplink_bytes_per_s,
                           topology.uplink_bytes_per_s])


def link_seconds(pairs: np.ndarray, topology: Topology) -> np.ndarray:
    return link_bytes(pairs, topology) / bandwidths(topology)


class CostModel:
    def __init__(self, topology: Topology, shape: StepShape, touch: dict[str, Touch] | None = None,
                 wire: Wire = FITTED_WIRE) -> None:
        """`touch`: per table, the distinct rows real batches touch (shardflow.sharding.touch); independent draws
        for a table without one. `wire`: what each round costs beyond its payload."""
        self.topology = topology
        self.shape = shape
        self.touch = touch or {}
        self.wire = wire
        node = topology.node_of_device
        self._same_node = node[:, None] == node[None, :]
        self._peers = self._same_node & ~np.eye(topology.devices, dtype=bool)

    def rates(self, access: TableAccess) -> ClassRates:
        return class_rates(access, self.topology, self.shape, self.touch.get(access.name, INDEPENDENT))

    def evaluate(self, plan: ShardingPlan, accesses: dict[str, TableAccess]) -> PlanCost:
        lookup, sync, parts = self.pairs(plan, accesses)
        link_time, link = self._time(lookup + sync)
        payload = self._round_payloads(plan, parts)
        comm = self.wire.bytes_factor * sum(payload.values()) + self.wire.round_s * len(payload)
        return PlanCost(lookup, sync, self._same_node, comm, link, link_time, payload)

    def pairs(self, plan: ShardingPlan, accesses: dict[str, TableAccess]
              ) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
        """(lookup, sync, each round's part): [P, P] expected bytes per step, sender -> receiver."""
        topo, P = self.topology, self.topology.devices
        a, v = ID_BYTES, VALUE_BYTES * self.shape.dim
        msg = a + v
        loads = _Loads.zeros(len(topo.nodes), P)
        for table in plan.tables:
            self._add_table(loads, table, accesses[table.name], msg)
        if self._relay:
            units = self._relayed_units(loads.home, loads.node_units)
        else:
            units = ~np.eye(P, dtype=bool) * loads.home[topo.node_of_device]  # [trainer, home]
        units = units + self._peers * loads.node[None, :]  # [reader, server]: remote-read units per step
        up = loads.up.reshape(P, P) + self._peers * msg * loads.reduce_in[None, :]
        bcast = self._peers * msg * loads.bcast_out[:, None]
        down = loads.down.reshape(P, P) + bcast
        parts = {"request": a * units, "reply": v * units.T, "gradients": (a + v) * units,
                 "to-primary": up, "totals": down, "exchange": up + down - bcast, "forward": bcast}
        return (2 * a + v) * units + v * units.T, up + down, parts

    @property
    def _exchange(self) -> bool:
        """Replicas sync in one EXCHANGE round: the home's node sends its partial sum, not the total, back."""
        return exchanges_partials(self.topology)

    @property
    def _relay(self) -> bool:
        """Scope node on more than one node: a node's proxy fetches each row once for its trainers."""
        return self.shape.dedup == "node" and len(self.topology.nodes) > 1

    def _add_table(self, loads: _Loads, table: TablePlan, access: TableAccess, msg: int) -> None:
        """Add one table's expected reads and syncs per step to `loads`, ROWS_PER_PASS rows at a time."""
        topo, P = self.topology, self.topology.devices
        rates = self.rates(access)
        for s in range(0, table.rows, ROWS_PER_PASS):
            cls = access.row_class[s : s + ROWS_PER_PASS]
            tier = table.tier[s : s + ROWS_PER_PASS]
            home = table.home[s : s + ROWS_PER_PASS].astype(np.int64)
            single = tier == SINGLE
            s_home, s_cls = home[single], cls[single]
            loads.home += np.bincount(s_home, rates.x[s_cls], minlength=P)  # every node's trainers
            repl = ~single
            r_ids = np.flatnonzero(repl) + s
            r_home, r_cls, r_tier = home[repl], cls[repl], tier[repl]
            primary = topo.node_of_device[r_home]
            is_node, is_global = r_tier == NODE, r_tier == GLOBAL
            for node in range(len(topo.nodes)):
                held = is_global | (is_node & table.node_holds(r_ids, node))
                far = ~held  # node rows this node holds no copy of: its trainers read them from the home
                loads.home[node] += np.bincount(r_home[far], rates.x[r_cls[far]], minlength=P)
                if self._relay:
                    loads.node_units[node] += np.bincount(s_home, rates.q_node[node][s_cls], minlength=P)
                    loads.node_units[node] += np.bincount(r_home[far], rates.q_node[node][r_cls[far]], minlength=P)
                device = replica_device(r_home, topo, node)
                held_node = is_node & held
                loads.node += np.bincount(device[held_node], rates.x[r_cls[held_node]], minlength=P)
                loads.reduce_in += np.bincount(device[is_global], rates.q[r_cls[is_global]], minlength=P)
                loads.bcast_out += np.bincount(device[is_global], rates.q_any[r_cls[is_global]], minlength=P)
                other = (primary != node) & held
                loads.up += np.bincount(device[other] * P + r_home[other], rates.q_node[node][r_cls[other]] * msg,
                                        minlength=P * P)
                back = rates.q_node[primary[other], r_cls[other]] if self._exchange else rates.q_any[r_cls[other]]
                loads.down += np.bincount(r_home[other] * P + device[other], back * msg, minlength=P * P)

    def _relayed_units(self, home_load: np.ndarray, node_units: np.ndarray) -> np.ndarray:
        """Scope node: a trainer reads a single row of its own node from the home; a row of another node
        from its node's proxy for that home (replica_device), which fetches it from the home once for
        the node (q_node units) and returns one summed gradient. [reader, server] units per step."""
        topo, P = self.topology, self.topology.devices
        node = topo.node_of_device
        units = self._peers * home_load[node]  # [trainer, home]
        homes = np.arange(P)
        for n in range(len(topo.nodes)):
            away = node != n
            proxy = replica_device(homes[away], topo, n)
            relayed = np.bincount(proxy, home_load[n][away], minlength=P)  # per trainer, asked of each proxy
            inside = node == n
            units = units + (inside[:, None] & inside[None, :] & self._peers) * relayed[None, :]
            np.add.at(units, (proxy, homes[away]), node_units[n][away])
        return units

    def _round_payloads(self, plan: ShardingPlan, parts: dict[str, np.ndarray]) -> dict[str, float]:
        """Per round of the plan's steps, in order: its payload's seconds on its busiest link. A relayed
        round's bytes are priced with the round they relay (request, reply, gradients): one of the two legs
        runs inside a node, on links far faster than the uplinks. On one node, the sums of global rows
        to the leader and back are both priced in totals."""
        has_global = any(t.has_tier(GLOBAL) for t in plan.tables)
        replicated = has_global or any(t.has_tier(NODE) for t in plan.tables)
        names = step_round_names(has_global, replicated, self.topology, self.shape.dedup)
        if "totals" in names and "to-primary" not in names:
            parts = {**parts, "totals": parts["to-primary"] + parts["totals"]}
        if "exchange" not in names:  # the totals round carries what forward passes on inside a node
            parts = {k: w for k, w in parts.items() if k != "forward"}
        return {name: self._time(parts[name])[0] if name in parts else 0.0 for name in names}

    def _time(self, pairs: np.ndarray) -> tuple[float, str]:
        topo, P, N = self.topology, self.topology.devices, len(self.topology.nodes)
        seconds = link_seconds(pairs, topo)
        intra_s = np.maximum(seconds[:P], seconds[P : 2 * P])
        up_s = np.maximum(seconds[2 * P : 2 * P + N], seconds[2 * P + N :])
        d, n = int(np.argmax(intra_s)), int(np.argmax(up_s))
        if up_s[n] > intra_s[d]:
            return float(up_s[n]), f"uplink of node {topo.nodes[n].name}"
        return float(intra_s[d]), f"intra-node port of device {d}"


def one_row(name: str, tier: int, home: int, nodes: int = 0) -> TablePlan:
    """A one-row plan: (tier, home), and for a node row copied onto some nodes only, their bits in `nodes`."""
    partial = np.array([0] if nodes else [], np.int64), np.array([nodes] if nodes else [], np.int64)
    return TablePlan(name, np.array([tier], np.int8), np.array([home], np.int32), *partial)


def row_link_bytes(access: TableAccess, cls: int, tier: int, home: int, model: CostModel, nodes: int = 0) -> np.ndarray:
    """Bytes one row of class `cls` placed at (tier, home[, nodes]) adds to each link direction (link_bytes):
    every quantity the model prices is a sum of such vectors over rows."""
    one = TableAccess(access.name, 1, access.lookups_per_example, access.class_prob[cls : cls + 1],
                      np.ones(1, dtype=np.int64), np.zeros(1, dtype=np.int32))
    plan = ShardingPlan("one row", (one_row(access.name, tier, home, nodes),))
    lookup, sync, _ = model.pairs(plan, {access.name: one})
    return link_bytes(lookup + sync, model.topology)


@dataclass
class _Loads:
    """A plan's expected reads and syncs per step, summed over its tables (CostModel.evaluate)."""

    home: np.ndarray  # [node, home]: remote-read units served by each home, per trainer of each node
    node_units: np.ndarray  # [node, home]: scope node: units node A's proxy fetches from each home
    node: np.ndarray  # [device]: reads served by each node replica, per trainer of its node
    reduce_in: np.ndarray  # [device]: global rows: P(a device reads) summed per node leader
    bcast_out: np.ndarray  # [device]: global rows: P(anyone reads) summed per node leader
    up: np.ndarray  # [P * P]: partial sums towards the primary copy (round to-primary)
    down: np.ndarray  # [P * P]: totals back to the other copies (round totals)

    @classmethod
    def zeros(cls, nodes: int, P: int) -> _Loads:
        return cls(np.zeros((nodes, P)), np.zeros((nodes, P)), np.zeros(P), np.zeros(P), np.zeros(P),
                   np.zeros(P * P), np.zeros(P * P))
