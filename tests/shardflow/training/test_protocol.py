"""The step protocol without a cluster: every device in this process, messages handed over by InProcess."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from shardflow.errors import InputError, TrainingError
from shardflow.model.configs import OptimizerConfig
from shardflow.planner.sharding_plan import GLOBAL, NODE, SINGLE, ShardingPlan, TablePlan, check_plan
from shardflow.planner.strategies import STRATEGIES
from shardflow.planner.topology import Node, Topology
from shardflow.training.inprocess import InProcess
from shardflow.training.messages import Apply, ApplyDense, Compute, PeerStopped, Round, Send
from shardflow.training.protocol import StepProtocol
from shardflow.training.reference import ReferenceTrainer
from shardflow.training.steps import Phase, step_rounds
from support import (
    ADAM,
    ATTENTION,
    BATCH,
    MODEL,
    OPTIMIZER,
    STEPS,
    TOPOLOGIES,
    check_against,
    in_process_devices,
    planned,
    random_case,
    random_plan,
    reference,
)


def stepped(dataset, data, strategy: str, devices: int, dedup: str, **kw) -> list:
    """The in-process devices of `strategy`'s plan after STEPS steps of epoch 0 (`kw`: the model, the optimizer)."""
    devs = in_process_devices(data, planned(dataset, strategy, devices), TOPOLOGIES[devices], dedup, **kw)
    driver = InProcess(devs)
    for i in range(STEPS):
        driver.step(0, i, i, 0)
    return devs


@pytest.mark.parametrize("dedup", ["none", "device", "node"])
@pytest.mark.parametrize("devices", [1, 2, 3, 4])
@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_every_strategy_and_scope_learns_what_the_reference_learns(dataset, data, strategy, devices, dedup):
    devs = in_process_devices(data, planned(dataset, strategy, devices), TOPOLOGIES[devices], dedup)
    driver = InProcess(devs)
    for i in range(STEPS):
        stats = driver.step(0, i, i, 0)
        assert sum(s.examples for s in stats) == BATCH
    check_against(reference(data, STEPS), [d.parameters() for d in devs])


@pytest.mark.parametrize("dedup", ["none", "device", "node"])
@pytest.mark.parametrize("devices", [1, 2, 3, 4])
@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_the_self_attention_encoder_learns_what_the_reference_learns_under_every_plan(dataset, data, strategy,
                                                                                     devices, dedup):
    """Its blocks are dense parameters, its dropout follows each example's key: any split gives one model."""
    devs = stepped(dataset, data, strategy, devices, dedup, model=ATTENTION)
    ref = reference(data, STEPS, model=ATTENTION)
    check_against(ref, [d.parameters() for d in devs])
    assert set(ref.dense) == set(ATTENTION.dense_shapes()) and any(k.startswith("attention.1.") for k in ref.dense)


@pytest.mark.parametrize("dedup", ["none", "device", "node"])
@pytest.mark.parametrize("devices", [1, 3, 4])
@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_the_sampled_softmax_learns_what_the_reference_learns_under_every_plan(dataset, data, strategy, devices,
                                                                            dedup):
    """One loss term an example, normalised by the global batch's examples: any split gives one model."""
    softmax = replace(ATTENTION, loss="sampled-softmax")
    devs = stepped(dataset, data, strategy, devices, dedup, model=softmax)
    ref = reference(data, STEPS, model=softmax)
    check_against(ref, [d.parameters() for d in devs])
    bce = reference(data, STEPS, model=ATTENTION)
    assert not np.allclose(ref.weights["item"], bce.weights["item"])  # not vacuous: another loss, another model


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_gbce_learns_what_the_reference_learns_under_every_plan(dataset, data, strategy):
    """Its positive's weight depends on the item table's rows only, the same on every trainer."""
    gbce = replace(ATTENTION, loss="gbce", gbce_t=0.75)
    devs = stepped(dataset, data, strategy, 3, "device", model=gbce)
    ref = reference(data, STEPS, model=gbce)
    check_against(ref, [d.parameters() for d in devs])
    bce = reference(data, STEPS, model=ATTENTION)
    assert not np.allclose(ref.weights["item"], bce.weights["item"])  # not vacuous: another loss, another model


@pytest.mark.parametrize("dedup", ["none", "node"])
@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_rows_under_adam_learn_what_the_reference_learns_under_every_plan(dataset, data, strategy, dedup):
    """Each row's moments and update count live beside it: every copy applies the same total, the same way."""
    devs = stepped(dataset, data, strategy, 4, dedup, optimizer=ADAM)
    ref = reference(data, STEPS, optimizer=ADAM)
    check_against(ref, [d.parameters() for d in devs])
    counts = ref.state["item"][:, -1]
    assert ref.state["item"].shape == (data.rows["item"], 2 * MODEL.dim + 1)
    assert counts.max() == STEPS and np.unique(counts).size > 2, "each row counts the steps that read it"


@pytest.mark.parametrize("dedup", ["none", "device", "node"])
def test_a_trainer_whose_sub_batch_is_empty_still_takes_its_part_in_the_step(dataset, data, dedup):
    batch, steps = 4, 8  # one example per trainer on average: some trainer gets none in most steps
    devs = in_process_devices(data, planned(dataset, "flexshard", 4), TOPOLOGIES[4], dedup, batch=batch)
    driver = InProcess(devs)
    sizes = [[s.examples for s in driver.step(0, i, i, 0)] for i in range(steps)]
    assert all(sum(step) == batch for step in sizes)
    assert sum(min(step) == 0 for step in sizes) >= 2, sizes
    check_against(reference(data, steps, batch=batch), [d.parameters() for d in devs])


@pytest.mark.parametrize("optimizer", [OPTIMIZER, ADAM], ids=["adagrad", "adam"])
@pytest.mark.parametrize("dedup", ["none", "device", "node"])
def test_replicas_stay_bitwise_equal_after_every_step_of_a_mixed_plan(data, dedup, optimizer):
    plan = random_plan(data, 4, seed=1)
    tiers = np.concatenate([t.tier for t in plan.tables])
    assert (tiers == NODE).any() and (tiers == GLOBAL).any()
    devs = in_process_devices(data, plan, TOPOLOGIES[4], dedup, optimizer=optimizer)
    driver, ref = InProcess(devs), ReferenceTrainer(data, MODEL, optimizer, BATCH, seed=0)
    for i in range(6):
        driver.step(0, i, i, 0)
        ref.step(0, i)
        shards = [d.parameters() for d in devs]
        check_against(ref, shards)
        assert max(s["item"]["version"].max() for s in shards) == i + 1
    start = ReferenceTrainer(data, MODEL, OPTIMIZER, BATCH, 0).weights["item"][shards[0]["item"]["ids"]]
    assert np.abs(shards[0]["item"]["weights"] - start).max() > 1e-4, (
        "training changed nothing: the comparison proves nothing"
    )


THREE_NODES = Topology((Node("a", 2, 10.0), Node("b", 1, 10.0), Node("c", 1, 5.0)), 100.0)


def partial_plan(data, seed: int) -> ShardingPlan:
    """A random plan on THREE_NODES where about half the node rows are copied onto two of the three nodes."""
    plan, rng = random_plan(data, 4, seed), np.random.default_rng(seed)
    tables = []
    for t in plan.tables:
        node = np.flatnonzero(t.tier == NODE)
        ids = np.sort(rng.choice(node, node.size // 2, replace=False)).astype(np.int64)
        home_node = THREE_NODES.node_of_device[t.home[ids]]
        other = (home_node + rng.integers(1, 3, ids.size)) % 3
        tables.append(TablePlan(t.name, t.tier, t.home, ids, (1 << home_node) | (1 << other)))
    return ShardingPlan("partial", tuple(tables))


@pytest.mark.parametrize("dedup", ["none", "device", "node"])
def test_rows_copied_onto_some_nodes_learn_what_the_reference_learns_and_their_copies_stay_equal(data, dedup):
    plan = partial_plan(data, seed=2)
    check_plan(plan, data.rows, THREE_NODES)
    item = plan.table("item")
    assert item.partial_ids.size > 10 and (item.tier == SINGLE).any() and (item.tier == GLOBAL).any()
    devs = in_process_devices(data, plan, THREE_NODES, dedup)
    driver, ref = InProcess(devs), ReferenceTrainer(data, MODEL, OPTIMIZER, BATCH, seed=0)
    for i in range(STEPS):
        driver.step(0, i, i, 0)
        ref.step(0, i)
        check_against(ref, [d.parameters() for d in devs])  # every row within rounding, copies bitwise equal
    stored = np.concatenate([d.parameters()["item"]["ids"] for d in devs])
    copies = np.bincount(stored, minlength=item.rows)[item.partial_ids]
    assert (copies == 2).all(), "a row named for two nodes is stored on two devices"


RANDOM_CASES = range(24)


def test_the_random_cases_cover_what_the_fixed_topologies_do_not(data):
    cases = [random_case(data, seed) for seed in RANDOM_CASES]
    sizes = {tuple(n.devices for n in t.nodes) for t, _, _, _ in cases}
    assert len(sizes) >= 12 and any(len(s) >= 3 and len(set(s)) > 1 for s in sizes), sorted(sizes)
    assert any(t.partial_ids.size for _, p, _, _ in cases for t in p.tables), "no plan copies rows onto some nodes"
    assert {d for _, _, d, _ in cases} == {"none", "device", "node"}
    assert {o.rows for _, _, _, o in cases} == {"adagrad", "adam"}


@pytest.mark.parametrize("seed", RANDOM_CASES)
def test_a_random_topology_and_plan_learn_what_the_reference_learns(data, seed):
    topology, plan, dedup, optimizer = random_case(data, seed)
    check_plan(plan, data.rows, topology)
    devs = in_process_devices(data, plan, topology, dedup, optimizer=optimizer)
    driver = InProcess(devs)
    for i in range(STEPS):
        assert sum(s.examples for s in driver.step(0, i, i, 0)) == BATCH
    check_against(reference(data, STEPS, optimizer=optimizer), [d.parameters() for d in devs])


EARLY_POINTS = (Round.GRADIENTS, Round.EXCHANGE, Round.FORWARD, None)


def bitwise_equal(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    return all(bitwise_equal(a[k], b[k]) if isinstance(a[k], dict) else np.array_equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("dedup", ["none", "device", "node"])
@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_answering_the_next_steps_requests_early_leaves_every_parameter_bitwise_as_answering_late(
        dataset, data, strategy, dedup):
    """The homes answer step i+1's requests at every point of step i (before its gradients, between its
    applies, once it ended); with the patches every parameter is bitwise what whole late replies give,
    and the rows read count the same bytes (the patches are counted apart)."""
    plan, topo, steps = planned(dataset, strategy, 4), TOPOLOGIES[4], 2 * len(EARLY_POINTS) + 1
    starts = [(0, i, i, 0) for i in range(steps)]
    early, late = (in_process_devices(data, plan, topo, dedup, early=e) for e in (True, False))
    InProcess(early).run(starts, lambda i: EARLY_POINTS[i % len(EARLY_POINTS)])
    InProcess(late).run(starts)
    for answered_early, answered_late in zip(early, late, strict=True):
        assert bitwise_equal(answered_early.parameters(), answered_late.parameters())
        assert (answered_early.traffic().lookup == answered_late.traffic().lookup).all()
    patched = sum(d.traffic().patch.sum() for d in early)
    if dedup == "node":  # the proxies relay whole replies: nothing is answered early
        assert patched == 0 and not any(d.protocol.early for d in early)
    else:
        assert patched > 0, "no patch was sent: the test shows nothing about patches"
    assert np.concatenate([d.parameters()["item"]["version"] for d in early]).max() == steps


def test_an_early_answer_outside_the_next_step_is_refused(data):
    devs = in_process_devices(data, random_plan(data, 2, seed=2), TOPOLOGIES[2])
    asked = devs[0].prepare(0, 5, 5, 0)[1]
    with pytest.raises(RuntimeError, match="an early request for step 5 with parameters after step 0"):
        devs[1].protocol.answer_early(asked)
    off = in_process_devices(data, random_plan(data, 2, seed=2), TOPOLOGIES[2], early=False)
    with pytest.raises(RuntimeError, match="answering none early"):
        off[1].protocol.answer_early(off[0].prepare(0, 1, 1, 0)[1])


def test_rounds_follow_the_plan():
    topo2, topo1 = TOPOLOGIES[4], TOPOLOGIES[1]

    def plan(tier: int) -> dict:
        return {"t": TablePlan("t", np.full(8, tier, np.int8), np.arange(8, dtype=np.int32) % 4)}

    base = (Round.REQUEST, Round.REPLY, Round.GRADIENTS)
    assert step_rounds(plan(SINGLE), topo2) == base
    assert step_rounds(plan(NODE), topo2) == base + (Round.EXCHANGE,)
    assert step_rounds(plan(GLOBAL), topo2) == base + (Round.EXCHANGE, Round.FORWARD)
    assert step_rounds(plan(NODE), THREE_NODES) == base + (Round.TO_PRIMARY, Round.TOTALS)
    assert step_rounds(plan(GLOBAL), THREE_NODES) == base + (Round.TO_PRIMARY, Round.TOTALS, Round.FORWARD)
    one_node = TOPOLOGIES[2].__class__(TOPOLOGIES[3].nodes[:1], 100.0)  # 2 devices on one node
    assert step_rounds({"t": TablePlan("t", np.full(4, GLOBAL, np.int8), np.arange(4, dtype=np.int32) % 2)},
                       one_node) == base + (Round.TOTALS,)
    assert step_rounds(plan(GLOBAL), topo1) == base


UNEVEN = Topology((Node("a", 3, 10.0), Node("b", 2, 10.0)), 100.0)  # a node's copies of 3 homes on 2 devices


@pytest.mark.parametrize("dedup", ["device", "node"])
@pytest.mark.parametrize("where", ["2x2", "three nodes, rows on some", "3+2"])
def test_every_device_sends_one_message_to_every_peer_its_round_links_it_with_and_learns_what_the_reference_learns(
        data, where, dedup):
    topology, plan = {"2x2": (TOPOLOGIES[4], random_plan(data, 4, seed=2)),
                      "three nodes, rows on some": (THREE_NODES, partial_plan(data, seed=2)),
                      "3+2": (UNEVEN, random_plan(data, 5, seed=2))}[where]
    devs = in_process_devices(data, plan, topology, dedup)
    P = topology.devices
    for round in devs[0].rounds:  # the relation is the same both ways, so every message sent is waited for
        assert all((p in devs[d].round_peers[round]) == (d in devs[p].round_peers[round])
                   for d in range(P) for p in range(P) if p != d), round
    for step in range(STEPS):
        outboxes = [d.start(0, step, step, 0) for d in devs]
        for round in devs[0].rounds:
            for sender, out in enumerate(outboxes):
                assert sorted(out) == list(devs[sender].round_peers[round]), round
                assert all(m.round is round and m.sender == sender and m.step == step for m in out.values())
            inboxes = [[out[r] for out in outboxes if r in out] for r in range(P)]
            outboxes = [d.receive(round, inbox) or {} for d, inbox in zip(devs, inboxes, strict=True)]
        assert outboxes == [{}] * P  # the last round answers nothing: the step is applied
        assert all(d.shard.clock == step + 1 for d in devs)
    check_against(reference(data, STEPS), [d.parameters() for d in devs])


def test_scope_node_on_two_nodes_of_two_sends_half_the_messages_of_every_device_to_every_peer(data):
    """Its trainers talk inside their node, each proxy to one device of the other node, device 0 to all (the dense
    parameters): 36 messages a step where one to every peer in each of its 6 rounds would be 72."""
    devs = in_process_devices(data, random_plan(data, 4, seed=2), TOPOLOGIES[4], "node")
    peers = {r: [d.round_peers[r] for d in devs] for r in devs[0].rounds}
    assert peers[Round.REQUEST] == peers[Round.REPLY] == peers[Round.GRADIENTS] == [(1, 2, 3), (0,), (0, 3), (0, 2)]
    assert peers[Round.RELAY_REQUEST] == peers[Round.RELAY_GRADIENTS] == peers[Round.EXCHANGE] == [(2,), (3,), (0,),
                                                                                                   (1,)]
    assert sum(len(p) for r in devs[0].rounds[:6] for p in peers[r]) == 36


def test_a_round_out_of_order_or_from_the_wrong_step_is_refused(data):
    devs = in_process_devices(data, random_plan(data, 2, seed=2), TOPOLOGIES[2])
    out = [d.start(0, 0, 0, 0) for d in devs]
    with pytest.raises(RuntimeError, match="round reply arrived, expected request"):
        devs[0].receive(Round.REPLY, [out[1][0]])
    stale = out[1][0]
    stale.step = 7
    with pytest.raises(RuntimeError, match="a message of step 7"):
        devs[0].receive(Round.REQUEST, [stale])


def test_a_non_finite_gradient_stops_the_step_naming_it(data):
    exploding = OptimizerConfig(row_lr=1e30, dense_lr=1e30, dense="adagrad")
    devs = in_process_devices(data, random_plan(data, 3, seed=3), TOPOLOGIES[3], optimizer=exploding)
    driver = InProcess(devs)
    with pytest.raises(TrainingError, match=r"step \d+: (the loss is|non-finite gradient in)"):
        for i in range(20):
            driver.step(0, i, i, 0)
    assert all(d.protocol.expecting is None for d in devs)


def test_a_device_that_fails_tells_its_peers_and_nothing_is_applied_anywhere(data):
    devs = in_process_devices(data, random_plan(data, 3, seed=3), TOPOLOGIES[3])
    before = [d.parameters() for d in devs]
    outboxes = [d.start(0, 0, 0, 0) for d in devs]
    inboxes = [[out[r] for out in outboxes if r in out] for r in range(3)]
    outboxes = [d.receive(Round.REQUEST, inbox) for d, inbox in zip(devs, inboxes, strict=True)]
    inboxes = [[out[r] for out in outboxes if r in out] for r in range(3)]
    outboxes = [devs[0].receive(Round.REPLY, inboxes[0]),
                devs[1].failed(TrainingError("step 0: device 1 gave up")),  # instead of computing
                devs[2].receive(Round.REPLY, inboxes[2])]
    assert all(m.round is Round.GRADIENTS for m in outboxes[1].values())
    inboxes = [[out[r] for out in outboxes if r in out] for r in range(3)]
    for d in (0, 2):
        with pytest.raises(PeerStopped, match="step 0: device 1 gave up"):
            devs[d].receive(Round.GRADIENTS, inboxes[d])
    for b, d in zip(before, devs, strict=True):
        assert d.shard.clock == 0 and d.protocol.expecting is None
        for t in ("item", "genre"):
            assert b[t]["weights"].tobytes() == d.parameters()[t]["weights"].tobytes()
    driver = InProcess(devs)  # the same step again, as if nothing had happened
    for i in range(STEPS):
        driver.step(0, i, i, 0)
    check_against(reference(data, STEPS), [d.parameters() for d in devs])


def test_estimation_sums_ids_that_share_a_scaled_row(data):
    from shardflow.training.device import Device

    tables = {t: TablePlan(t, np.full(r, SINGLE, np.int8), np.zeros(r, np.int32)) for t, r in data.rows.items()}
    scaled = {"item": 50, "genre": 5}
    devs = [Device(d, TOPOLOGIES[2], tables, data, MODEL, OPTIMIZER, batch_size=BATCH, dedup="device",
                   scaled_rows=scaled) for d in range(2)]
    before = devs[0].parameters()["item"]["weights"]
    stats = InProcess(devs).step(0, 0, 0, 0)
    after = devs[0].parameters()["item"]
    assert after["weights"].shape == (50, MODEL.dim) and devs[1].parameters()["item"]["weights"].shape == (0, MODEL.dim)
    assert np.isfinite(stats[0].loss_sum) and (after["version"] == 1).any()
    assert not np.array_equal(before, after["weights"])
    traffic = devs[1].traffic()
    assert traffic.lookup[1, 0] > 0 and traffic.dense[1, 0] > 0  # trainer 1 reads from the one server


def test_a_table_plan_with_no_remote_rows_sends_only_empty_messages(data):
    """Every row global on one node of two devices: a trainer reads nothing remotely; only totals travel."""
    tables = {t: TablePlan(t, np.full(r, GLOBAL, np.int8), (np.arange(r) % 2).astype(np.int32))
              for t, r in data.rows.items()}
    one_node = TOPOLOGIES[2].__class__(TOPOLOGIES[3].nodes[:1], 100.0)
    devs = in_process_devices(data, ShardingPlan("all-global", tuple(tables.values())), one_node)
    InProcess(devs).step(0, 0, 0, 0)
    t = sum(d.traffic().lookup for d in devs)
    assert t.sum() == 0
    assert sum(d.traffic().sync for d in devs).sum() > 0
    a, b = (d.parameters()["item"]["weights"] for d in devs)
    assert a.tobytes() == b.tobytes()
    assert torch.equal(devs[0].shard.weights["item"], devs[1].shard.weights["item"])


def test_a_shard_restores_in_place_and_a_damaged_checkpoint_changes_nothing(data, tmp_path):
    devs = in_process_devices(data, random_plan(data, 2, seed=4), TOPOLOGIES[2])
    driver = InProcess(devs)
    for i in range(2):
        driver.step(0, i, i, 0)
    saved = [d.save(str(tmp_path / "ckpt")) for d in devs]
    at_save = [d.parameters() for d in devs]
    driver.step(0, 2, 2, 0)
    moved = [d.parameters() for d in devs]
    weights = devs[0].shard.weights["item"]
    # Damage shard 1's Adagrad sums on disk: verification refuses it, before any array is read in place.
    state = tmp_path / "ckpt" / "shards" / "1" / "item" / "state"
    chunk = next(p for p in sorted(state.rglob("*")) if p.is_file() and p.name != "zarr.json")
    chunk.write_bytes(b"\x00" * chunk.stat().st_size)
    with pytest.raises(Exception, match=r"shards/1/item/state: .*(checksum|unreadable)"):
        devs[1].verify(str(tmp_path / "ckpt"), saved[1]["digests"])
    assert devs[1].parameters()["item"]["weights"].tobytes() == moved[1]["item"]["weights"].tobytes()
    devs[0].verify(str(tmp_path / "ckpt"), saved[0]["digests"])
    devs[0].load(str(tmp_path / "ckpt"), saved[0]["digests"], saved[0]["clock"], saved[0]["dense_steps"])
    assert devs[0].shard.clock == 2
    for t in ("item", "genre"):
        for f in ("weights", "state"):
            assert devs[0].parameters()[t][f].tobytes() == at_save[0][t][f].tobytes()
    assert devs[0].shard.weights["item"] is weights  # restored into the same tensor, not a second copy


@pytest.mark.parametrize("before, after, optimizer", [(4, 2, OPTIMIZER), (3, 4, OPTIMIZER), (2, 1, OPTIMIZER),
                                                      (3, 2, ADAM)], ids=["4-2", "3-4", "2-1", "3-2-adam"])
def test_a_checkpoint_moves_onto_another_plan_and_training_goes_on_as_the_reference_does(data, tmp_path, before,
                                                                                          after, optimizer):
    """A topology that lost (or gained) devices: the checkpoint's rows, their optimizer state, versions and dense
    state land on a plan of the devices there are now, and the steps after it learn what the reference learns."""
    old = in_process_devices(data, random_plan(data, before, seed=5), TOPOLOGIES[before], optimizer=optimizer)
    for i in range(2):
        InProcess(old).step(0, i, i, 0)
    saved = [d.save(str(tmp_path / "ckpt")) for d in old]
    digests = {k: v for s in saved for k, v in s["digests"].items()}
    at_save = {t: {} for t in data.rows}
    for p in (d.parameters() for d in old):
        for t in data.rows:
            at_save[t].update({i: (w.tobytes(), a.tobytes(), v) for i, w, a, v in zip(
                p[t]["ids"].tolist(), p[t]["weights"], p[t]["state"], p[t]["version"], strict=True)})
    new = in_process_devices(data, random_plan(data, after, seed=6), TOPOLOGIES[after], optimizer=optimizer)
    for k in range(before):
        new[k % after].verify(str(tmp_path / "ckpt"), digests, k)
    moved = [d.restore(str(tmp_path / "ckpt"), digests, before, 2, saved[0]["dense_steps"]) for d in new]
    assert all(moved) and all(d.shard.clock == 2 for d in new)
    for p in (d.parameters() for d in new):
        for t in data.rows:
            assert [at_save[t][i] for i in p[t]["ids"].tolist()] == [
                (w.tobytes(), a.tobytes(), v)
                for w, a, v in zip(p[t]["weights"], p[t]["state"], p[t]["version"], strict=True)]
    assert all(np.array_equal(new[0].parameters()["dense"][k], v) for k, v in old[0].parameters()["dense"].items())
    for i in range(2, 4):
        InProcess(new).step(0, i, i, 0)
    check_against(reference(data, 4, optimizer=optimizer), [d.parameters() for d in new])


def test_a_checkpoint_of_the_same_plan_is_read_in_place_and_one_without_ids_moves_nowhere(data, tmp_path):
    devs = in_process_devices(data, random_plan(data, 2, seed=4), TOPOLOGIES[2])
    InProcess(devs).step(0, 0, 0, 0)
    saved = [d.save(str(tmp_path / "ckpt")) for d in devs]
    digests = {k: v for s in saved for k, v in s["digests"].items()}
    again = in_process_devices(data, random_plan(data, 2, seed=4), TOPOLOGIES[2])
    assert [d.restore(str(tmp_path / "ckpt"), digests, 2, 1, 1) for d in again] == [False, False]
    elsewhere = in_process_devices(data, random_plan(data, 1, seed=4), TOPOLOGIES[1])
    without_ids = {k: v for k, v in digests.items() if not k.endswith("/ids")}
    with pytest.raises(InputError, match=r"shard 0 has no ids of table .*accepted: a resume on the devices it was"):
        elsewhere[0].restore(str(tmp_path / "ckpt"), without_ids, 2, 1, 1)


def test_one_phase_per_device_and_a_fresh_state_for_every_step(data):
    devs = in_process_devices(data, random_plan(data, 3, seed=3), TOPOLOGIES[3])
    assert all(d.protocol.phase is Phase.IDLE and d.protocol.state is None for d in devs)
    seen = []
    for step in range(2):
        outboxes = [d.start(0, step, step, 0) for d in devs]
        assert all(d.protocol.phase is Phase.WAITING and d.protocol.state.step == step for d in devs)
        seen.append(devs[0].protocol.state)
        for round in devs[0].rounds:
            inboxes = [[out[r] for out in outboxes if r in out] for r in range(3)]
            outboxes = [d.receive(round, inbox) or {} for d, inbox in zip(devs, inboxes, strict=True)]
            if round is Round.REQUEST:
                assert [d.protocol.expecting for d in devs] == [Round.REPLY] * 3
        [d.finish() for d in devs]
        assert all(d.protocol.phase is Phase.IDLE for d in devs)
    assert seen[0] is not seen[1] and seen[0].step == 0 and not any(seen[0].pending.values())


class FakeShard:
    """What the protocol reads of a shard: row r of every table is [r, 10 r]; it writes nothing (the host does)."""

    dim, device, clock = 2, torch.device("cpu"), 0

    def __init__(self, dense: bool) -> None:
        self.dense = {"w": torch.tensor([0.5])} if dense else {}

    @property
    def dense_layers(self) -> dict[str, torch.Tensor]:
        return self.dense

    def check_clock(self, step: int) -> None:
        assert step == self.clock

    def read(self, table: str, ids: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.stack([ids, 10 * ids], axis=1).astype(np.float32))


def plain(instructions) -> list:
    """Instructions as plain values, to compare whole lists exactly."""
    def message(m):
        return (m.round.value, m.step, m.sender, [(b.kind.value, b.table, b.ids.tolist(),
                                                    None if b.values is None else b.values.tolist()) for b in m.blocks],
                None if m.dense is None else {k: v.tolist() for k, v in m.dense.items()})
    out = []
    for i in instructions:
        if isinstance(i, Send):
            out.append(("send", {p: message(m) for p, m in i.outbox.items()}))
        elif isinstance(i, Compute):
            out.append(("compute", {t: r.tolist() for t, r in i.rows.items()},
                        {k: v.tolist() for k, v in i.dense.items()}))
        elif isinstance(i, Apply):
            out.append(("apply", i.table, i.ids.tolist(), i.grads.tolist(), i.step))
        elif isinstance(i, ApplyDense):
            out.append(("apply-dense", {k: v.tolist() for k, v in i.grads.items()}))
        else:
            out.append(("end", i.step))
    return out


def test_events_in_instructions_out_on_two_devices_of_one_node():
    """Table item, rows 0..3 homed 0, 1, 0, 1 (single copies); device 0 reads rows 1 and 2, device 1 row 0."""
    topology = Topology((Node("a", 2, 10.0),), 100.0)
    plan = ShardingPlan("t", (TablePlan("item", np.full(4, SINGLE, np.int8), np.array([0, 1, 0, 1], np.int32)),))
    tables = plan.for_devices(2)
    p0, p1 = (StepProtocol(d, topology, tables, FakeShard(dense=d == 0)) for d in (0, 1))
    assert p0.rounds == (Round.REQUEST, Round.REPLY, Round.GRADIENTS)

    ask0, ask1 = p0.start(p0.requests(0, {"item": np.array([1, 2])})), p1.start(p1.requests(0, {"item": np.array([0])}))
    assert plain(ask0) == [("send", {1: ("request", 0, 0, [("lookup", "item", [1], None)], None)})]
    assert plain(ask1) == [("send", {0: ("request", 0, 1, [("lookup", "item", [0], None)], None)})]

    reply0, reply1 = p0.receive(Round.REQUEST, [ask1[0].outbox[0]]), p1.receive(Round.REQUEST, [ask0[0].outbox[1]])
    assert plain(reply0) == [("send", {1: ("reply", 0, 0, [("lookup", "item", [], [[0.0, 0.0]])], {"w": [0.5]})})]
    assert plain(reply1) == [("send", {0: ("reply", 0, 1, [("lookup", "item", [], [[1.0, 10.0]])], None)})]

    work0, work1 = p0.receive(Round.REPLY, [reply1[0].outbox[0]]), p1.receive(Round.REPLY, [reply0[0].outbox[1]])
    assert plain(work0) == [("compute", {"item": [[1.0, 10.0], [2.0, 20.0]]}, {"w": [0.5]})]
    assert plain(work1) == [("compute", {"item": [[0.0, 0.0]]}, {"w": [0.5]})]
    assert p0.phase is Phase.COMPUTING

    grads0 = p0.gradients({"item": torch.tensor([[1.0, 1.0], [2.0, 2.0]])}, {"w": torch.tensor([1.0])})
    grads1 = p1.gradients({"item": torch.tensor([[3.0, 3.0]])}, {"w": torch.tensor([2.0])})
    assert plain(grads0) == [("send", {1: ("gradients", 0, 0, [("lookup", "item", [1], [[1.0, 1.0]])], None)})]
    assert plain(grads1) == [("send", {0: ("gradients", 0, 1, [("lookup", "item", [0], [[3.0, 3.0]])], {"w": [2.0]})})]

    # Each home sums what it owns, in sender order, and the host applies it; device 0 also the dense sum.
    assert plain(p0.receive(Round.GRADIENTS, [grads1[0].outbox[0]])) == [
        ("apply", "item", [0, 2], [[3.0, 3.0], [2.0, 2.0]], 0), ("apply-dense", {"w": [3.0]}), ("end", 0)]
    assert plain(p1.receive(Round.GRADIENTS, [grads0[0].outbox[1]])) == [
        ("apply", "item", [1], [[1.0, 1.0]], 0), ("end", 0)]
    assert p0.phase is Phase.IDLE and p1.phase is Phase.IDLE


def test_on_two_nodes_each_copy_sends_its_nodes_partial_sum_and_both_apply_the_same_total():
    """Two nodes of one device: row 0 a node row homed on device 0 (device 1 holds node b's copy), row 1 single
    on device 1. Device 0 reads rows 0 and 1, device 1 row 0: one EXCHANGE round replaces TO_PRIMARY and
    TOTALS, and both copies add the two partial sums in node order."""
    topology = Topology((Node("a", 1, 10.0), Node("b", 1, 10.0)), 100.0)
    plan = ShardingPlan("t", (TablePlan("item", np.array([NODE, SINGLE], np.int8), np.array([0, 1], np.int32)),))
    tables = plan.for_devices(2)
    p0, p1 = (StepProtocol(d, topology, tables, FakeShard(dense=d == 0)) for d in (0, 1))
    assert p0.rounds == (Round.REQUEST, Round.REPLY, Round.GRADIENTS, Round.EXCHANGE)

    ask0, ask1 = p0.start(p0.requests(0, {"item": np.array([0, 1])})), p1.start(p1.requests(0, {"item": np.array([0])}))
    assert plain(ask1) == [("send", {0: ("request", 0, 1, [], None)})]  # its node's copy of row 0 is its own
    reply0, reply1 = p0.receive(Round.REQUEST, [ask1[0].outbox[0]]), p1.receive(Round.REQUEST, [ask0[0].outbox[1]])
    work0, work1 = p0.receive(Round.REPLY, [reply1[0].outbox[0]]), p1.receive(Round.REPLY, [reply0[0].outbox[1]])
    assert plain(work0) == [("compute", {"item": [[0.0, 0.0], [1.0, 10.0]]}, {"w": [0.5]})]
    assert plain(work1) == [("compute", {"item": [[0.0, 0.0]]}, {"w": [0.5]})]

    grads0 = p0.gradients({"item": torch.tensor([[1.0, 1.0], [2.0, 2.0]])}, {"w": torch.tensor([1.0])})
    grads1 = p1.gradients({"item": torch.tensor([[3.0, 3.0]])}, {"w": torch.tensor([2.0])})
    sums0 = p0.receive(Round.GRADIENTS, [grads1[0].outbox[0]])
    sums1 = p1.receive(Round.GRADIENTS, [grads0[0].outbox[1]])
    assert plain(sums0) == [("apply-dense", {"w": [3.0]}),
                            ("send", {1: ("exchange", 0, 0, [("sync", "item", [0], [[1.0, 1.0]])], None)})]
    assert plain(sums1) == [("apply", "item", [1], [[2.0, 2.0]], 0),
                            ("send", {0: ("exchange", 0, 1, [("sync", "item", [0], [[3.0, 3.0]])], None)})]

    assert plain(p0.receive(Round.EXCHANGE, [sums1[1].outbox[0]])) == [("apply", "item", [0], [[4.0, 4.0]], 0),
                                                                       ("end", 0)]
    assert plain(p1.receive(Round.EXCHANGE, [sums0[1].outbox[1]])) == [("apply", "item", [0], [[4.0, 4.0]], 0),
                                                                        ("end", 0)]
    assert p0.phase is Phase.IDLE and p1.phase is Phase.IDLE
