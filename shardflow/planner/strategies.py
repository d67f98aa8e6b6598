"""Sharding strategies: one protocol, one verb, compared like for like.

    plan(accesses, topology, budget_bytes, model) -> ShardingPlan

None mutates its inputs. `propose` runs one by name and refuses a plan that does not
fit the per-device budget, naming the shortfall.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from itertools import pairwise
from typing import Protocol

import numpy as np

from shardflow.errors import InputError
from shardflow.planner.access import TableAccess
from shardflow.planner.costmodel import CostModel
from shardflow.planner.memory import check_capacity, slack_budget_bytes
from shardflow.planner.placement import place, tiers_from_counts
from shardflow.planner.refine import pack_tables, table_home_seconds
from shardflow.planner.relaxation import best_tiers, tier_costs
from shardflow.planner.sharding_plan import SINGLE, ShardingPlan, TablePlan
from shardflow.planner.topology import Topology

# What a refusal for memory accepts: named as the run's config and the plan command spell it.
MORE_MEMORY = "a larger device_memory_bytes or memory_slack (plan.memory_slack, --memory-slack)"
# FlexShard's knapsack counts memory summed over devices; when a placement then overfills a
# device (round-robin rounding, or a small node holding a copy of every node row), it
# retries with fewer spare slots, this many times before giving up replication.
FIT_RETRIES = 12
# Memory slacks (over row-wise-mod's rows per device) at which FlexShard also plans when its budget
# is larger: a plan made at one of them is a candidate under every larger budget, so more memory
# never makes its plan slower than at these slacks.
SLACK_LADDER = (0.0, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0)


class Strategy(Protocol):
    name: str

    def plan(
        self, accesses: list[TableAccess], topology: Topology, budget_bytes: int, model: CostModel
    ) -> ShardingPlan: ...


def _single(name: str, rows: int, home: np.ndarray) -> TablePlan:
    return TablePlan(name, np.full(rows, SINGLE, dtype=np.int8), home.astype(np.int32))


class RowWiseMod:
    """Caffe2's parameter-server sharding: shard = id % S, local row = id // S."""

    name = "row-wise-mod"

    def plan(
        self, accesses: list[TableAccess], topology: Topology, budget_bytes: int, model: CostModel
    ) -> ShardingPlan:
        P = topology.devices
        return ShardingPlan(self.name, tuple(_single(a.name, a.rows, np.arange(a.rows) % P) for a in accesses))


class RowWiseBlock:
    """TorchRec's row-wise: device d holds the contiguous rows [d·ceil(R/S), (d+1)·ceil(R/S))."""

    name = "row-wise-block"

    def plan(
        self, accesses: list[TableAccess], topology: Topology, budget_bytes: int, model: CostModel
    ) -> ShardingPlan:
        P = topology.devices
        return ShardingPlan(
            self.name, tuple(_single(a.name, a.rows, np.arange(a.rows) // math.ceil(a.rows / P)) for a in accesses)
        )


class TableWise:
    """Whole tables to devices: a bin-packing by size and by modeled link time (refine.pack_tables),
    the heaviest tables first, then moves and swaps while the busiest link gets less busy."""

    name = "table-wise"

    def plan(
        self, accesses: list[TableAccess], topology: Topology, budget_bytes: int, model: CostModel
    ) -> ShardingPlan:
        budget_rows = budget_bytes // model.shape.row_bytes
        rows = np.array([a.rows for a in accesses], dtype=np.int64)
        homes = pack_tables(table_home_seconds(accesses, model), rows, budget_rows)
        if homes is None:
            big = int(np.argmax(rows))
            if rows[big] > budget_rows:
                need = int(rows[big]) * model.shape.row_bytes
                raise InputError(
                    f"table-wise: table '{accesses[big].name}' ({rows[big]:,} rows) fits on no device: it needs "
                    f"{need:,} bytes and the budget leaves {budget_bytes:,} bytes per device: short by "
                    f"{need - budget_bytes:,} bytes; accepted: {MORE_MEMORY}, or a row-wise strategy"
                )
            raise InputError(
                f"table-wise: {rows.size} tables of {rows.sum():,} rows in all (the largest '{accesses[big].name}', "
                f"{rows[big]:,} rows) do not pack onto {topology.devices} devices of {budget_rows:,} rows "
                f"({budget_bytes:,} bytes) each; accepted: {MORE_MEMORY}, or a row-wise strategy"
            )
        return ShardingPlan(
            self.name, tuple(_single(a.name, a.rows, np.full(a.rows, h)) for a, h in zip(accesses, homes, strict=True))
        )


class FlexShard:
    """Tiered per-row replication from the relaxation, placed for the uneven links; then the nodes that
    hold each of the hottest rows chosen one by one (copies.py: a row may be copied onto a slow node
    and not onto the fast ones).

    Returns the fastest (by the cost model) of its tiered plan and the same placement with
    no replication, each also under the smaller budgets of SLACK_LADDER, and row-wise-mod's
    placement: never slower than row-wise-mod, nor than its own plan at any smaller slack
    of the ladder.
    """

    name = "flexshard"

    def __init__(self, copies: bool = True) -> None:
        self.copies = copies  # False: whole-node copies only (no row on some nodes only), for comparison

    def plan(
        self, accesses: list[TableAccess], topology: Topology, budget_bytes: int, model: CostModel
    ) -> ShardingPlan:
        budget_rows = budget_bytes // model.shape.row_bytes
        by_name = {a.name: a for a in accesses}
        best, best_time = None, np.inf
        for plan in self.candidates(accesses, topology, budget_bytes, model):  # one at a time: 10^8 rows is 500 MB
            if plan is None or (plan.rows_per_device(topology) > budget_rows).any():
                continue
            time = model.evaluate(plan, by_name).comm_time_s_per_step
            if time < best_time:
                best, best_time = plan, time
        if best is None:
            raise InputError(f"flexshard: no placement fits {budget_bytes:,} bytes per device; accepted: {MORE_MEMORY}")
        return best

    def candidates(
        self, accesses: list[TableAccess], topology: Topology, budget_bytes: int, model: CostModel
    ) -> Iterator[ShardingPlan | None]:
        """Its tiered plan (None where none fits), then the same placement with no replication, each at the
        budget and at the smaller ones of SLACK_LADDER, then row-wise-mod's placement; made one at a time.
        Where the tiered plan was placed from single rows only, it is the placement with no replication
        at that budget: that one is not made again (None in its place)."""
        flat = [np.full(a.rows, SINGLE, dtype=np.int8) for a in accesses]
        budgets = ladder_budgets(accesses, topology, budget_bytes, model)
        made_flat = set()
        for rows in budgets:
            plan, replicates = self._tiered(accesses, topology, rows, model)
            if plan is not None and not replicates:
                made_flat.add(rows)
            yield plan
        for rows in budgets:
            yield None if rows in made_flat else ShardingPlan(
                self.name, tuple(place(accesses, flat, topology, rows, model, self.copies)))
        yield ShardingPlan(self.name, RowWiseMod().plan(accesses, topology, budget_bytes, model).tables)

    def _tiered(
        self, accesses: list[TableAccess], topology: Topology, budget_rows: int, model: CostModel
    ) -> tuple[ShardingPlan | None, bool]:
        """(the tiered plan that fits `budget_rows`, or None; whether its tiers replicate any row)."""
        P = topology.devices
        spare = P * budget_rows - sum(a.rows for a in accesses)
        costs = tier_costs(accesses, model)
        bounds = np.cumsum([0] + [a.class_rows.size for a in accesses])
        for _ in range(FIT_RETRIES):
            if spare <= 0:
                return None, False
            tier_rows = best_tiers(costs, spare)
            tiers = [
                tiers_from_counts(a, tier_rows[2, s:e], tier_rows[1, s:e])
                for a, (s, e) in zip(accesses, pairwise(bounds), strict=True)
            ]
            try:
                plan = ShardingPlan(self.name, tuple(place(accesses, tiers, topology, budget_rows, model,
                                                           self.copies)))
            except InputError:
                over = spare // 4
            else:
                over = int(np.maximum(plan.rows_per_device(topology) - budget_rows, 0).max()) * P
                if over == 0:
                    return plan, bool(tier_rows[1:].any())
            spare -= max(over, spare // 4, 1)
        return None, False


def ladder_budgets(accesses: list[TableAccess], topology: Topology, budget_bytes: int, model: CostModel) -> list[int]:
    """The rows per device FlexShard plans under: the budget's, then the smaller ones of SLACK_LADDER."""
    shape = model.shape
    budget_rows = budget_bytes // shape.row_bytes
    smaller = [slack_budget_bytes(accesses, topology, shape.dim, slack, shape.row_optimizer) // shape.row_bytes
               for slack in SLACK_LADDER]
    return [budget_rows, *(rows for rows in sorted(set(smaller)) if rows < budget_rows)]


STRATEGIES: dict[str, Strategy] = {s.name: s for s in (TableWise(), RowWiseMod(), RowWiseBlock(), FlexShard())}


def propose(
    strategy: str, accesses: list[TableAccess], topology: Topology, budget_bytes: int, model: CostModel
) -> ShardingPlan:
    if strategy not in STRATEGIES:
        raise InputError(f"strategy {strategy!r}; accepted: {', '.join(STRATEGIES)}")
    check_capacity(sum(a.rows for a in accesses), model.shape.dim, topology, budget_bytes,
                   rows_optimizer=model.shape.row_optimizer)
    plan = STRATEGIES[strategy].plan(accesses, topology, budget_bytes, model)
    memory = plan.memory_bytes_per_device(topology, model.shape.dim, model.shape.row_optimizer)
    d = int(np.argmax(memory))
    if memory[d] > budget_bytes:
        raise InputError(
            f"{strategy}: device {d} needs {int(memory[d]):,} bytes, over the budget of {budget_bytes:,} bytes "
            f"per device by {int(memory[d]) - budget_bytes:,}; accepted: {MORE_MEMORY}"
        )
    return plan
