"""What a model version trains on (windows over parts) and where it starts from (a warm start onto any plan)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import zarr

from shardflow.data.batches import CACHED_BLOCKS, TrainData, window_start
from shardflow.data.examples import examples_from
from shardflow.data.synthetic import SynthTable, synth_dataset
from shardflow.errors import InputError
from shardflow.model.configs import ModelConfig
from shardflow.model.sequence import init_rows
from shardflow.planner.sharding_plan import SINGLE, ShardingPlan, TablePlan
from shardflow.sharding.stage import extend_plan
from shardflow.training.config import TrainConfig
from shardflow.training.engine import Engine
from storage.checkpoint import verify_export
from storage.dataset import Dataset
from storage.importers import import_dataset
from support import ADAM, OPTIMIZER, TOPOLOGIES, random_plan

# Three days of a sasrec log: user 1 on every day, user 2 on days 1 and 3, user 3 new on day 3.
DAYS = ["1 10\n1 11\n1 12\n2 20\n2 21\n2 22\n", "1 13\n1 14\n", "1 15\n2 23\n2 24\n3 30\n3 31\n3 32\n"]
MODEL = ModelConfig(dim=4, mlp=(4,), history=3, negatives=1)


@pytest.fixture(scope="module")
def days(tmp_path_factory):
    root = tmp_path_factory.mktemp("windows")
    (root / "parts").mkdir()
    stores = []
    for d, text in enumerate(DAYS, start=1):
        (root / "parts" / f"day-{d}.txt").write_text(text)
        import_dataset("sasrec", root / "parts", root / "ds", append=d > 1)
        stores.append(root / f"ds-{d}")
        import_dataset("sasrec", root / "parts", stores[-1])  # the same parts at once, for comparisons
    return root


def test_every_event_knows_its_part_in_user_order(days):
    ds = Dataset.open(days / "ds")
    # user order: user 1 (days 1,1,1,2,2,3), user 2 (1,1,1,3,3), user 3 (3,3,3)
    assert ds.event_segments().tolist() == [0, 0, 0, 1, 1, 2, 0, 0, 0, 2, 2, 2, 2, 2]
    assert ds.ids("item").tolist() == Dataset.open(days / "ds-3").ids("item").tolist()


def test_a_window_trains_the_new_events_and_each_users_last_held_out_one(days):
    every = TrainData.load(days / "ds")
    assert every.train_targets().tolist() == [1, 2, 3, 4, 7, 8, 9, 12] and every.eval_targets.tolist() == [5, 10, 13]
    third = TrainData.load(days / "ds", window=(2, 2))
    # user 1: event 4 (day 2, held out by the version of days 1-2) joins; 5 is held out now.
    # user 2: event 8 (day 1, its last before day 3) and 9 (day 3); user 3: event 12.
    assert third.train_targets().tolist() == [4, 8, 9, 12] and third.eval_targets.tolist() == [5, 10, 13]
    second = TrainData.load(days / "ds", window=(1, 1))
    assert second.eval_targets.tolist() == [5, 10, 13] and 1 not in second.train_targets().tolist()


def test_with_a_validation_split_a_window_trains_what_the_version_before_held_out_for_validation(days):
    every = TrainData.load(days / "ds", validation=True)
    # user 1 (events 0..5): trains 1..3, validates on 4; user 2 (6..10): 7, 8 and 9; user 3 (11..13): 12.
    assert every.train_targets().tolist() == [1, 2, 3, 7, 8]
    assert every.validation_targets.tolist() == [4, 9, 12] and every.eval_targets.tolist() == [5, 10, 13]
    third = TrainData.load(days / "ds", window=(2, 2), validation=True)
    # The version of days 1-2 held out user 1's 3 (validation) and 4 (test): 3 trains now, 4 validates.
    assert third.train_targets().tolist() == [3, 7, 8] and third.validation_targets.tolist() == [4, 9, 12]
    assert window_start(days / "ds", 2, batch_size=3, validation=True) == 2
    assert window_start(days / "ds", 2, batch_size=4, validation=True) == 1
    assert window_start(days / "ds", 2, batch_size=6, validation=True) == 0
    with pytest.raises(InputError, match="no validation split was held out"):
        _ = TrainData.load(days / "ds").validation_targets


def test_a_window_too_small_for_one_batch_widens_to_earlier_parts(days):
    assert window_start(days / "ds", 2, batch_size=4) == 2
    assert window_start(days / "ds", 2, batch_size=5) == 1
    assert window_start(days / "ds", 2, batch_size=8) == 0 and window_start(days / "ds", 2, batch_size=99) == 0
    assert window_start(days / "ds", 0, batch_size=4) == 0


def test_an_old_plan_extended_keeps_every_placement_and_stores_new_rows_once_by_id():
    old = ShardingPlan("flexshard", (TablePlan("item", np.array([0, 2, 1], np.int8), np.array([1, 0, 2], np.int32)),))
    grown = extend_plan(old, {"item": 6}, devices=4)
    t = grown.table("item")
    assert t.tier.tolist() == [0, 2, 1, SINGLE, SINGLE, SINGLE] and t.home.tolist() == [1, 0, 2, 3, 0, 1]
    assert grown.strategy == "flexshard" and old.table("item").rows == 3


@pytest.mark.parametrize("model, optimizer", [(MODEL, OPTIMIZER),
                                              (replace(MODEL, encoder="self-attention", heads=2, dropout=0.1), ADAM)],
                         ids=["mean", "self-attention-adam-rows"])
def test_a_warm_start_places_the_export_onto_a_plan_for_another_device_count(client, days, tmp_path, model,
                                                                             optimizer):
    two = TrainData.load(days / "ds-2")
    plan_two = random_plan(two, 2, seed=3)
    with Engine(client, str(days / "ds-2"), plan_two, TOPOLOGIES[2], model, optimizer, TrainConfig(2)) as e:
        e.step(0, 0)
        e.export(tmp_path / "model")
    manifest = verify_export(tmp_path / "model")
    old_rows = manifest.tables["item"]
    three = TrainData.load(days / "ds-3")
    plan_three = random_plan(three, 3, seed=5)
    assert manifest.row_optimizer == optimizer.rows
    with Engine(client, str(days / "ds-3"), plan_three, TOPOLOGIES[3], model, optimizer, TrainConfig(3)) as e:
        e.warm_start(tmp_path / "model", manifest)
        shards = e.parameters()
    exported = zarr.open_array(str(tmp_path / "model" / "tables" / "item"), mode="r")[...]
    state = zarr.open_array(str(tmp_path / "model" / "state" / "item"), mode="r")[...]
    fresh = init_rows("item", np.arange(three.rows["item"]), model.dim, model.seed)
    seen = set()
    for shard in shards:
        ids, w = shard["item"]["ids"], shard["item"]["weights"]
        old = ids < old_rows
        assert w[old].tobytes() == exported[ids[old]].tobytes()  # carried exactly, wherever it now lives
        assert shard["item"]["state"][old].tobytes() == state[ids[old]].tobytes()
        assert w[~old].tobytes() == fresh[ids[~old]].tobytes() and not shard["item"]["state"][~old].any()
        assert not shard["item"]["version"].any()
        seen |= set(ids.tolist())
    assert seen == set(range(three.rows["item"])) and three.rows["item"] > old_rows
    dense = zarr.open_group(str(tmp_path / "model" / "dense"), mode="r")
    assert all(shards[0]["dense"][k].tobytes() == dense[k][...].tobytes() for k in shards[0]["dense"])

    assert set(shards[0]["dense"]) == set(model.dense_shapes())

    other = replace(model, dim=8)
    with Engine(client, str(days / "ds-3"), plan_three, TOPOLOGIES[3], other, optimizer, TrainConfig(3)) as e:
        with pytest.raises(InputError, match=r"exported with dim=4; accepted for a warm start: dim=8"):
            e.warm_start(tmp_path / "model", manifest)
    switched = replace(model, encoder="mean" if model.attention else "self-attention")
    with Engine(client, str(days / "ds-3"), plan_three, TOPOLOGIES[3], switched, optimizer, TrainConfig(3)) as e:
        with pytest.raises(InputError, match=rf"exported with encoder='{model.encoder}'.*accepted for a warm start: "
                                             rf"encoder='{switched.encoder}'"):
            e.warm_start(tmp_path / "model", manifest)
    adagrad = replace(optimizer, dense="adagrad")  # Adam's moments cannot become Adagrad's sums
    with Engine(client, str(days / "ds-3"), plan_three, TOPOLOGIES[3], model, adagrad, TrainConfig(3)) as e:
        with pytest.raises(InputError, match=r"exported with dense_optimizer='adam'; accepted for a warm start: "
                                             r"dense_optimizer='adagrad'"):
            e.warm_start(tmp_path / "model", manifest)
    rows = "adagrad" if optimizer.rows == "adam" else "adam"  # nor can the rows' state change its kind
    with Engine(client, str(days / "ds-3"), plan_three, TOPOLOGIES[3], model, replace(optimizer, rows=rows),
                TrainConfig(3)) as e:
        with pytest.raises(InputError, match=rf"exported with row_optimizer='{optimizer.rows}'; accepted for a warm "
                                             rf"start: row_optimizer='{rows}'"):
            e.warm_start(tmp_path / "model", manifest)
    # The dropout rate is a training setting: a warm start may change it.
    with Engine(client, str(days / "ds-3"), plan_three, TOPOLOGIES[3], replace(model, dropout=0.4), optimizer,
                TrainConfig(3)) as e:
        e.warm_start(tmp_path / "model", manifest)


@pytest.mark.parametrize("block_events", [1, 2, 3, 5, 1 << 20])
@pytest.mark.parametrize("window", [(0, 0), (1, 1), (2, 2)])
@pytest.mark.parametrize("validation", [False, True])
def test_blocks_of_any_size_stream_the_targets_and_examples_of_the_whole_log(days, block_events, window, validation):
    whole = TrainData.load(days / "ds", window=window, validation=validation)
    streamed = TrainData.load(days / "ds", window=window, block_events=block_events, validation=validation)
    assert streamed.train_targets().tolist() == whole.train_targets().tolist()
    assert streamed.eval_targets.tolist() == whole.eval_targets.tolist() and streamed.targets == whole.targets
    ds = Dataset.open(days / "ds")
    for targets in (streamed.train_targets(), streamed.eval_targets):
        got = streamed.examples(targets[::-1], MODEL, seed=4)
        ids = ds.ids("item")
        want = examples_from(
            ds.offsets(),
            lambda _, positions, ids=ids: ids[positions],
            targets[::-1],
            ds.info.table("item").rows,
            history=3,
            negatives=1,
            seed=4,
        )
        assert got.history.tolist() == want.history.tolist() and got.positive.tolist() == want.positive.tolist()
        assert got.negatives.tolist() == want.negatives.tolist()


def test_a_user_ordered_range_reads_only_its_users_runs_and_equals_the_whole_column(days):
    ds = Dataset.open(days / "ds")
    # user order, from the days: user 1 10..15, user 2 20..24, user 3 30..32 (raw ids, as imported)
    raw, rows = ds.raw_ids("item")
    whole = [int(raw[np.flatnonzero(rows == r)[0]]) for r in ds.ids("item")]
    assert whole == [10, 11, 12, 13, 14, 15, 20, 21, 22, 23, 24, 30, 31, 32]
    for a in range(15):
        for b in range(a, 16):
            assert ds.ids("item", a, b).tolist() == ds.ids("item").tolist()[a:b]
            assert ds.event_segments(a, b).tolist() == ds.event_segments().tolist()[a:b]


@pytest.fixture(scope="module")
def log(tmp_path_factory):
    """A synthetic log of 20,000 events (about 2,000 users)."""
    path = tmp_path_factory.mktemp("log") / "ds"
    synth_dataset(path, [SynthTable("item", 500, 1.1)], interactions=20_000, seed=2, mean_length=10)
    return path


def test_an_epoch_streams_every_target_at_most_once_in_the_same_order_on_every_trainer(log):
    one, other = (TrainData.load(log, block_events=512) for _ in range(2))
    B = 256
    steps = one.steps_per_epoch(B)
    assert one.blocks >= 30 and steps == one.targets // B
    epoch = [one.batch(0, 7, s, B) for s in range(steps)]
    assert all(np.array_equal(a, other.batch(0, 7, s, B)) for s, a in enumerate(epoch))
    seen = np.concatenate(epoch)
    assert seen.size == steps * B and np.unique(seen).size == seen.size
    assert np.isin(seen, one.train_targets()).all()
    blocks_per_batch = [np.unique(b // 512).size for b in epoch]
    assert min(blocks_per_batch) >= 4  # a batch draws from several places of the log, not one stretch
    assert not np.array_equal(one.batch(1, 7, 0, B), epoch[0]) and not np.array_equal(one.batch(0, 8, 0, B), epoch[0])
    one.examples(seen, MODEL, seed=1)
    assert len(one._cache) <= CACHED_BLOCKS  # what an epoch holds is bounded, whatever the log's length


@pytest.mark.parametrize("block_events", [61, 512, 1 << 20])
@pytest.mark.parametrize("trainers", [2, 3, 4])
def test_a_trainer_holds_only_its_part_of_each_block_and_reads_the_examples_the_whole_log_gives(
        log, block_events, trainers):
    whole = TrainData.load(log, block_events=block_events)
    own = [TrainData.load(log, block_events=block_events) for _ in range(trainers)]
    for reader in own:
        reader.read_in_parts(trainers)
    B, taken = 256, np.zeros(trainers)
    for step in range(whole.steps_per_epoch(B)):
        batch = whole.batch(0, 7, step, B)
        subs = whole.sub_batches(batch, trainers)
        assert sorted(np.concatenate(subs).tolist()) == sorted(batch.tolist())  # every target once
        for d, sub in enumerate(subs):
            assert sub.tolist() == batch[np.isin(batch, sub)].tolist()  # in the batch's order
            got, want = own[d].examples(sub, MODEL, seed=step), whole.examples(sub, MODEL, seed=step)
            assert got.history.tolist() == want.history.tolist() and got.positive.tolist() == want.positive.tolist()
            assert got.negatives.tolist() == want.negatives.tolist()
            taken[d] += sub.size
    if block_events >= 512:  # runs of a few events at most: every part samples the whole block
        assert taken.min() >= 0.85 * taken.mean(), taken
    for d, reader in enumerate(own):
        assert {part for _, part in reader._cache} == {d}  # it read no other trainer's part
    if block_events == 1 << 20:  # one block of 20,000 events: a part and its runs' history tails
        held = next(iter(own[0]._cache.values()))
        assert held.columns["item"].size <= 20_000 / trainers + held.firsts.size * (MODEL.history + 1)
        assert held.columns["item"].size < 1.1 * 20_000 / trainers
