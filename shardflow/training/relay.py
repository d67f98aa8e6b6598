"""Scope node, several nodes: a node's proxies relay its requests and gradients for other nodes' rows (the
RELAY_REQUEST, RELAY_REPLY and RELAY_GRADIENTS rounds of shardflow.training.protocol).

The layer of StepProtocol that does it, over ReplicaSync's and StepCore's state and helpers.
"""

from __future__ import annotations

import numpy as np
import torch

from shardflow.training.messages import NO_IDS, Block, Kind, Message, Round, to_host
from shardflow.training.replicas import ReplicaSync
from shardflow.training.step_core import Handled


class RelayRounds(ReplicaSync):
    def _is_relayed(self, table: str, ids: np.ndarray) -> np.ndarray:
        """Which of `ids` this node reads from another node's home (a proxy relays them): single rows
        homed there, and node rows this node holds no copy of."""
        return ~self.maps[table].held_in(ids, self.node)

    def _on_relayed_requests(self, inbox: list[Message]) -> dict[int, Message]:
        """Keep the node's requests; ask each home once for the distinct rows this device relays."""
        self._now.asked = inbox
        wanted: dict[str, list[np.ndarray]] = {t: [] for t in self.tables}
        for m in inbox:
            for b in m.blocks:
                wanted[b.table].append(b.ids[self._is_relayed(b.table, b.ids)])
        for table, reads in self._now.fetch.items():  # this device's own trainer's relayed rows
            own = reads.ids[reads.mine]
            wanted[table].append(own[self._is_relayed(table, own)])
        out = self._outbox(Round.RELAY_REQUEST)
        self._now.relay_asked = {}
        for table, parts in wanted.items():
            ids = np.unique(np.concatenate(parts)) if parts else NO_IDS
            if not ids.size:
                continue
            home = self.tables[table].home_of(ids).astype(np.int64)
            self._now.relay_asked[table] = {}
            for peer in np.unique(home).tolist():
                self._now.relay_asked[table][peer] = ids[home == peer]
                out[peer].blocks.append(Block(Kind.LOOKUP, table, ids[home == peer]))
        return self._sent(Round.RELAY_REQUEST, out)

    def _on_relay_replies(self, inbox: list[Message]) -> dict[int, Message]:
        """The relayed rows are in: answer the node's requests, own copies and relayed rows alike."""
        by_peer = {m.sender: {b.table: b for b in m.blocks} for m in inbox}
        self._now.relayed = {}
        for table, asked in self._now.relay_asked.items():
            ids = np.concatenate(list(asked.values()))
            rows = np.concatenate([by_peer[peer][table].values for peer in asked])
            order = np.argsort(ids, kind="stable")
            self._now.relayed[table] = (ids[order], torch.from_numpy(rows[order]).to(self.shard.device))
        out = self._outbox(Round.REPLY)
        for m in self._now.asked:
            for b in m.blocks:
                out[m.sender].blocks.append(Block(b.kind, b.table, NO_IDS, to_host(self._read(b.table, b.ids))))
            if self.device == 0:
                out[m.sender].dense = {k: to_host(v) for k, v in self.shard.dense_layers.items()}
        self._now.asked = []
        return self._sent(Round.REPLY, out)

    def _read(self, table: str, ids: np.ndarray) -> torch.Tensor:
        """Rows of `ids` from this device's copies or, relayed, from the rows it fetched as a proxy."""
        if not self.relay:
            return self.shard.read(table, ids)
        relayed = self._is_relayed(table, ids)
        rows = torch.empty((ids.size, self.shard.dim), dtype=torch.float32, device=self.shard.device)
        own = np.flatnonzero(~relayed)
        if own.size:
            rows[torch.from_numpy(own).to(rows.device)] = self.shard.read(table, ids[own])
        far = np.flatnonzero(relayed)
        if far.size:
            held, values = self._now.relayed[table]
            at = torch.from_numpy(np.searchsorted(held, ids[far])).to(rows.device)
            rows[torch.from_numpy(far).to(rows.device)] = values[at]
        return rows

    def _on_relay_gradients(self, inbox: list[Message]) -> Handled:
        self._accept(inbox)
        return self._after_gradients()
