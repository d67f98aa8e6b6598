"""Replicated rows: after the gradients are in, every copy applies the same total, so replicas stay bitwise
equal (the EXCHANGE, or TO_PRIMARY and TOTALS, and FORWARD rounds of shardflow.training.protocol).

On two nodes (plan.exchanges_partials) each node's copy of a row sends its node's partial sum to the other
node's copy, and both add the two partial sums in node order: one round. On more nodes the partial sums go
to the home, which sums and applies them and sends the total back to the other copies: two rounds, so that
no partial sum crosses to more than one node.

The layer of StepProtocol that does it, over StepCore's state and helpers.
"""

from __future__ import annotations

from functools import partial

import numpy as np
import torch

from shardflow.planner.sharding_plan import GLOBAL, SINGLE, DevicePlan
from shardflow.training.messages import Apply, ApplyDense, Block, Kind, Message, Round, to_host
from shardflow.training.step_core import Handled, StepCore


def _replicated(plan: DevicePlan, ids: np.ndarray) -> np.ndarray:
    return plan.tier_of(ids) != SINGLE


class ReplicaSync(StepCore):
    def _after_gradients(self) -> Handled:
        if Round.EXCHANGE in self.rounds:
            return self._exchange_partials()
        if Round.TO_PRIMARY in self.rounds:
            out = self._outbox(Round.TO_PRIMARY)
            for table, plan in self.tables.items():
                ids, total = self._take(table, partial(self._copy_of_elsewhere, plan))
                self._check_held(plan, ids, "gradients of replicated rows it does not hold")
                self._blocks(out, table, Kind.SYNC, ids, total, plan.home_of(ids).astype(np.int64))
            return self._sent(Round.TO_PRIMARY, out)
        return self._apply_owned()

    def _copy_of_elsewhere(self, plan: DevicePlan, ids: np.ndarray) -> np.ndarray:
        """Which of `ids` are replicated rows homed on another device (this device holds a copy)."""
        return (plan.tier_of(ids) != SINGLE) & (plan.home_of(ids) != self.device)

    def _exchange_partials(self) -> dict[int, Message]:
        """Two nodes: this node's partial sums of the replicated rows this device holds, to the other node's
        copies; the rows only this device holds, and the dense parameters, are applied now."""
        out = self._outbox(Round.EXCHANGE)
        other = 1 - self.node
        self._now.partials = {}
        for table, plan in self.tables.items():
            ids, sums = self._take(table, partial(_replicated, plan))
            self._check_held(plan, ids, "gradients of replicated rows it does not hold")
            self._now.partials[table] = (ids, sums)
            there = self.maps[table].held_in(ids, other)
            self._blocks(out, table, Kind.SYNC, ids[there], sums[there], self._holder(plan, ids[there], other))
            self._apply_single(table, plan)
        self._apply_dense()
        return self._sent(Round.EXCHANGE, out)

    def _on_exchange(self, inbox: list[Message]) -> Handled:
        """Both nodes' partial sums, added in node order (the same sum on both copies); global rows' totals to
        the devices of this node."""
        out = self._outbox(Round.FORWARD)
        node_of = self.topology.node_of_device
        for table, (ids, sums) in self._now.partials.items():
            parts = [(self.node, ids, sums)] + [
                (int(node_of[m.sender]), b.ids, torch.from_numpy(b.values).to(self.shard.device))
                for m in inbox for b in m.blocks if b.table == table
            ]
            ids, total = self._combine(parts)
            if not ids.size:
                continue
            self._todo.append(Apply(table, ids, total, self._now.step))
            is_global = self.tables[table].tier_of(ids) == GLOBAL
            if is_global.any():
                values = to_host(total[torch.from_numpy(np.flatnonzero(is_global)).to(total.device)])
                for peer in self.node_peers:
                    out[peer].blocks.append(Block(Kind.SYNC, table, ids[is_global], values))
        self._now.partials = {}
        if Round.FORWARD not in self.rounds:
            return self._finish()
        return self._sent(Round.FORWARD, out)

    def _on_to_primary(self, inbox: list[Message]) -> Handled:
        self._accept(inbox)
        return self._apply_owned()

    def _apply_owned(self) -> Handled:
        """Sum and apply the rows this device owns; send replicated rows' totals to their other copies."""
        out = self._outbox(Round.TOTALS)
        for table, plan in self.tables.items():
            ids, total = self._apply_single(table, plan)
            if table not in self.replicated:
                continue
            replicated = np.flatnonzero(plan.tier_of(ids) != SINGLE)
            r_ids = ids[replicated]
            r_total = to_host(total[torch.from_numpy(replicated).to(total.device)])
            for node in range(len(self.topology.nodes)):
                if node != self.node and r_ids.size:
                    held = self.maps[table].held_in(r_ids, node)
                    self._blocks(out, table, Kind.SYNC, r_ids[held], r_total[held],
                                 self._holder(plan, r_ids[held], node))
            is_global = plan.tier_of(r_ids) == GLOBAL
            if is_global.any():
                for peer in self.node_peers:
                    out[peer].blocks.append(Block(Kind.SYNC, table, r_ids[is_global], r_total[is_global]))
        self._apply_dense()
        if Round.TOTALS not in self.rounds:
            return self._finish()
        return self._sent(Round.TOTALS, out)

    def _apply_single(self, table: str, plan: DevicePlan) -> tuple[np.ndarray, torch.Tensor]:
        """Sum and apply every contribution left for `table`: rows this device owns; (ids, totals)."""
        ids, total = self._take(table, lambda ids: np.ones(ids.size, dtype=bool))
        if ids.size and (plan.home_of(ids) != self.device).any():
            raise RuntimeError(f"device {self.device}: gradients left for rows it does not own")
        if ids.size:
            self._todo.append(Apply(table, ids, total, self._now.step))
        return ids, total

    def _apply_dense(self) -> None:
        """Device 0: the dense gradients of every trainer, summed in sender order, applied."""
        if self.device == 0:
            contributions = sorted(self._now.dense, key=lambda c: c[0])
            total = {k: v.clone() for k, v in contributions[0][1].items()}
            for _, grads in contributions[1:]:
                for k in total:
                    total[k] += grads[k].to(total[k].device)
            self._todo.append(ApplyDense(total))
        self._now.dense = []

    def _check_held(self, plan: DevicePlan, ids: np.ndarray, what: str) -> None:
        if ids.size and (self._holder(plan, ids, self.node) != self.device).any():
            raise RuntimeError(f"device {self.device}: {what}")

    def _on_totals(self, inbox: list[Message]) -> Handled:
        out = self._outbox(Round.FORWARD)
        for m in inbox:
            for b in m.blocks:
                if b.ids.size:
                    self._todo.append(Apply(b.table, b.ids, torch.from_numpy(b.values).to(self.shard.device),
                                            self._now.step))
                if self.topology.node_of_device[m.sender] == self.node:
                    continue
                is_global = self.tables[b.table].tier_of(b.ids) == GLOBAL
                if is_global.any():
                    for peer in self.node_peers:
                        out[peer].blocks.append(Block(Kind.SYNC, b.table, b.ids[is_global], b.rows[is_global]))
        if Round.FORWARD not in self.rounds:
            return self._finish()
        return self._sent(Round.FORWARD, out)

    def _on_forward(self, inbox: list[Message]) -> Handled:
        for m in inbox:
            for b in m.blocks:
                if b.ids.size:
                    self._todo.append(Apply(b.table, b.ids, torch.from_numpy(b.values).to(self.shard.device),
                                            self._now.step))
        return self._finish()
