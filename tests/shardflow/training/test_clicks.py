"""Click logs on the same engine: the DLRM trained under any plan learns what the reference learns.

The bundled Criteo and Avazu samples are imported with small hashed tables (64 rows),
so ids collide and every table is read by many examples of a batch.
"""

from __future__ import annotations

import numpy as np
import pytest

from shardflow.data.batches import CACHED_BLOCKS
from shardflow.data.clicks import HELD_OUT, ClickData, load_training_data
from shardflow.errors import InputError
from shardflow.model.configs import ClickConfig
from shardflow.model.forward import logits, on_device
from shardflow.model.metrics import average_ranks, log_loss, roc_auc
from shardflow.planner.strategies import STRATEGIES
from shardflow.training.config import TrainConfig
from shardflow.training.engine import Engine
from shardflow.training.inprocess import InProcess
from storage.dataset import Dataset
from storage.importers import import_dataset
from support import (
    AVAZU,
    OPTIMIZER,
    REAL,
    TOPOLOGIES,
    check_against,
    in_process_devices,
    planned,
    random_case,
    reference,
)

CLICK_BATCH = 24
CLICK_STEPS = 3


def _imported(tmp_path_factory, name: str):
    path = tmp_path_factory.mktemp("clicks") / name
    if name == "movielens":  # with token sequences (genres, title words): several rows of a table per example
        import_dataset("recbole", REAL["recbole"], path, label="rating>=4")
    else:
        import_dataset("criteo", REAL["criteo"] if name == "criteo" else AVAZU, path, hash_rows=64)
    ds = Dataset.open(path)
    model = ClickConfig(dim=4, bottom=(8,), mlp=(8,), features=tuple(ds.info.table_names), numeric=ds.info.dense,
                        seed=1)
    return str(path), model, load_training_data(ds, model.features)


@pytest.fixture(scope="module", params=["criteo", "avazu", "movielens"])
def clicks(request, tmp_path_factory):
    """Either sample or MovieLens: the checks of the data and of exactness in process run on every layout."""
    return _imported(tmp_path_factory, request.param)


@pytest.fixture(scope="module")
def movielens(tmp_path_factory):
    """MovieLens-100k with its genres and title words (tables of token sequences): every scope in process."""
    return _imported(tmp_path_factory, "movielens")


@pytest.fixture(scope="module")
def criteo(tmp_path_factory):
    """The Criteo sample alone: the full grid in process and the cluster's checks (the Avazu layout differs
    only in its examples, which the cells on `clicks` cover)."""
    return _imported(tmp_path_factory, "criteo")


def test_the_held_out_rows_are_the_last_tenth_and_never_trained_on(clicks):
    path, model, data = clicks
    assert isinstance(data, ClickData)
    n = Dataset.open(path).info.interactions
    held = int(np.ceil(HELD_OUT * n))
    np.testing.assert_array_equal(data.eval_targets, np.arange(n - held, n))
    np.testing.assert_array_equal(np.sort(data.train_targets()), np.arange(n - held))
    batch = data.batch(0, 0, 0, CLICK_BATCH)
    assert batch.size == CLICK_BATCH and np.unique(batch).size == CLICK_BATCH and batch.max() < n - held
    assert not np.array_equal(batch, data.batch(1, 0, 0, CLICK_BATCH)), "every epoch has its own order"
    val = load_training_data(path, model.features, validation=True)
    kept = int(np.ceil(HELD_OUT * (n - held)))  # the last tenth of the rows before the test rows
    np.testing.assert_array_equal(val.eval_targets, data.eval_targets)
    np.testing.assert_array_equal(val.validation_targets, np.arange(n - held - kept, n - held))
    np.testing.assert_array_equal(np.sort(val.train_targets()), np.arange(n - held - kept))


def test_examples_carry_the_stored_ids_numeric_columns_and_labels(clicks):
    path, model, data = clicks
    ds = Dataset.open(path)
    rows = np.array([0, 7, ds.info.interactions - 5, 3])
    ex = data.examples(rows, model)
    np.testing.assert_array_equal(ex.labels, ds.column("labels")[rows])
    for t in model.features:
        np.testing.assert_array_equal(ex.ids[t], ds.ids(t)[rows])
    for k, n in enumerate(model.numeric):
        np.testing.assert_array_equal(ex.numeric[:, k], ds.column(f"dense/{n}")[rows])
    assert ex.numeric.shape == (4, len(model.numeric))


def _learns_what_the_reference_learns(path, model, data, strategy, devices, dedup):
    plan = planned(path, strategy, devices, dim=model.dim, batch=CLICK_BATCH)
    devs = in_process_devices(data, plan, TOPOLOGIES[devices], dedup, batch=CLICK_BATCH, model=model)
    driver = InProcess(devs)
    for i in range(CLICK_STEPS):
        stats = driver.step(0, i, i, 0)
        assert sum(s.examples for s in stats) == CLICK_BATCH
    ref = reference(data, CLICK_STEPS, model, CLICK_BATCH)
    check_against(ref, [d.parameters() for d in devs])
    start = {k: v for k, v in model.init_dense().items()}
    assert max(np.abs(ref.dense[k] - start[k]).max() for k in start) > 1e-4, "training changed nothing"


@pytest.mark.parametrize("dedup", ["none", "device", "node"])
@pytest.mark.parametrize("devices", [1, 2, 3, 4])
@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_every_strategy_and_scope_learns_what_the_reference_learns(criteo, strategy, devices, dedup):
    _learns_what_the_reference_learns(*criteo, strategy, devices, dedup)


@pytest.mark.parametrize("seed", range(6))
def test_a_random_topology_and_plan_learn_what_the_reference_learns_on_every_layout(clicks, seed):
    """support.random_case: 1-4 nodes of 1-3 devices, random tiers and homes, a random scope and row optimizer."""
    path, model, data = clicks
    topology, plan, dedup, optimizer = random_case(data, seed)
    devs = in_process_devices(data, plan, topology, dedup, batch=CLICK_BATCH, model=model, optimizer=optimizer)
    driver = InProcess(devs)
    for i in range(CLICK_STEPS):
        assert sum(s.examples for s in driver.step(0, i, i, 0)) == CLICK_BATCH
    check_against(reference(data, CLICK_STEPS, model, CLICK_BATCH, optimizer), [d.parameters() for d in devs])


def test_a_click_trainer_whose_sub_batch_is_empty_still_takes_its_part_in_the_step(clicks):
    path, model, data = clicks
    batch, steps = 4, 8  # one row per trainer on average: some trainer gets none in most steps
    devs = in_process_devices(data, planned(path, "flexshard", 4, dim=model.dim, batch=batch), TOPOLOGIES[4],
                              "node", batch=batch, model=model)
    driver = InProcess(devs)
    sizes = [[s.examples for s in driver.step(0, i, i, 0)] for i in range(steps)]
    assert all(sum(step) == batch for step in sizes)
    assert sum(min(step) == 0 for step in sizes) >= 2, sizes
    check_against(reference(data, steps, model, batch), [d.parameters() for d in devs])


@pytest.mark.parametrize("trainers", [1, 2, 3])
def test_a_trainer_holds_every_column_of_its_part_only_and_the_memory_check_counts_it(criteo, trainers):
    path, model, _ = criteo
    data = load_training_data(Dataset.open(path), model.features)
    data.read_in_parts(trainers)
    data.examples(data.sub_batches(data.train_targets(), trainers)[-1], model)
    (part,) = data._cache.values()  # the sample is one block: this trainer's part of it
    rows, held = Dataset.open(path).info.interactions, part.columns["labels"].size
    assert abs(held - rows / trainers) < 1 and len(part.columns) == len(data.columns)
    assert all(v.shape == (held,) for v in part.columns.values())  # every column of the same rows
    row_bytes = sum(v.dtype.itemsize for v in part.columns.values())
    assert data.held_bytes(trainers) == CACHED_BLOCKS * -(-rows // trainers) * row_bytes


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_every_strategy_learns_what_the_reference_learns_on_every_layout(clicks, strategy):
    _learns_what_the_reference_learns(*clicks, strategy, 3, "node")


@pytest.mark.parametrize("dedup", ["none", "device", "node"])
@pytest.mark.parametrize("devices", [1, 2, 4])
def test_tables_of_token_sequences_learn_what_the_reference_learns_in_every_scope(movielens, devices, dedup):
    path, model, data = movielens
    ex = data.examples(data.batch(0, 0, 0, CLICK_BATCH), model)
    held = (ex.ids["class"] >= 0).sum(axis=1)
    assert held.max() > 1 and ex.ids["movie_title"].shape == (CLICK_BATCH, 15), "several rows of a table an example"
    _learns_what_the_reference_learns(path, model, data, "flexshard", devices, dedup)


def test_the_engine_trains_evaluates_and_exports_a_click_model(client, criteo, tmp_path):
    path, model, data = criteo
    plan = planned(path, "flexshard", 4, dim=model.dim, batch=CLICK_BATCH)
    train = TrainConfig(CLICK_BATCH, "node", epochs=2, eval_users=None)
    with Engine(client, path, plan, TOPOLOGIES[4], model, OPTIMIZER, train) as e:
        result = e.fit()
        shards = e.parameters()
        metrics = e.evaluate()
        manifest = e.export(tmp_path / "model")
    steps = data.steps_per_epoch(CLICK_BATCH)
    assert result.steps == 2 * steps and len(result.epoch_loss) == 2
    ref = reference(data, 0, model, CLICK_BATCH)
    for epoch in range(2):
        for i in range(steps):
            ref.step(epoch, i)
    check_against(ref, shards)
    assert manifest.model["kind"] == "click"
    assert metrics.users == data.eval_targets.size and metrics.hr_at_10 is None and metrics.ndcg_at_10 is None
    logit = _reference_logits(ref, data, model)
    labels = data.examples(data.eval_targets, model).labels
    assert metrics.auc == pytest.approx(roc_auc(logit, labels), abs=1e-6)
    assert metrics.logloss == pytest.approx(log_loss(logit, labels), rel=1e-4)


def _reference_logits(ref, data, model) -> np.ndarray:
    import torch

    ex = data.examples(data.eval_targets, model)
    index = on_device(data.table_index(ex, model), torch.device("cpu"))
    with torch.no_grad():
        return logits(model, ref.dense_tensors, ref.tables, index).numpy()


def test_auc_and_log_loss_against_their_definitions():
    rng = np.random.default_rng(3)
    logit = rng.normal(size=60).round(1)  # ties among positives and negatives
    label = (rng.random(60) < 0.4).astype(np.float32)
    pos, neg = logit[label == 1], logit[label == 0]
    pairs = (pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()
    assert roc_auc(logit, label) == pytest.approx(pairs / (pos.size * neg.size), rel=1e-12)
    p = 1 / (1 + np.exp(-logit))
    assert log_loss(logit, label) == pytest.approx(-np.mean(label * np.log(p) + (1 - label) * np.log(1 - p)), rel=1e-9)
    assert np.isnan(roc_auc(logit, np.ones(60)))
    assert average_ranks(np.array([3.0, 1.0, 3.0, 2.0, 3.0])).tolist() == [4.0, 1.0, 4.0, 2.0, 4.0]


def test_unknown_categorical_tables_are_refused_by_name(clicks):
    path, model, data = clicks
    with pytest.raises(InputError, match=f"categorical tables \\['nope'\\]; accepted: some of {model.features[0]}, "):
        load_training_data(path, ("nope",))


def test_a_click_checkpoint_resumes_bitwise_and_its_export_warm_starts_another_plan(client, criteo, tmp_path):
    from storage.checkpoint import verify_export

    path, model, data = criteo
    train = TrainConfig(CLICK_BATCH, "device")
    with Engine(client, path, planned(path, "flexshard", 4, dim=model.dim, batch=CLICK_BATCH), TOPOLOGIES[4], model,
                OPTIMIZER, train) as e:
        plan = e.plan
        for i in range(2):
            e.step(0, i)
        e.checkpoint(tmp_path / "run" / "checkpoints" / "epoch-000001", 1)
        for i in range(2, 4):
            e.step(0, i)
        uninterrupted = e.parameters()
        e.export(tmp_path / "model", epochs=1)
    with Engine(client, path, plan, TOPOLOGIES[4], model, OPTIMIZER, train) as e:
        assert e.restore(tmp_path / "run" / "checkpoints" / "epoch-000001")[0].step == 2
        for i in range(2, 4):
            e.step(0, i)
        resumed = e.parameters()
    for a, b in zip(uninterrupted, resumed, strict=True):
        for t in model.features:
            assert a[t]["weights"].tobytes() == b[t]["weights"].tobytes()
        for k in a.get("dense", {}):
            assert a["dense"][k].tobytes() == b["dense"][k].tobytes()
    other = planned(path, "table-wise", 2, dim=model.dim, batch=CLICK_BATCH)
    with Engine(client, path, other, TOPOLOGIES[2], model, OPTIMIZER, train) as e:
        e.warm_start(tmp_path / "model", verify_export(tmp_path / "model"))
        started = e.parameters()
    for k, v in uninterrupted[0]["dense"].items():
        assert started[0]["dense"][k].tobytes() == v.tobytes()
    for t in model.features:
        exported = {}
        for shard in uninterrupted:
            exported.update(zip(shard[t]["ids"].tolist(), shard[t]["weights"], strict=True))
        for shard in started:
            for i, row in zip(shard[t]["ids"].tolist(), shard[t]["weights"], strict=True):
                assert row.tobytes() == exported[i].tobytes(), (t, i)


def test_a_window_trains_its_parts_and_holds_out_the_last_tenth_of_those_it_is_evaluated_on(tmp_path):
    from shardflow.data.clicks import training_window_start

    lines = REAL["criteo"].read_text().splitlines()
    (tmp_path / "logs").mkdir()
    for name, rows in (("day1.csv", lines[1:101]), ("day2.csv", lines[101:191]), ("day3.csv", lines[191:])):
        (tmp_path / "logs" / name).write_text("\n".join([lines[0], *rows]) + "\n")
    import_dataset("criteo", tmp_path / "logs", tmp_path / "ds", hash_rows=64)
    ds = Dataset.open(tmp_path / "ds")
    late = ClickData(ds, ("C1",), (2, 2))
    ex = late.examples(np.arange(ds.info.interactions), ClickConfig(dim=4, bottom=(8,), mlp=(8,), features=("C1",),
                                                                    numeric=ds.info.dense))
    assert ds._layout is None, "click rows are read as stored: no user-ordered view, no per-row offsets"
    np.testing.assert_array_equal(ex.ids["C1"], ds.ids("C1"))  # the stored order is the user order
    np.testing.assert_array_equal(ex.labels, ds.column("labels"))
    for a, b in ((0, 100), (95, 105), (99, 191), (150, 400), (0, 0)):
        np.testing.assert_array_equal(ds.stored_column("tables/C2", a, b), ds.ids("C2", a, b))
    np.testing.assert_array_equal(late.eval_targets, [199])  # ceil(10% of day 3's 9 rows)
    np.testing.assert_array_equal(late.train_targets(), np.arange(190, 199))
    wide = ClickData(ds, ("C1",), (1, 2))
    np.testing.assert_array_equal(wide.train_targets(), np.arange(100, 199))
    assert training_window_start(ds, 2, batch_size=8, eval_from=2) == 2
    assert training_window_start(ds, 2, batch_size=16, eval_from=2) == 1  # day 3 alone holds 9 training rows
    assert training_window_start(ds, 2, batch_size=500, eval_from=2) == 0
