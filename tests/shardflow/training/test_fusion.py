"""A click log's small tables fused into one for the step (shardflow.training.fusion): the same plan row by row,
the same rows stored, the same bytes sent and bitwise the same parameters as the step table by table."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shardflow.data.clicks import load_training_data
from shardflow.model.configs import FUSED, ClickConfig, OptimizerConfig
from shardflow.planner.sharding_plan import GLOBAL, SINGLE, BlockRows, ModuloRows, TablePlan
from shardflow.planner.strategies import STRATEGIES
from shardflow.training import fusion
from shardflow.training.fusion import TableGroup
from shardflow.training.inprocess import InProcess
from shardflow.training.shard import ParameterShard, RowLayout
from storage.dataset import Dataset
from storage.importers import import_dataset
from support import OPTIMIZER, REAL, TOPOLOGIES, in_process_devices, planned, random_case

pytestmark = pytest.mark.unit

BATCH, STEPS = 24, 3


@pytest.fixture(scope="module")
def movielens(tmp_path_factory):
    """MovieLens-100k as a click log: nine tables, two of them token sequences (genres, title words)."""
    path = tmp_path_factory.mktemp("movielens") / "ds"
    import_dataset("recbole", REAL["recbole"], path, label="rating>=4")
    ds = Dataset.open(path)
    model = ClickConfig(dim=8, bottom=(8,), mlp=(8,), features=tuple(ds.info.table_names), numeric=ds.info.dense)
    return str(path), model, load_training_data(ds, model.features)


def test_the_group_takes_the_tables_in_the_model_s_order_that_fit_and_spells_their_plans_out(monkeypatch):
    plans = {"a": TablePlan("a", np.array([GLOBAL, SINGLE, SINGLE], dtype=np.int8), np.array([0, 1, 0], np.int8),
                            np.array([1]), np.array([0b10])),
             "big": ModuloRows("big", 100, 2),
             "b": ModuloRows("b", 5, 2),
             "c": BlockRows("c", 4, 2)}
    monkeypatch.setattr(fusion, "FUSE_ROWS", 12)
    group = TableGroup.of(plans, ("a", "big", "b", "c"), devices=2)
    assert group is not None and group.tables == ("a", "b", "c") and group.offsets == {"a": 0, "b": 3, "c": 8}
    assert group.plan.tier.tolist() == [GLOBAL] + [SINGLE] * 11
    assert group.plan.home.tolist() == [0, 1, 0, 0, 1, 0, 1, 0, 0, 0, 1, 1]
    assert (group.plan.partial_ids.tolist(), group.plan.partial_nodes.tolist()) == ([1], [0b10])
    assert list(group.step_plans(plans)) == [FUSED, "big"]
    assert TableGroup.of(plans, ("big", "a"), devices=2) is None  # one table fits: nothing to fuse


def test_a_fused_shard_s_tables_are_views_of_the_rows_the_step_reads_and_updates():
    config = ClickConfig(dim=4, features=("a", "b"))
    layouts = {"a": RowLayout("a", stored=np.array([0, 2, 4])), "b": RowLayout("b", stored=np.array([1, 3]))}
    plans = {t: ModuloRows(t, 6, 2) for t in ("a", "b")}
    group = TableGroup.of(plans, ("a", "b"), devices=2)
    shard = ParameterShard(0, layouts, config, OptimizerConfig(), group=group)
    plain = ParameterShard(0, layouts, config, OptimizerConfig())
    for t in ("a", "b"):  # the same initial rows as a shard table by table
        assert torch.equal(shard.weights[t], plain.weights[t])
    fused_ids = np.array([6 + 3, 2])  # table b's row 3, table a's row 2
    assert torch.equal(shard.read(FUSED, fused_ids), torch.stack([plain.weights["b"][1], plain.weights["a"][1]]))
    grads = torch.ones((2, 4))
    shard.apply(FUSED, fused_ids, grads, step=0)
    plain.apply("b", np.array([3]), grads[:1], step=0)
    plain.apply("a", np.array([2]), grads[1:], step=0)
    for t in ("a", "b"):
        assert torch.equal(shard.weights[t], plain.weights[t]) and torch.equal(shard.state[t], plain.state[t])
        assert np.array_equal(shard.version[t], plain.version[t])
    shard.weights["a"][torch.tensor([0])] = 7.0  # a write into a table, as a restore makes it
    assert (shard.read(FUSED, np.array([0])) == 7.0).all()
    with pytest.raises(Exception, match="id 11 is not stored"):
        shard.read(FUSED, np.array([11]))


def _trained(data, model, plan, topology, dedup, fuse, optimizer=OPTIMIZER):
    devs = in_process_devices(data, plan, topology, dedup, batch=BATCH, model=model, optimizer=optimizer, fuse=fuse)
    driver = InProcess(devs)
    losses = [sum(s.loss_sum for s in driver.step(0, i, i, 0)) for i in range(STEPS)]
    return devs, losses


def _same(fused, apart):
    (devs, losses), (ref, ref_losses) = fused, apart
    assert losses == ref_losses
    for d, r in zip(devs, ref, strict=True):
        got, want = d.parameters(), r.parameters()
        assert got.keys() == want.keys()
        for t in want:
            for k in want[t]:
                assert np.array_equal(got[t][k], want[t][k]), (d.index, t, k)
        assert all((getattr(d.traffic(), k) == getattr(r.traffic(), k)).all() for k in ("lookup", "sync", "dense"))


@pytest.mark.parametrize("dedup", ["none", "device", "node"])
@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_the_fused_step_trains_bitwise_what_the_step_table_by_table_trains_and_sends_the_same(movielens, strategy,
                                                                                             dedup):
    path, model, data = movielens
    plan = planned(path, strategy, 3, dim=model.dim, batch=BATCH)
    devs, _ = fused = _trained(data, model, plan, TOPOLOGIES[3], dedup, fuse=True)
    assert all(d.group is not None and d.group.tables == model.features for d in devs)
    _same(fused, _trained(data, model, plan, TOPOLOGIES[3], dedup, fuse=False))


@pytest.mark.parametrize("seed", range(3))
def test_on_random_plans_and_topologies_the_fused_step_is_the_step_table_by_table(movielens, seed):
    """support.random_case: 1-4 nodes of 1-3 devices, random tiers and homes (node rows on some nodes only),
    a random scope and row optimizer."""
    path, model, data = movielens
    topology, plan, dedup, optimizer = random_case(data, seed)
    _same(_trained(data, model, plan, topology, dedup, True, optimizer),
          _trained(data, model, plan, topology, dedup, False, optimizer))


@pytest.mark.parametrize("fuse_rows", [1 << 22, 2_000])
def test_with_bags_first_and_tables_left_out_the_vectors_keep_the_model_s_order(movielens, monkeypatch, fuse_rows):
    """Title words and genres first, then the one-id tables backwards; with 2,000 rows the movies (1,682 rows) and
    the title words (2,652) are left out of the group and read from rows of their own."""
    path, model, data = movielens
    monkeypatch.setattr(fusion, "FUSE_ROWS", fuse_rows)
    bags = ("movie_title", "class")
    model = ClickConfig(dim=8, bottom=(8,), mlp=(8,), numeric=model.numeric, seed=3,
                        features=(*bags, *(t for t in reversed(model.features) if t not in bags)))
    plan = planned(path, "flexshard", 2, dim=model.dim, batch=BATCH)
    devs, _ = fused = _trained(data, model, plan, TOPOLOGIES[2], "device", fuse=True)
    left_out = {t for t in model.features if t not in devs[0].group.tables}
    assert left_out == (set() if fuse_rows > 2_000 else {"item", "movie_title"})
    _same(fused, _trained(data, model, plan, TOPOLOGIES[2], "device", fuse=False))
