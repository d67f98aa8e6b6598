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

from shardflow.planner.plan import GLOBAL, NODE, DevicePlan, step_round_names
from shardflow.planner.topology import Topology
from shardflow.training.messages import Message, Round


class Phase(enum.Enum):
    """Where one device is in the step protocol."""

    IDLE = "idle"  # between steps: every step it began is applied (or aborted)
    WAITING = "waiting"  # for the messages of round `StepState.expect`
    COMPUTING = "computing"  # the rows are in (REPLY); the trainer's forward and backward, until `gradients`


@dataclass
class StepState:
    """Everything one step keeps on one device, made fresh when the step starts and dropped when it ends."""

    step: int
    fetch: dict[str, tuple[np.ndarray, np.ndarray]]  # table -> (ids the trainer reads, the device it reads each from)
    pending: dict[str, list]  # table -> [(sender, ids, grads)] not yet summed
    phase: Phase = Phase.WAITING
    expect: Round | None = None  # the round whose messages come next
    sending: Round | None = None  # the round this device sends next (its peers wait for it)
    dense: list[tuple[int, dict]] = field(default_factory=list)  # (sender, dense gradients), device 0
    asked: list = field(default_factory=list)  # scope node: the REQUEST messages answered after the relay
    relayed: dict[str, tuple[np.ndarray, torch.Tensor]] = field(default_factory=dict)  # table -> (ids, rows) relayed
    relay_asked: dict[str, dict[int, np.ndarray]] = field(default_factory=dict)  # table -> {home: ids asked of it}
    partials: dict[str, tuple[np.ndarray, torch.Tensor]] = field(default_factory=dict)  # table -> this node's sums


@dataclass
class Requests:
    """A step's REQUEST messages and, per table, the ids the trainer needs and the device it reads each from."""

    step: int
    owners: dict[str, tuple[np.ndarray, np.ndarray]]
    outbox: dict[int, Message]


def step_rounds(tables: dict[str, DevicePlan], topology: Topology,
                dedup: str = "device") -> tuple[Round, ...]:
    """The rounds of every step under this plan and de-duplication scope (the same on every device)."""
    has_global = any(t.has_tier(GLOBAL) for t in tables.values())
    replicated = has_global or any(t.has_tier(NODE) for t in tables.values())
    return tuple(Round(name) for name in step_round_names(has_global, replicated, topology, dedup))
