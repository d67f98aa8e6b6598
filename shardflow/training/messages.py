"""What the devices of a step send each other, and what the step protocol asks its host to do.

A round's `Message` from one device to one peer holds typed `Block`s, one table each,
counted by `Kind` into `Traffic` (the cost model prices LOOKUP and SYNC: `Traffic.modeled_bytes`). The protocol
(shardflow.training.protocol) answers each event with `Instruction`s its host carries
out in order.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np
import torch

from shardflow.errors import TrainingError


class Round(enum.Enum):
    REQUEST = "request"
    RELAY_REQUEST = "relay-request"
    RELAY_REPLY = "relay-reply"
    REPLY = "reply"
    GRADIENTS = "gradients"
    RELAY_GRADIENTS = "relay-gradients"
    TO_PRIMARY = "to-primary"
    EXCHANGE = "exchange"
    TOTALS = "totals"
    FORWARD = "forward"
    PREFETCH = "prefetch"  # not a round of the step: an early answer to the next step's REQUEST


class Kind(enum.Enum):
    """What the bytes of a block are counted as (the cost model's terms)."""

    LOOKUP = "lookup"  # a trainer's reads and the gradients of what it read
    SYNC = "sync"  # partial sums and totals between the copies of replicated rows
    DENSE = "dense"  # dense parameters and their gradients
    EVAL = "eval"  # reads of the evaluation (outside any step)
    PATCH = "patch"  # rows changed after an early answer carried them, sent again


@dataclass(frozen=True)
class Traffic:
    """Bytes sent, one [sender, receiver] matrix per Kind: what one device's protocol counts (it adds to the
    matrices in place), or, added up, what every device sent."""

    lookup: np.ndarray
    sync: np.ndarray
    dense: np.ndarray
    eval: np.ndarray
    patch: np.ndarray

    @classmethod
    def zeros(cls, devices: int) -> Traffic:
        return cls(**{k.value: np.zeros((devices, devices)) for k in Kind})

    def of(self, kind: Kind) -> np.ndarray:
        return getattr(self, kind.value)

    def copy(self) -> Traffic:
        return Traffic(**{k.value: self.of(k).copy() for k in Kind})

    def sums(self) -> dict[str, float]:
        """Bytes per kind, every sender and receiver together."""
        return {k.value: float(self.of(k).sum()) for k in Kind}

    def __add__(self, other: Traffic) -> Traffic:
        return Traffic(**{k.value: self.of(k) + other.of(k) for k in Kind})

    @property
    def modeled_bytes(self) -> float:
        """What the cost model prices: lookups and sync (dense and eval it does not)."""
        return float(self.lookup.sum() + self.sync.sum())


class PeerStopped(TrainingError):
    """Another device stopped the step; the message is that device's own error."""


NO_IDS = np.zeros(0, dtype=np.int64)


@dataclass
class Block:
    """One table's ids (and rows or gradients) inside a message."""

    kind: Kind
    table: str
    ids: np.ndarray  # NO_IDS in a REPLY: its rows come in the order the REQUEST named them; a patch: positions
    values: np.ndarray | None = None  # [rows, dim] float32; None in a REQUEST

    @property
    def rows(self) -> np.ndarray:
        """The block's rows or gradients; a RuntimeError for a REQUEST's block, which carries none."""
        if self.values is None:
            raise RuntimeError(f"a {self.kind.value} block of {self.table} carries ids only")
        return self.values

    @property
    def nbytes(self) -> int:
        return self.ids.nbytes + (0 if self.values is None else self.values.nbytes)


@dataclass
class Message:
    """Everything one device sends one peer in one round of one step."""

    round: Round
    step: int
    sender: int
    blocks: list[Block] = field(default_factory=list)
    dense: dict[str, np.ndarray] | None = None  # device 0's parameters (REPLY) or a trainer's gradients
    error: str | None = None  # the sender stopped this step: why
    patch: bool = False  # a REPLY that patches the sender's PREFETCH answer (its blocks are patches)

    def count(self, traffic: Traffic, receiver: int) -> None:
        """Add this message's bytes to its kinds' [sender, receiver] in `traffic`."""
        for b in self.blocks:
            traffic.of(b.kind)[self.sender, receiver] += b.nbytes
        if self.dense is not None:
            traffic.dense[self.sender, receiver] += sum(v.nbytes for v in self.dense.values())


# The instructions an event answers with, carried out in order by the protocol's host (a Device): the shard is
# written by whoever carries them out, never by the protocol itself (it only reads the shard).
@dataclass(frozen=True)
class Send:
    """Send each peer the round links this device with its message of the round (empty when there is nothing
    for it)."""

    outbox: dict[int, Message]


@dataclass(frozen=True)
class Compute:
    """The REPLY round is in: the trainer computes on these rows (per table, in its lookups' order) and dense
    parameters, and answers with `StepProtocol.gradients`."""

    rows: dict[str, torch.Tensor]
    dense: dict[str, torch.Tensor]


@dataclass(frozen=True)
class Apply:
    """Update rows `ids` (distinct, ascending) of `table` with their summed gradients, as of `step`."""

    table: str
    ids: np.ndarray
    grads: torch.Tensor
    step: int


@dataclass(frozen=True)
class ApplyDense:
    """Update the dense parameters (device 0) with the gradients summed over every trainer."""

    grads: dict[str, torch.Tensor]


@dataclass(frozen=True)
class EndStep:
    """Every update of `step` is applied on this device: its clock moves on."""

    step: int


Instruction = Send | Compute | Apply | ApplyDense | EndStep


def to_host(x: torch.Tensor) -> np.ndarray:
    return x.detach().cpu().numpy()
