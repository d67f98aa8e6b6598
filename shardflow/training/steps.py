"""What one step is on one device: its rounds under a plan, its phase, and the state it keeps.

`StepProtocol` (shardflow.training.protocol) moves a device from phase to phase; a
`StepState` is made when a step starts and dropped when it ends, so nothing of one step
reaches the next.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np
import torch

from shardflow.planner.sharding_plan import GLOBAL, NODE, DevicePlan, replica_device, step_round_names
from shardflow.planner.topology import Topology
from shardflow.training.messages import Message, Round

Contribution = tuple[int, np.ndarray, torch.Tensor]  # (sender, ids, gradients)


class Phase(enum.Enum):
    """Where one device is in the step protocol."""

    IDLE = "idle"  # between steps: every step it began is applied (or aborted)
    WAITING = "waiting"  # for the messages of round `StepState.expect`
    COMPUTING = "computing"  # the rows are in (REPLY); the trainer's forward and backward, until `gradients`


@dataclass(frozen=True)
class Reads:
    """One table's lookups of a step: the ids the trainer reads, split by the device it reads each from once
    (`requests`) for every round that needs them: the positions read from this device's own copies, and
    (peer, positions) for each other device read from, in device order."""

    ids: np.ndarray
    mine: np.ndarray
    peers: tuple[tuple[int, np.ndarray], ...]

    @classmethod
    def split(cls, ids: np.ndarray, owner: np.ndarray, device: int) -> Reads:
        here = owner == device
        if here.all():  # every row its own: nothing to split
            return cls(ids, np.arange(ids.size), ())
        others = np.unique(owner[~here]).tolist()
        return cls(ids, np.flatnonzero(here), tuple((p, np.flatnonzero(owner == p)) for p in others))


@dataclass
class StepState:
    """Everything one step keeps on one device, made fresh when the step starts and dropped when it ends."""

    step: int
    fetch: dict[str, Reads]  # table -> what the trainer reads, and from where
    pending: dict[str, list[Contribution]]  # table -> [(sender, ids, grads)] not yet summed
    phase: Phase = Phase.WAITING
    expect: Round | None = None  # the round whose messages come next
    sending: Round | None = None  # the round this device sends next (its peers wait for it)
    dense: list[tuple[int, dict[str, torch.Tensor]]] = field(default_factory=list)  # device 0: (sender, gradients)
    asked: list[Message] = field(default_factory=list)  # scope node: the REQUEST messages answered after the relay
    relayed: dict[str, tuple[np.ndarray, torch.Tensor]] = field(default_factory=dict)  # table -> (ids, rows) relayed
    relay_asked: dict[str, dict[int, np.ndarray]] = field(default_factory=dict)  # table -> {home: ids asked of it}
    partials: dict[str, tuple[np.ndarray, torch.Tensor]] = field(default_factory=dict)  # table -> this node's sums


@dataclass
class Requests:
    """A step's REQUEST messages and, per table, what the trainer reads and from where."""

    step: int
    owners: dict[str, Reads]
    outbox: dict[int, Message]


def step_rounds(tables: dict[str, DevicePlan], topology: Topology,
                dedup: str = "device") -> tuple[Round, ...]:
    """The rounds of every step under this plan and de-duplication scope (the same on every device)."""
    has_global = any(t.has_tier(GLOBAL) for t in tables.values())
    replicated = has_global or any(t.has_tier(NODE) for t in tables.values())
    return tuple(Round(name) for name in step_round_names(has_global, replicated, topology, dedup))


def round_peers(device: int, topology: Topology, rounds: tuple[Round, ...]) -> dict[Round, tuple[int, ...]]:
    """The peers `device` exchanges a message with in each round (the relation is the same both ways): the
    devices that can have something for it, or it for them, under any plan with these rounds.

    - REQUEST, REPLY, GRADIENTS: every peer (a trainer may read any device's rows), or with scope node
      only its node's devices (a row of another node is asked of its proxy here), and device 0 with every
      device (the dense parameters and their gradients);
    - RELAY_REQUEST, RELAY_REPLY, RELAY_GRADIENTS, EXCHANGE, TO_PRIMARY: the devices of other nodes that
      hold copies of the rows of the same homes as this device (`replica_device`): a proxy and a home, or
      two copies of one row;
    - TOTALS: those, and this node's devices (global rows' totals); FORWARD: this node's devices.

    A message to any other peer would be empty every step; not sending it saves a transport call each."""
    node = int(topology.node_of_device[device])
    start = int(topology.node_start[node])
    everyone = tuple(d for d in range(topology.devices) if d != device)
    node_peers = {d for d in range(start, start + int(topology.node_devices[node])) if d != device}
    homes = np.arange(topology.devices, dtype=np.int64)
    here = homes[replica_device(homes, topology, node) == device]  # homes whose rows this device holds here
    copies = {int(d) for other in range(len(topology.nodes)) if other != node
              for d in replica_device(here, topology, other)}
    dense = set(everyone) if device == 0 else {0}
    if Round.RELAY_REQUEST in rounds:
        near = node_peers | dense
    else:
        near = set(everyone)
    linked = {Round.REQUEST: near, Round.REPLY: near, Round.GRADIENTS: near, Round.RELAY_REQUEST: copies,
              Round.RELAY_REPLY: copies, Round.RELAY_GRADIENTS: copies, Round.EXCHANGE: copies,
              Round.TO_PRIMARY: copies, Round.TOTALS: copies | node_peers, Round.FORWARD: node_peers}
    return {r: tuple(sorted(linked[r])) for r in rounds}
