"""The step protocol of one device, as a state machine: messages in, messages out, no Dask, no threads.

A synchronous step is a fixed sequence of rounds (`step_rounds`, the same on every
device for a plan). In each round every device sends exactly one message to every
peer the round links it with (`round_peers`: those that can have something for it;
the message is empty when it has nothing for one), and it moves on once it holds the
round's message from every one of them:

  REQUEST     the ids each trainer reads from a peer's copies (its own copies it reads
              without a message);
  RELAY_REQUEST  (scope `node`, several nodes) a node's requests for a row homed in
              another node went to one device of the node, the row's proxy (the device
              replica_device names for the row's home); each proxy asks each home once for
              the distinct rows of its whole node;
  RELAY_REPLY (scope `node`) the homes answer the proxies;
  REPLY       those rows, and device 0's dense parameters;
  GRADIENTS   after the forward and backward: each row's gradient to the copy it was read
              from (a relayed row's to its proxy), the partial sums of global rows to their
              node's leader, and the dense gradients to device 0;
  RELAY_GRADIENTS  (scope `node`) each proxy sums its node's gradients of a relayed row,
              in sender order, and sends the one sum to the row's home;
  EXCHANGE    (two nodes, replicated rows) each node's copy sends its node's partial sum to
              the other node's copy, and both apply the two partial sums added in node order;
              on three or more nodes instead:
  TO_PRIMARY  (several nodes, replicated rows) a non-home node's copy passes its node's
              partial sum to the row's home;
  TOTALS      (replicated rows) every home has summed its rows' contributions in sender
              order and applied them; it sends the totals of replicated rows to the other
              nodes' copies and, for global rows, to the devices of its node;
              a node row copied onto some nodes only is read by the others' trainers from
              its home, like a single row (relayed with scope node), and synced among its copies;
  FORWARD     (global rows, several nodes) a node's leader passes the totals it received
              (or, on two nodes, added) on inside its node.

Answered early (an option; scopes none and device): a trainer sends the next step's
REQUEST while this step waits (which rows a batch reads does not depend on their values),
and a device that would otherwise wait answers it at once with the rows as they are
(PREFETCH, outside the step's rounds). When the next step begins, its REPLY to that peer
only patches the answer: the requested rows updated since, by their positions in the
request. The hot rows a plan keeps local are the ones most steps change, so the patch is
the smaller part (13–14% of the bytes read on amazon-video), and the rows the trainer
computes on are exactly those a late answer would give.

Every copy applies the same total, so replicas stay bitwise equal; nothing is applied
before the last GRADIENTS message is in, so a step that fails before then changes
nothing. `StepProtocol` does the routing and the summing: each event (`start`, `receive`,
`gradients`) answers with typed instructions (`Send`, `Compute`, `Apply`, `ApplyDense`,
`EndStep`) that its host carries out in order. The rows live in a ParameterShard the
protocol only reads; the host writes it (`Apply`), and the forward and backward belong to
the host too (`Compute`, answered by `gradients`); both kinds of value are in
shardflow.training.messages. A driver moves the messages: `InProcess` for all devices in
one process (shardflow.training.inprocess), the Dask engine for a cluster.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import numpy as np
import torch

from shardflow.planner.sharding_plan import GLOBAL, DevicePlan, replica_device
from shardflow.training.messages import (
    NO_IDS,
    Block,
    Compute,
    Instruction,
    Kind,
    Message,
    PeerStopped,
    Round,
    Send,
    to_host,
)
from shardflow.training.relay import RelayRounds
from shardflow.training.step_core import Handled
from shardflow.training.steps import Phase, Reads, Requests, StepState


class StepProtocol(RelayRounds):
    """One device's side of every step; see the module's description of the rounds.

    Events, in order, each answered by a list of instructions: `start` (Send the REQUESTs),
    then `receive(round, inbox)` for each round — the updates it can apply now (Apply,
    ApplyDense), then the next round's Send, or after REPLY a Compute that `gradients`
    answers (Send the GRADIENTS), or after the last round EndStep. One phase at a time
    (`phase`); a step's state (`state`) is made when it starts and dropped when it ends.
    """

    # -- the events -----------------------------------------------------------------------
    def requests(self, step: int, fetch: dict[str, np.ndarray]) -> Requests:
        """What step `step` asks of each peer for the rows `fetch[table]` (the trainer's lookups, de-duplicated
        or not). Changes nothing: a driver may compute (and send) a step's requests while the step
        before is still under way, since which rows a batch reads does not depend on their values."""
        out = {p: Message(Round.REQUEST, step, self.device) for p in self.peers}
        owners = {}
        for table, ids in fetch.items():
            owner = self.maps[table].read_from(ids, self.device)
            if self.relay:  # a row from another node is asked of its proxy in this node
                away = self.topology.node_of_device[owner] != self.node
                owner[away] = replica_device(owner[away], self.topology, self.node)
            owners[table] = reads = Reads.split(ids, owner, self.device)
            for peer, at in reads.peers:
                out[peer].blocks.append(Block(Kind.LOOKUP, table, ids[at]))
        return Requests(step, owners, self._linked(Round.REQUEST, out))

    def start(self, requests: Requests) -> list[Instruction]:
        """Step `requests.step` begins (every earlier step applied here): send its REQUESTs."""
        step = requests.step
        if self.state is not None:
            raise RuntimeError(f"device {self.device}: step {step} started inside step {self.step}")
        self.shard.check_clock(step)
        self.state = StepState(step, requests.owners, {t: [] for t in self.tables}, sending=Round.REQUEST)
        return [Send(self._sent(Round.REQUEST, requests.outbox))]

    def answer_early(self, request: Message) -> Message:
        """A peer's REQUEST for the step after the one under way here (or, between steps, for the next
        one), answered now: its PREFETCH message. That step's REPLY to the peer then patches it."""
        clock = self.shard.clock
        if not self.early or request.round is not Round.REQUEST or request.step not in (clock, clock + 1):
            raise RuntimeError(f"device {self.device}: an early {request.round.value} for step {request.step} "
                               f"with parameters after step {clock}" + ("" if self.early else ", answering none early"))
        self._answered[request.sender] = (request.step, clock)
        out = Message(Round.PREFETCH, request.step, self.device, [self._rows(b) for b in request.blocks])
        out.count(self.traffic, request.sender)
        return out

    def take_early(self, answer: Message) -> None:
        """A peer's PREFETCH answer to this device's REQUEST of a step not begun yet."""
        if answer.round is not Round.PREFETCH:
            raise RuntimeError(f"device {self.device}: a {answer.round.value} message taken as an early answer")
        self._early[answer.sender] = answer

    def receive(self, round: Round, inbox: list[Message]) -> list[Instruction]:
        """The round's message from every peer in; what to do, in order: the updates to apply, then the next
        round's messages to send, or the trainer's work after REPLY (Compute), or the step's end."""
        if self.phase is not Phase.WAITING or round is not self._now.expect:
            expect = self._now.expect if self.phase is Phase.WAITING else None
            raise RuntimeError(f"device {self.device}: round {round.value} arrived, expected "
                               f"{expect.value if expect else 'no round'}")
        for m in inbox:
            if m.error is not None:
                self._reset()
                raise PeerStopped(m.error)
        senders = sorted(m.sender for m in inbox)
        if senders != list(self.round_peers[round]):
            raise RuntimeError(f"device {self.device}: round {round.value} from devices {senders}, "
                               f"expected {list(self.round_peers[round])}")
        for m in inbox:
            if m.step != self.step or m.round is not round:
                raise RuntimeError(f"device {self.device}: a message of step {m.step} round {m.round.value} in "
                                   f"step {self.step} round {round.value}")
        handlers: dict[Round, Callable[[list[Message]], Handled]] = {
            Round.REQUEST: self._on_relayed_requests if self.relay else self._on_requests,
            Round.RELAY_REQUEST: self._on_requests,
            Round.RELAY_REPLY: self._on_relay_replies,
            Round.REPLY: self._on_replies,
            Round.GRADIENTS: self._on_gradients,
            Round.RELAY_GRADIENTS: self._on_relay_gradients,
            Round.EXCHANGE: self._on_exchange,
            Round.TO_PRIMARY: self._on_to_primary,
            Round.TOTALS: self._on_totals,
            Round.FORWARD: self._on_forward,
        }
        self._todo = []
        then = handlers[round](inbox)
        todo, self._todo = self._todo, []
        todo.append(Send(then) if isinstance(then, dict) else then)
        return todo

    def gradients(self, rows: dict[str, torch.Tensor], dense: dict[str, torch.Tensor]) -> list[Instruction]:
        """The trainer's gradients of the rows it was given (same order) and of the dense parameters."""
        if self.phase is not Phase.COMPUTING:
            raise RuntimeError(f"device {self.device}: gradients outside step {self.step}'s compute")
        out = self._outbox(Round.GRADIENTS)
        for table, reads in self._now.fetch.items():
            ids, g, mine = reads.ids, rows[table], reads.mine
            if not reads.peers:  # every row its own: no peer to send to, nothing to select
                self._keep_own(table, ids, g)
                continue
            if mine.size:
                self._keep_own(table, ids[mine], g[torch.from_numpy(mine).to(g.device)])
            for peer, sel in reads.peers:
                values = to_host(g[torch.from_numpy(sel).to(g.device)])
                out[peer].blocks.append(Block(Kind.LOOKUP, table, ids[sel], values))
        for table in self.has_global:  # own partial sums of global rows, to the node's leader
            plan = self.tables[table]
            ids, total = self._take(table, partial(self._global_led_elsewhere, plan))
            self._blocks(out, table, Kind.SYNC, ids, total, self._holder(plan, ids, self.node))
        if self.device == 0:
            self._now.dense.append((0, dense))
        else:
            out[0].dense = {k: to_host(v) for k, v in dense.items()}
        self._now.phase = Phase.WAITING
        return [Send(self._sent(Round.GRADIENTS, out))]

    # -- the rounds -----------------------------------------------------------------------
    def _on_requests(self, inbox: list[Message]) -> dict[int, Message]:
        """The rows asked of this device's own copies (REQUEST; with scope node, RELAY_REQUEST)."""
        reply = Round.RELAY_REPLY if self.relay else Round.REPLY
        out = self._outbox(reply)
        for m in inbox:
            answered = self._answered.pop(m.sender, None)
            since = answered[1] if answered is not None and answered[0] == self.step else None  # the early answer
            out[m.sender].patch = since is not None
            for b in m.blocks:
                if since is None:
                    out[m.sender].blocks.append(self._rows(b))
                    continue
                at, rows = self.shard.changed_since(b.table, b.ids, since)
                if at.size:
                    out[m.sender].blocks.append(Block(Kind.PATCH, b.table, at, to_host(rows)))
            if self.device == 0 and not self.relay:
                out[m.sender].dense = {k: to_host(v) for k, v in self.shard.dense_layers.items()}
        return self._sent(reply, out)

    def _rows(self, request: Block) -> Block:
        """This device's rows of a REQUEST block, in the order asked for: the asker knows their ids, they
        do not travel back."""
        return Block(request.kind, request.table, NO_IDS, to_host(self.shard.read(request.table, request.ids)))

    def _on_replies(self, inbox: list[Message]) -> Compute:
        """The rows the trainer computes on, in `fetch` order, and the dense parameters."""
        by_peer = {m.sender: {b.table: b for b in m.blocks} for m in inbox}
        early = {}  # peer -> its PREFETCH blocks, which its REPLY patches
        for m in inbox:
            answer = self._early.pop(m.sender, None)
            if m.patch:
                if answer is None or answer.step != self.step:
                    raise RuntimeError(f"device {self.device}: a patch from device {m.sender} to no early answer "
                                       f"of step {self.step}")
                early[m.sender] = {b.table: b for b in answer.blocks}
        rows = {}
        for table, reads in self._now.fetch.items():
            ids, mine = reads.ids, reads.mine
            if not reads.peers:  # every row read from its own copies
                rows[table] = self._read(table, ids)
                continue
            r = torch.empty((ids.size, self.shard.dim), dtype=torch.float32, device=self.shard.device)
            if mine.size:
                r[torch.from_numpy(mine).to(r.device)] = self._read(table, ids[mine])
            for peer, at in reads.peers:
                if peer not in early:
                    r[torch.from_numpy(at).to(r.device)] = torch.from_numpy(by_peer[peer][table].values).to(r.device)
                    continue
                r[torch.from_numpy(at).to(r.device)] = torch.from_numpy(early[peer][table].values).to(r.device)
                patch = by_peer[peer].get(table)
                if patch is not None:
                    r[torch.from_numpy(at[patch.ids]).to(r.device)] = torch.from_numpy(patch.values).to(r.device)
            rows[table] = r
        if self.device == 0:
            dense = self.shard.dense_layers
        else:
            sent = next(m for m in inbox if m.sender == 0).dense or {}
            dense = {k: torch.from_numpy(v).to(self.shard.device) for k, v in sent.items()}
        self._now.expect, self._now.phase = Round.GRADIENTS, Phase.COMPUTING
        return Compute(rows, dense)

    def _on_gradients(self, inbox: list[Message]) -> Handled:
        self._accept(inbox)
        if self.relay:  # the node's gradients of relayed rows, summed here, go to their homes
            out = self._outbox(Round.RELAY_GRADIENTS)
            for table, plan in self.tables.items():
                ids, total = self._take(table, partial(self._is_relayed, table))
                self._blocks(out, table, Kind.LOOKUP, ids, total, plan.home_of(ids).astype(np.int64))
            self._now.relayed = {}
            return self._sent(Round.RELAY_GRADIENTS, out)
        return self._after_gradients()

    def _global_led_elsewhere(self, plan: DevicePlan, ids: np.ndarray) -> np.ndarray:
        """Which of `ids` are global rows whose node copy another device of this node holds (its leader)."""
        return (plan.tier_of(ids) == GLOBAL) & (self._holder(plan, ids, self.node) != self.device)

    def abort(self) -> None:
        """Forget the step under way (a peer failed) and every early answer; applied parameters are untouched."""
        self._forget_early()
        self._reset()

    def failed(self, error: BaseException) -> dict[int, Message] | None:
        """Messages telling every peer that this device stopped the step, for the round they wait on."""
        waiting, step = (None, None) if self.state is None else (self.state.sending, self.state.step)
        self._forget_early()
        self._reset()
        if waiting is None or step is None:
            return None
        return {p: Message(waiting, step, self.device, error=str(error)) for p in self.peers}
