"""A click log's small tables fused into one for the step: read, sent, summed and updated as one table.

A step does the same few operations for every table it reads: split its ids by owner, read
rows, scatter the replies, send the gradients, sum them and update the rows, each a
Python call and a few tensor or numpy kernels of tens of microseconds. A DLRM reads many
small tables (MovieLens: nine, Criteo: 26), so those calls, not arithmetic, set its step:
in one process a device's 512 examples took 4.9 ms, its 1,024 on one device 5.3. FBGEMM's
table-batched embeddings answer the same cost on GPUs by laying many tables out as one.

Here the tables of a `TableGroup` get consecutive id ranges of one table, FUSED (table t's
row i is FUSED's row offsets[t] + i), whose plan is theirs one after another: every row
keeps its tier and home, so the rows a device stores, the bytes a step sends and the sums it
applies are those of the tables. The step protocol sees FUSED and the tables left out of the
group; the shard stores FUSED's rows as one tensor, each table's rows a view of it
(shardflow.training.shard), so checkpoints, warm starts, exports and re-homing, which read
and write tables, do not change. The sequence model is not fused: it reads one large item
table and few others.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from shardflow.data.batches import Lookups
from shardflow.model.configs import FUSED, ClickIndex
from shardflow.planner.sharding_plan import SINGLE, DevicePlan, TablePlan

FUSE_ROWS = 1 << 22  # at most this many rows fused: a fused table's plan is spelled out, 2 bytes a row


@dataclass(frozen=True)
class TableGroup:
    """The tables fused into FUSED, in the model's order, the fused id of each one's row 0, and FUSED's plan."""

    tables: tuple[str, ...]
    offsets: dict[str, int]
    plan: TablePlan

    @classmethod
    def of(cls, plans: dict[str, DevicePlan], features: tuple[str, ...], devices: int) -> TableGroup | None:
        """The group of `features`' tables (the model's order) that fit FUSE_ROWS together, the first that fit
        first; None when fewer than two do (nothing to gain)."""
        tables, offsets, total = [], {}, 0
        for t in features:
            if total + plans[t].rows <= FUSE_ROWS:
                tables.append(t)
                offsets[t] = total
                total += plans[t].rows
        if len(tables) < 2:
            return None
        home = np.int8 if devices <= 127 else np.int16 if devices <= 32767 else np.int32  # as for_devices
        parts = [_spelled_out(plans[t], home) for t in tables]
        plan = TablePlan(
            FUSED,
            np.concatenate([p.tier for p in parts]),
            np.concatenate([p.home for p in parts]),
            np.concatenate([p.partial_ids + offsets[t] for p, t in zip(parts, tables, strict=True)]),
            np.concatenate([p.partial_nodes for p in parts]),
        )
        return cls(tuple(tables), offsets, plan)

    def step_plans(self, plans: dict[str, DevicePlan]) -> dict[str, DevicePlan]:
        """The plans the step protocol takes: FUSED's, then those of the tables left out."""
        return {FUSED: self.plan, **{t: p for t, p in plans.items() if t not in self.offsets}}

    def fuse(self, need: Lookups) -> Lookups:
        """A sub-batch's lookups of the tables, as lookups of FUSED: its ids the tables' ids moved to their
        ranges one table after another, each lookup's position moved with them; the one-id tables' positions
        gathered into the index's `fused` block."""
        index: ClickIndex = need.index
        fetch = {t: ids for t, ids in need.fetch.items() if t not in self.offsets}
        parts, singles, moved = [], {}, {}
        start = 0
        for t in self.tables:
            ids, at = need.fetch[t], index.features[t]
            parts.append(ids + self.offsets[t])
            if at.ndim == 1:
                singles[t] = at + start
            else:  # a table of token sequences: its padding stays -1
                moved[t] = np.where(at >= 0, at + start, -1)
            start += ids.size
        fetch[FUSED] = np.concatenate(parts)
        rest = {t: moved.get(t, at) for t, at in index.features.items() if t not in singles}
        head = ["(numeric)"] if index.numeric.shape[1] else []
        model = [*head, *index.features]  # the vectors as the model stacks them: numeric, then each table
        position = {v: k for k, v in enumerate([*head, *singles, *rest])}  # as _fused_vectors concatenates them
        order = np.array([position[v] for v in model], dtype=np.int64)
        fused = (np.stack(list(singles.values()), axis=1) if singles
                 else np.zeros((index.labels.size, 0), dtype=np.int64))
        same = bool((order == np.arange(order.size)).all())
        return Lookups(fetch=fetch, index=replace(index, features=rest, fused=fused,
                                                  order=np.zeros(0, dtype=np.int64) if same else order))


def _spelled_out(plan: DevicePlan, home: type) -> TablePlan:
    """A device's plan of a table as a TablePlan (a rule's tiers and homes written out row by row)."""
    if isinstance(plan, TablePlan):
        return TablePlan(plan.name, plan.tier, plan.home.astype(home), plan.partial_ids, plan.partial_nodes)
    every = np.arange(plan.rows, dtype=np.int64)
    return TablePlan(plan.name, np.full(plan.rows, SINGLE, dtype=np.int8), plan.home_of(every).astype(home))
