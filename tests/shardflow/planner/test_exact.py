"""The exact optimum of the cost model on small instances (MILP), against the bound and every strategy."""

import numpy as np
import pytest

from shardflow.errors import InputError
from shardflow.planner import refine as refine_module
from shardflow.planner.copies import copy_unit_seconds
from shardflow.planner.costmodel import CostModel, StepShape, row_link_bytes
from shardflow.planner.exact import exact_plan
from shardflow.planner.memory import budget_bytes_per_device
from shardflow.planner.refine import bandwidths, hottest_rows, link_seconds, relayed_unit_loads, unit_loads
from shardflow.planner.relaxation import floor_bound, lower_bound, node_bound, row_floors, tier_costs
from shardflow.planner.report import bound_and_baseline
from shardflow.planner.sharding_plan import NODE, SINGLE, ShardingPlan, TablePlan, row_bytes
from shardflow.planner.strategies import STRATEGIES, propose
from shardflow.planner.topology import Node, Topology, uniform
from support import zipf_access

TOPOLOGIES = {
    "2x2 even": uniform(2, 2, 12.5),
    "3 nodes, one uplink 5x slower": Topology((Node("a", 2, 12.5), Node("b", 2, 12.5), Node("c", 2, 2.5)), 600.0),
    "4x2, one uplink 5x slower": Topology(tuple(Node(n, 2, 2.5 if n == "d" else 12.5) for n in "abcd"), 600.0),
}


@pytest.mark.parametrize("alpha", [0.9, 1.2])
@pytest.mark.parametrize("slack", [0.1, 0.5])
@pytest.mark.parametrize("dedup", ["none", "device", "node"])
@pytest.mark.parametrize("topology", sorted(TOPOLOGIES))
def test_bound_exact_optimum_and_strategies_in_order_and_flexshard_within_5_percent(topology, dedup, slack, alpha):
    topo = TOPOLOGIES[topology]
    accesses = [zipf_access("t", 24, alpha, lookups=16.0, seed=1)]
    model = CostModel(topo, StepShape(2048, 16, dedup))
    budget = budget_bytes_per_device(accesses, topo, 16, slack)
    plan, exact = exact_plan(accesses, budget, model)
    assert (plan.memory_bytes_per_device(topo, 16) <= budget).all()
    bound, mod = bound_and_baseline(accesses, topo, budget, model)
    assert bound <= exact * (1 + 1e-9)
    costs = {}
    for name in STRATEGIES:
        try:
            costs[name] = model.evaluate(propose(name, accesses, topo, budget, model), {"t": accesses[0]})
        except InputError:  # table-wise: one table does not fit one device at this slack
            continue
    assert costs["row-wise-mod"].link_time_s_per_step == pytest.approx(mod.link_time_s_per_step)
    # The solver stops within 0.01% of the optimum it proves (of the busiest link's bytes).
    assert all(c.link_time_s_per_step >= exact * (1 - 1e-4) for c in costs.values()), costs
    # FlexShard picks by the time the rounds take one after another: there, within 5% of the solver's plan.
    exact_comm = model.evaluate(plan, {"t": accesses[0]}).comm_time_s_per_step
    assert costs["flexshard"].comm_time_s_per_step <= exact_comm * 1.05


def test_the_program_prices_its_plan_as_the_cost_model_does_and_refuses_large_instances():
    topo = TOPOLOGIES["3 nodes, one uplink 5x slower"]
    accesses = [zipf_access("a", 12, 1.0, seed=2), zipf_access("b", 9, 0.7, seed=3)]
    model = CostModel(topo, StepShape(1024, 8, "device"))
    budget = budget_bytes_per_device(accesses, topo, 8, 0.3)
    plan, exact = exact_plan(accesses, budget, model)
    assert [t.name for t in plan.tables] == ["a", "b"] and [t.rows for t in plan.tables] == [12, 9]
    # the program's optimum, as HiGHS found it, is what the cost model says of the plan it returns
    assert exact == pytest.approx(model.evaluate(plan, {a.name: a for a in accesses}).link_time_s_per_step, rel=1e-6)
    many = [zipf_access(f"t{i}", 2_000, 1.0, seed=i) for i in range(2)]
    with pytest.raises(InputError, match=r"variables; accepted: at most 20,000"):
        exact_plan(many, budget_bytes_per_device(many, topo, 8, 0.3), model)


def single_rows(access, topo) -> ShardingPlan:
    """Every row single, on a seeded random device."""
    home = np.random.default_rng(3).integers(0, topo.devices, access.rows).astype(np.int32)
    return ShardingPlan("x", (TablePlan(access.name, np.full(access.rows, SINGLE, np.int8), home),))


@pytest.mark.parametrize("topology", sorted(TOPOLOGIES))
def test_single_rows_reach_the_links_through_the_load_homed_on_each_device(topology):
    """refine.unit_loads, the linear form the last placement pass searches with, against the cost model."""
    topo = TOPOLOGIES[topology]
    access = zipf_access("t", 40, 1.1, seed=4)
    model = CostModel(topo, StepShape(512, 8, "device"))
    plan = single_rows(access, topo)
    cost = model.evaluate(plan, {"t": access})
    homed = np.bincount(plan.table("t").home, model.rates(access).x[access.row_class], minlength=topo.devices)
    np.testing.assert_allclose(link_seconds(cost.lookup_pairs + cost.sync_pairs, topo),
                               homed @ unit_loads(topo, 8) / bandwidths(topo), rtol=1e-12)


@pytest.mark.parametrize("topology", sorted(TOPOLOGIES))
def test_with_scope_node_a_single_row_reaches_the_links_by_its_reads_and_its_nodes_fetches(topology):
    """refine.relayed_unit_loads (a trainer's reads, and one fetch a node) against the cost model."""
    topo = TOPOLOGIES[topology]
    access = zipf_access("t", 40, 1.1, seed=4)
    model = CostModel(topo, StepShape(512, 8, "node"))
    plan = single_rows(access, topo)
    cost = model.evaluate(plan, {"t": access})
    per_read, per_fetch = relayed_unit_loads(topo, 8)
    rates, home = model.rates(access), plan.table("t").home
    q, q_node = rates.q[access.row_class], rates.q_node[:, access.row_class]  # [rows], [nodes, rows]
    expected = sum(q[r] * per_read[home[r]] + q_node[:, r] @ per_fetch[home[r]] for r in range(40))
    np.testing.assert_allclose(link_seconds(cost.lookup_pairs + cost.sync_pairs, topo),
                               expected / bandwidths(topo), rtol=1e-12)


@pytest.mark.parametrize("dedup", ["none", "device", "node"])
@pytest.mark.parametrize("topology", sorted(TOPOLOGIES))
def test_a_copy_in_one_more_node_adds_what_the_cost_model_says(topology, dedup):
    """copies.copy_unit_seconds, the linear form the copy pass searches with, against the cost model."""
    topo = TOPOLOGIES[topology]
    access = zipf_access("t", 40, 1.1, seed=4)
    model = CostModel(topo, StepShape(512, 8, dedup))
    units, rates, bw = copy_unit_seconds(model), model.rates(access), bandwidths(topo)
    for c in range(min(access.class_prob.size, 4)):
        for h in range(topo.devices):
            own = int(topo.node_of_device[h])
            alone = row_link_bytes(access, c, SINGLE, h, model)
            for a in set(range(len(topo.nodes))) - {own}:
                expected = (row_link_bytes(access, c, NODE, h, model, nodes=(1 << own) | (1 << a)) - alone) / bw
                got = (
                    rates.x[c] * units[0, h, a] + rates.q_node[a, c] * units[1, h, a] + rates.q_any[c] * units[2, h, a]
                    + rates.q_node[own, c] * units[3, h, a]
                )
                np.testing.assert_allclose(got, expected, rtol=1e-9, atol=1e-18)
                assert np.abs(expected).max() > 0


def test_on_a_slow_uplink_the_node_bound_is_what_binds():
    """What the slow node cannot hold crosses its uplink: twice the pooled bounds here, and still valid."""
    topo = TOPOLOGIES["4x2, one uplink 5x slower"]
    accesses = [zipf_access("t", 24, 1.2, lookups=16.0, seed=1)]
    model = CostModel(topo, StepShape(2048, 16, "device"))
    budget = budget_bytes_per_device(accesses, topo, 16, 0.5)
    spare = topo.devices * (budget // row_bytes(16)) - 24
    pooled = max(lower_bound(tier_costs(accesses, model), spare), floor_bound(row_floors(accesses, model), spare))
    node = node_bound(accesses, model, budget // row_bytes(16))
    _, exact = exact_plan(accesses, budget, model)
    assert 2 * pooled <= node <= exact


def test_the_hottest_rows_are_those_a_stable_sort_by_load_would_give(monkeypatch):
    """refine's top-k, a chunk at a time, against a whole-table stable sort (ties by id)."""
    rng = np.random.default_rng(0)
    for _ in range(200):
        n, classes, k = int(rng.integers(1, 400)), int(rng.integers(1, 12)), int(rng.integers(1, 40))
        monkeypatch.setattr(refine_module, "CHUNK_ROWS", int(rng.integers(1, 50)))
        tier = rng.integers(0, 3, n).astype(np.int8)
        row_class = rng.integers(0, classes, n).astype(np.int32)
        x = rng.integers(0, 4, classes).astype(np.float64)  # few values: many ties
        single = np.flatnonzero(tier == SINGLE)
        expected = single[np.argsort(-x[row_class[single]], kind="stable")[:k]]
        assert np.array_equal(hottest_rows(tier, row_class, x, k), expected)
