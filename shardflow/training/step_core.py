"""What every round of the step protocol shares: one device's place in the topology, the step under way, and
the helpers that build, count and sum the round's messages.

The rounds themselves build on it in layers: `ReplicaSync` (shardflow.training.replicas) syncs the copies of
replicated rows, `RelayRounds` (shardflow.training.relay) relays a node's requests and gradients, and
`StepProtocol` (shardflow.training.protocol) adds the events and the REQUEST, REPLY and GRADIENTS rounds.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from shardflow.planner.sharding_plan import GLOBAL, NODE, DevicePlan, replica_device
from shardflow.planner.shardmap import ShardMap
from shardflow.planner.topology import Topology
from shardflow.training.messages import (
    Block,
    Compute,
    EndStep,
    Instruction,
    Kind,
    Message,
    Round,
    Traffic,
    to_host,
)
from shardflow.training.shard import ParameterShard
from shardflow.training.steps import Contribution, Phase, StepState, round_peers, step_rounds

Handled = dict[int, Message] | Compute | EndStep  # what a round's handler answers: the next round's outbox, or not


def combine(contributions: list[Contribution], dim: int, device: torch.device) -> tuple[np.ndarray, torch.Tensor]:
    """Sum (sender, ids, grads) contributions per distinct id, in sender order; (ids, sums)."""
    if not contributions:
        return np.zeros(0, dtype=np.int64), torch.zeros((0, dim), dtype=torch.float32, device=device)
    contributions = sorted(contributions, key=lambda c: c[0])  # stable: a sender's own order is kept
    ids = np.concatenate([c[1] for c in contributions])
    grads = torch.cat([c[2] for c in contributions])
    if (ids[1:] > ids[:-1]).all():  # ascending, so distinct (one de-duplicated contribution): nothing to sum
        return ids, grads
    distinct, where = _distinct(ids)
    total = torch.zeros((distinct.size, dim), dtype=grads.dtype, device=device)
    total.index_add_(0, torch.from_numpy(where).to(device), grads)
    return distinct, total


def _distinct(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """np.unique(ids, return_inverse=True), in about 2/3 of its time on a step's few hundred ids (it reshapes and
    checks more than one sort needs)."""
    order = np.argsort(ids, kind="stable")
    ordered = ids[order]
    first = np.empty(ids.size, dtype=bool)
    first[:1] = True
    np.not_equal(ordered[1:], ordered[:-1], out=first[1:])
    where = np.empty(ids.size, dtype=np.int64)
    where[order] = np.cumsum(first) - 1
    return ordered[first], where


class StepCore:
    """One device's side of the step protocol, less its rounds: who it is, what it exchanges with whom, and the
    step under way (`state`, None between steps)."""

    def __init__(self, device: int, topology: Topology, tables: dict[str, DevicePlan], shard: ParameterShard,
                 maps: dict[str, ShardMap] | None = None, dedup: str = "device", early: bool = False) -> None:
        self.device, self.topology, self.tables, self.shard = device, topology, tables, shard
        self.maps = maps if maps is not None else {t: ShardMap(p, topology) for t, p in tables.items()}
        # the tables with rows of each replicated tier, found once (a plan's has_tier reads every row): a round skips
        # a table's replica work when it has none
        self.has_global = [t for t, p in tables.items() if p.has_tier(GLOBAL)]
        self.replicated = set(self.has_global) | {t for t, p in tables.items() if p.has_tier(NODE)}
        self.node = int(topology.node_of_device[device])
        self.peers = [d for d in range(topology.devices) if d != device]
        start = int(topology.node_start[self.node])
        self.node_peers = [d for d in range(start, start + int(topology.node_devices[self.node])) if d != device]
        self.rounds = step_rounds(tables, topology, dedup)
        self.relay = Round.RELAY_REQUEST in self.rounds
        self.round_peers = round_peers(device, topology, self.rounds)
        self.early = early and not self.relay and topology.devices > 1  # answers REQUESTs early (PREFETCH)
        self.traffic = Traffic.zeros(topology.devices)
        self._todo: list[Instruction] = []  # a round's updates and the step's end, as its handler finds them
        self._forget_early()
        self._reset()

    def _forget_early(self) -> None:
        self._answered: dict[int, tuple[int, int]] = {}  # peer -> (step it asked for, this clock when answered)
        self._early: dict[int, Message] = {}  # peer -> its PREFETCH answer to this device's next REQUEST

    def _reset(self) -> None:
        self.state: StepState | None = None

    @property
    def step(self) -> int | None:
        """The step under way on this device (None between steps)."""
        return None if self.state is None else self.state.step

    @property
    def phase(self) -> Phase:
        return Phase.IDLE if self.state is None else self.state.phase

    @property
    def expecting(self) -> Round | None:
        """The round whose messages this device waits for (None between steps)."""
        return None if self.state is None else self.state.expect

    @property
    def _now(self) -> StepState:
        """The step under way; a RuntimeError between steps (a round's helper called outside one)."""
        if self.state is None:
            raise RuntimeError(f"device {self.device}: no step under way")
        return self.state

    def _finish(self) -> EndStep:
        now = self._now
        left = {t: len(p) for t, p in now.pending.items() if p}
        if left or now.dense:
            raise RuntimeError(f"device {self.device}: step {now.step} ends with unapplied gradients {left}")
        self._reset()
        return EndStep(now.step)

    def _outbox(self, round: Round) -> dict[int, Message]:
        return {p: Message(round, self._now.step, self.device) for p in self.peers}

    def _linked(self, round: Round, out: dict[int, Message]) -> dict[int, Message]:
        """The outbox's messages to the peers `round` links this device with; a message with something for any
        other peer is a RuntimeError (round_peers would not have it waited for)."""
        linked = self.round_peers[round]
        for peer, m in out.items():
            if peer not in linked and (m.blocks or m.dense is not None):
                raise RuntimeError(f"device {self.device}: round {round.value} has a message for device {peer}, "
                                   f"which the round does not link it with ({list(linked)})")
        return {peer: out[peer] for peer in linked}

    def _sent(self, round: Round, out: dict[int, Message]) -> dict[int, Message]:
        """Count the outbox's bytes; its round is the one to receive next, the one after it the next to send."""
        out = self._linked(round, out)
        for peer, m in out.items():
            m.count(self.traffic, peer)
        i = self.rounds.index(round)
        self._now.expect, self._now.sending = round, self.rounds[i + 1] if i + 1 < len(self.rounds) else None
        return out

    def _accept(self, inbox: list[Message]) -> None:
        now = self._now
        for m in inbox:
            for b in m.blocks:
                now.pending[b.table].append((m.sender, b.ids, torch.from_numpy(b.values).to(self.shard.device)))
            if m.dense is not None:
                grads = {k: torch.from_numpy(v).to(self.shard.device) for k, v in m.dense.items()}
                now.dense.append((m.sender, grads))

    def _keep_own(self, table: str, ids: np.ndarray, grads: torch.Tensor) -> None:
        self._now.pending[table].append((self.device, ids, grads))

    def _take(self, table: str, select: Callable[[np.ndarray], np.ndarray]) -> tuple[np.ndarray, torch.Tensor]:
        """Remove the pending contributions for ids where `select(ids)`; (distinct ids, sums in sender order)."""
        kept, taken = [], []
        for sender, ids, grads in self._now.pending[table]:
            mask = select(ids)
            if mask.all():
                taken.append((sender, ids, grads))
                continue
            if not mask.any():  # kept whole, not copied
                kept.append((sender, ids, grads))
                continue
            taken.append((sender, ids[mask], grads[torch.from_numpy(np.flatnonzero(mask)).to(grads.device)]))
            kept.append((sender, ids[~mask], grads[torch.from_numpy(np.flatnonzero(~mask)).to(grads.device)]))
        self._now.pending[table] = kept
        return self._combine(taken)

    def _combine(self, contributions: list[Contribution]) -> tuple[np.ndarray, torch.Tensor]:
        return combine(contributions, self.shard.dim, self.shard.device)

    def _blocks(self, out: dict[int, Message], table: str, kind: Kind, ids: np.ndarray,
                values: np.ndarray | torch.Tensor, dest: np.ndarray) -> None:
        """One block per destination device for the ids `dest` names."""
        if not ids.size:
            return
        host = values if isinstance(values, np.ndarray) else to_host(values)
        for peer in np.unique(dest).tolist():
            sel = np.flatnonzero(dest == peer)
            out[peer].blocks.append(Block(kind, table, ids[sel], host[sel]))

    def _holder(self, plan: DevicePlan, ids: np.ndarray, node: int) -> np.ndarray:
        return replica_device(plan.home_of(ids).astype(np.int64), self.topology, node)
