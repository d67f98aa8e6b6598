"""Replicated rows: after the gradients are in, every copy applies the same total, so replicas stay bitwise
equal (the EXCHANGE, or TO_PRIMARY and TOTALS, and FORWARD rounds of shardflow.training.protocol).

On two nodes (plan.exchanges_partials) each node's copy of a row sends its node's partial sum to the other
node's copy, and both add the two partial sums in node order: one round. On more nodes the partial sums go
to the home, which sums and applies them and sends the total back to the other copies: two rounds, so that
no partial sum crosses to more than one node.

The part of StepProtocol that does it; it uses the protocol's state and helpers.
"""

from __future__ import annotations

import numpy as np
import torch

from shardflow.planner.sharding_plan import GLOBAL, SINGLE
from shardflow.training.messages import Apply, ApplyDense, Block, Kind, Message, Round, to_host


class ReplicaSync:
    def _after_gradients(self):
        if Round.EXCHANGE in self.rounds:
            return self._exchange_partials()
        if Round.TO_PRIMARY in self.rounds:
            out = self._outbox(Round.TO_PRIMARY)
            for table, plan in self.tables.items():
                ids, total = self._take(table, lambda ids, plan=plan: (plan.tier_of(ids) != SINGLE)
                                        & (plan.home_of(ids) != self.device))
                self._check_held(plan, ids, "gradients of replicated rows it does not hold")
                self._blocks(out, table, Kind.SYNC, ids, total, plan.home_of(ids).astype(np.int64))
            return self._sent(Round.TO_PRIMARY, out)
        return self._apply_owned()

    def _exchange_partials(self) -> dict[int, Message]:
        """Two nodes: this node's partial sums of the replicated rows this device holds, to the other node's
        copies; the rows only this device holds, and the dense parameters, are applied now."""
        out = self._outbox(Round.EXCHANGE)
        other = 1 - self.node
        self.state.partials = {}
        for table, plan in self.tables.items():
            ids, partial = self._take(table, lambda ids, plan=plan: plan.tier_of(ids) != SINGLE)
            self._check_held(plan, ids, "gradients of replicated rows it does not hold")
            self.state.partials[table] = (ids, partial)
            there = self.maps[table].held_in(ids, other)
            self._blocks(out, table, Kind.SYNC, ids[there], partial[there], self._holder(plan, ids[there], other))
            self._apply_single(table, plan)
        self._apply_dense()
        return self._sent(Round.EXCHANGE, out)

    def _on_exchange(self, inbox: list[Message]):
        """Both nodes' partial sums, added in node order (the same sum on both copies); global rows' totals to
        the devices of this node."""
        out = self._outbox(Round.FORWARD)
        node_of = self.topology.node_of_device
        for table, (ids, partial) in self.state.partials.items():
            parts = [(self.node, ids, partial)] + [
                (int(node_of[m.sender]), b.ids, torch.from_numpy(b.values).to(self.shard.device))
                for m in inbox for b in m.blocks if b.table == table
            ]
            ids, total = self._combine(parts)
            if not ids.size:
                continue
            self._todo.append(Apply(table, ids, total, self.step))
            is_global = self.tables[table].tier_of(ids) == GLOBAL
            if is_global.any():
                values = to_host(total[torch.from_numpy(np.flatnonzero(is_global)).to(total.device)])
                for peer in self.node_peers:
                    out[peer].blocks.append(Block(Kind.SYNC, table, ids[is_global], values))
        self.state.partials = {}
        if Round.FORWARD not in self.rounds:
            return self._finish()
        return self._sent(Round.FORWARD, out)

    def _on_to_primary(self, inbox: list[Message]):
        self._accept(inbox)
        return self._apply_owned()

    def _apply_owned(self):
        """Sum and apply the rows this device owns; send replicated rows' totals to their other copies."""
        out = self._outbox(Round.TOTALS)
        for table, plan in self.tables.items():
            ids, total = self._apply_single(table, plan)
            replicated = np.flatnonzero(plan.tier_of(ids) != SINGLE)
            r_ids = ids[replicated]
            r_total = to_host(total[torch.from_numpy(replicated).to(total.device)]) if replicated.size else None
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

    def _apply_single(self, table: str, plan) -> tuple[np.ndarray, torch.Tensor]:
        """Sum and apply every contribution left for `table`: rows this device owns; (ids, totals)."""
        ids, total = self._take(table, lambda ids: np.ones(ids.size, dtype=bool))
        if ids.size and (plan.home_of(ids) != self.device).any():
            raise RuntimeError(f"device {self.device}: gradients left for rows it does not own")
        if ids.size:
            self._todo.append(Apply(table, ids, total, self.step))
        return ids, total

    def _apply_dense(self) -> None:
        """Device 0: the dense gradients of every trainer, summed in sender order, applied."""
        if self.device == 0:
            contributions = sorted(self.state.dense, key=lambda c: c[0])
            total = {k: v.clone() for k, v in contributions[0][1].items()}
            for _, grads in contributions[1:]:
                for k in total:
                    total[k] += grads[k].to(total[k].device)
            self._todo.append(ApplyDense(total))
        self.state.dense = []

    def _check_held(self, plan, ids: np.ndarray, what: str) -> None:
        if ids.size and (self._holder(plan, ids, self.node) != self.device).any():
            raise RuntimeError(f"device {self.device}: {what}")

    def _on_totals(self, inbox: list[Message]):
        out = self._outbox(Round.FORWARD)
        for m in inbox:
            for b in m.blocks:
                if b.ids.size:
                    self._todo.append(Apply(b.table, b.ids, torch.from_numpy(b.values).to(self.shard.device),
                                            self.step))
                if self.topology.node_of_device[m.sender] == self.node:
                    continue
                is_global = self.tables[b.table].tier_of(b.ids) == GLOBAL
                if is_global.any():
                    for peer in self.node_peers:
                        out[peer].blocks.append(Block(Kind.SYNC, b.table, b.ids[is_global], b.values[is_global]))
        if Round.FORWARD not in self.rounds:
            return self._finish()
        return self._sent(Round.FORWARD, out)

    def _on_forward(self, inbox: list[Message]):
        for m in inbox:
            for b in m.blocks:
                if b.ids.size:
                    self._todo.append(Apply(b.table, b.ids, torch.from_numpy(b.values).to(self.shard.device),
                                            self.step))
        return self._finish()
