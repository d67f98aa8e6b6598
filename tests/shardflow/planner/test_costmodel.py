"""The vectorised cost model against a row-by-row, trainer-by-trainer reference of the same rules."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardflow.errors import InputError
from shardflow.planner.access import TableAccess
from shardflow.planner.costmodel import BYTES_ONLY, CostModel, StepShape, Touch, Wire, touched
from shardflow.planner.sharding_plan import GLOBAL, ID_BYTES, NODE, SINGLE, ShardingPlan, TablePlan, check_plan
from shardflow.planner.topology import Node, Topology
from shardflow.sharding.touch import FACTOR_RANGE, draws_factor


def reference_pairs(access: TableAccess, plan: TablePlan, topo: Topology, shape: StepShape, touch: Touch = Touch()):
    P = topo.devices
    node_of = topo.node_of_device.tolist()
    starts = topo.node_start.tolist()
    sizes = topo.node_devices.tolist()
    a, v = ID_BYTES, 4 * shape.dim
    msg = a + v
    m = access.lookups_per_example * shape.batch_size / P
    lookup, sync = np.zeros((P, P)), np.zeros((P, P))
    for r in range(access.rows):
        p = min(float(access.class_prob[access.row_class[r]]), 1 - 2**-53)  # as the model: no log of 0
        q = 1 - (1 - p) ** (m * touch.trainer)
        q_any = 1 - (1 - p) ** (m * P * touch.batch)
        x = m * p if shape.dedup == "none" else q
        tier, home = int(plan.tier[r]), int(plan.home[r])
        j = home - starts[node_of[home]]
        holders = {node_of[home]} if tier == SINGLE else set(range(len(sizes)))
        if tier == NODE and r in plan.partial_ids.tolist():
            nodes = int(plan.partial_nodes[plan.partial_ids.tolist().index(r)])
            holders = {n for n in range(len(sizes)) if nodes >> n & 1}

        def copy_in(node, j=j):
            return starts[node] + j % sizes[node]

        relay = shape.dedup == "node" and len(sizes) > 1
        for d in range(P):
            if tier == GLOBAL:
                src = d
            elif node_of[d] in holders:
                src = copy_in(node_of[d])
            else:
                src = home
                if relay:  # through the node's proxy, fetched once a node
                    src = copy_in(node_of[d])
            if src != d:
                lookup[d, src] += x * (2 * a + v)
                lookup[src, d] += x * v
        if relay and tier != GLOBAL:
            for node in range(len(sizes)):
                if node not in holders:
                    q_node = 1 - (1 - p) ** (m * sizes[node] * touch.node.get(sizes[node], 1.0))
                    lookup[copy_in(node), home] += q_node * (2 * a + v)
                    lookup[home, copy_in(node)] += q_node * v
        if tier == SINGLE:
            continue
        def q_node_of(node, p=p):
            return 1 - (1 - p) ** (m * sizes[node] * touch.node.get(sizes[node], 1.0))

        for node in sorted(holders):
            leader = copy_in(node)
            if len(sizes) == 2 and node != node_of[home]:  # each copy's partial sum to the other copy
                sync[leader, home] += q_node_of(node) * msg
                sync[home, leader] += q_node_of(node_of[home]) * msg
            elif node != node_of[home]:
                sync[leader, home] += q_node_of(node) * msg
                sync[home, leader] += q_any * msg
            if tier == GLOBAL:
                for e in range(starts[node], starts[node] + sizes[node]):
                    if e != leader:
                        sync[e, leader] += q * msg
                        sync[leader, e] += q_any * msg
    return lookup, sync


@settings(max_examples=40, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 3), min_size=1, max_size=3),
    counts=st.lists(st.integers(0, 50), min_size=2, max_size=12),
    dedup=st.sampled_from(["none", "device", "node"]),
    data=st.data(),
)
def test_cost_model_matches_the_reference(sizes, counts, dedup, data):
    topo = Topology(tuple(Node(f"n{i}", s, 10.0 + i) for i, s in enumerate(sizes)), 600.0)
    P = topo.devices
    counts = np.array(counts)
    counts[0] += 1
    access = TableAccess.from_counts("t", counts, 3.0)
    rows = len(counts)
    tier = np.array(data.draw(st.lists(st.integers(0, 2), min_size=rows, max_size=rows)), dtype=np.int8)
    home = np.array(data.draw(st.lists(st.integers(0, P - 1), min_size=rows, max_size=rows)), dtype=np.int32)
    node_rows = np.flatnonzero(tier == NODE)
    partial = node_rows[np.array(data.draw(st.lists(st.booleans(), min_size=node_rows.size,
                                                    max_size=node_rows.size)), dtype=bool)]
    others = [data.draw(st.integers(0, 2 ** len(sizes) - 1)) for _ in partial]  # nodes besides the home's
    nodes = np.array([o | 1 << int(topo.node_of_device[home[r]]) for r, o in zip(partial, others, strict=True)],
                     dtype=np.int64)
    keep = np.bitwise_count(nodes.astype(np.uint64)) >= 2  # one node is the single tier
    plan = TablePlan("t", tier, home, partial[keep].astype(np.int64), nodes[keep])
    check_plan(ShardingPlan("x", (plan,)), {"t": rows}, topo)
    shape = StepShape(batch_size=16, dim=4, dedup=dedup)
    factor = st.floats(0.05, 1.0)
    touch = Touch(data.draw(factor), {s: data.draw(factor) for s in set(sizes)}, data.draw(factor))
    cost = CostModel(topo, shape, {"t": touch}).evaluate(ShardingPlan("x", (plan,)), {"t": access})
    lookup, sync = reference_pairs(access, plan, topo, shape, touch)
    np.testing.assert_allclose(cost.lookup_pairs, lookup, rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(cost.sync_pairs, sync, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("factor", [0.01, 0.3, 0.95, 1.0, 2.5])
def test_a_draws_factor_is_the_one_that_touches_as_many_distinct_rows(factor):
    access = TableAccess.from_counts("t", np.random.default_rng(0).zipf(1.3, 5_000) % 2_000, 12.0, 0.2)
    distinct = float((access.class_rows * touched(access, 800 * factor)).sum())
    assert draws_factor(access, 800, distinct) == pytest.approx(factor, rel=1e-6)
    assert draws_factor(access, 800, 0.0) == FACTOR_RANGE[0] and draws_factor(access, 800, 1e9) == FACTOR_RANGE[1]


def test_time_is_the_busiest_link():
    # Two nodes of one device; every row single on device 0: device 1 reads everything remotely.
    topo = Topology((Node("a", 1, 1.0), Node("b", 1, 2.0)), 600.0)
    access = TableAccess.from_counts("t", np.array([1, 1, 1, 1]), 4.0)
    plan = ShardingPlan("x", (TablePlan("t", np.zeros(4, np.int8), np.zeros(4, np.int32)),))
    shape = StepShape(batch_size=2, dim=2, dedup="none")
    cost = CostModel(topo, shape).evaluate(plan, {"t": access})
    # trainer 1: m = 4 lookups of 1/4 each -> 4 reads: sends 4 * (2*8 + 8) = 96 bytes, receives 4 * 8 = 32.
    assert cost.lookup_pairs[1, 0] == pytest.approx(96) and cost.lookup_pairs[0, 1] == pytest.approx(32)
    assert cost.inter_node_bytes_per_step == pytest.approx(128)
    assert cost.link_time_s_per_step == pytest.approx(96 / 1e9)  # node a's uplink in: 96 bytes at 1 GB/s
    assert cost.busiest_link == "uplink of node a"
    # The rounds run one after another, each at its own busiest link: ids in (32 B), rows out (32 B), ids and
    # gradients in (64 B) over node a's 1 GB/s uplink.
    bytes_only = CostModel(topo, shape, wire=BYTES_ONLY).evaluate(plan, {"t": access})
    assert bytes_only.round_payload_s == pytest.approx({"request": 32e-9, "reply": 32e-9, "gradients": 64e-9})
    assert bytes_only.comm_time_s_per_step == pytest.approx(128e-9)
    wire = Wire(bytes_factor=1.25, round_s=1e-6)
    priced = CostModel(topo, shape, wire=wire).evaluate(plan, {"t": access})
    assert priced.comm_time_s_per_step == pytest.approx(1.25 * 128e-9 + 3 * 1e-6)
    assert priced.link_time_s_per_step == bytes_only.link_time_s_per_step


def test_replicated_rows_add_the_sync_rounds_and_their_fixed_cost():
    topo = Topology((Node("a", 1, 1.0), Node("b", 1, 1.0)), 600.0)
    access = TableAccess.from_counts("t", np.array([1, 1, 1, 1]), 4.0)
    tier = np.array([NODE, SINGLE, SINGLE, SINGLE], np.int8)
    plan = ShardingPlan("x", (TablePlan("t", tier, np.zeros(4, np.int32)),))
    shape = StepShape(batch_size=2, dim=2, dedup="device")
    cost = CostModel(topo, shape, wire=Wire(round_s=1e-6)).evaluate(plan, {"t": access})
    assert list(cost.round_payload_s) == ["request", "reply", "gradients", "exchange"]  # two nodes: one sync round
    assert cost.round_payload_s["exchange"] > 0
    assert cost.comm_time_s_per_step == pytest.approx(sum(cost.round_payload_s.values()) + 4e-6)
    three = Topology((Node("a", 1, 1.0), Node("b", 1, 1.0), Node("c", 1, 1.0)), 600.0)
    cost = CostModel(three, shape, wire=Wire(round_s=1e-6)).evaluate(plan, {"t": access})
    assert list(cost.round_payload_s) == ["request", "reply", "gradients", "to-primary", "totals"]
    assert cost.round_payload_s["to-primary"] > 0 and cost.round_payload_s["totals"] > 0
    assert cost.comm_time_s_per_step == pytest.approx(sum(cost.round_payload_s.values()) + 5e-6)
    flat = ShardingPlan("x", (TablePlan("t", np.zeros(4, np.int8), np.zeros(4, np.int32)),))
    assert list(CostModel(topo, shape, wire=Wire(round_s=1e-6)).evaluate(flat, {"t": access}).round_payload_s) == [
        "request", "reply", "gradients"]


@pytest.mark.parametrize("factor,round_s", [(0.9, 0.0), (1.0, -1e-9)])
def test_a_wire_below_its_payload_or_with_a_negative_round_cost_is_refused(factor, round_s):
    with pytest.raises(InputError, match="accepted: bytes_factor >= 1, round_s >= 0"):
        Wire(factor, round_s)


def test_step_shape_validation():
    with pytest.raises(InputError, match="dedup scope 'host'; accepted: none, device"):
        StepShape(8, 4, "host")
    with pytest.raises(InputError, match="batch_size = 0"):
        StepShape(0, 4)
