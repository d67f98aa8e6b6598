from itertools import pairwise

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardflow.data.batches import fetched
from shardflow.data.examples import (
    PAD,
    build_examples,
    count_train_targets,
    held_out_positions,
    sample_unseen,
    searchsorted_keys,
    target_positions,
    validation_positions,
)
from shardflow.errors import InputError

OFFSETS = np.array([0, 4, 5, 7])
IDS = np.array([10, 11, 12, 13, 20, 30, 31])


def test_train_examples_of_a_hand_built_dataset():
    ex = build_examples(OFFSETS, IDS, 40, history=2, negatives=3, seed=1)
    # user 0 (4 items) trains on items 1 and 2; user 1 (1 item) and user 2 (2 items) on none.
    assert ex.positive.tolist() == [11, 12]
    assert ex.history.tolist() == [[PAD, 10], [10, 11]]
    assert ex.user.tolist() == [0, 0]
    assert ex.position.tolist() == [1, 2]
    assert ex.negatives.shape == (2, 3)


def test_eval_holds_out_the_last_item_of_every_user_with_two_or_more():
    ex = build_examples(OFFSETS, IDS, 40, history=2, negatives=1, seed=1, split="eval")
    assert ex.positive.tolist() == [13, 31]
    assert ex.history.tolist() == [[11, 12], [PAD, 30]]
    assert ex.user.tolist() == [0, 2]


def test_negatives_are_in_range_never_the_positive_and_seeded():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 30, size=200)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    ids = rng.integers(0, 5, size=offsets[-1])
    a = build_examples(offsets, ids, 5, history=4, negatives=8, seed=7)
    b = build_examples(offsets, ids, 5, history=4, negatives=8, seed=7)
    c = build_examples(offsets, ids, 5, history=4, negatives=8, seed=8)
    assert (a.negatives >= 0).all() and (a.negatives < 5).all()
    assert not (a.negatives == a.positive[:, None]).any()
    np.testing.assert_array_equal(a.negatives, b.negatives)
    assert not np.array_equal(a.negatives, c.negatives)
    # uniform over the 4 other rows: each about a quarter of the draws
    share = np.bincount(((a.negatives - a.positive[:, None]) % 5).ravel(), minlength=5)[1:] / a.negatives.size
    np.testing.assert_allclose(share, 0.25, atol=0.02)


def naive(offsets, ids, history, split):
    out = []
    for u in range(len(offsets) - 1):
        seq = list(ids[offsets[u] : offsets[u + 1]])
        targets = range(1, len(seq) - 1) if split == "train" else ([len(seq) - 1] if len(seq) >= 2 else [])
        for t in targets:
            window = seq[max(0, t - history) : t]
            out.append(([PAD] * (history - len(window)) + window, seq[t], u, offsets[u] + t))
    return out


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 9), min_size=1, max_size=12),
    history=st.integers(1, 5),
    split=st.sampled_from(["train", "eval"]),
    cut=st.integers(0, 12),
    data=st.data(),
)
def test_matches_a_naive_loop_and_does_not_depend_on_user_blocks(lengths, history, split, cut, data):
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    ids = np.array(data.draw(st.lists(st.integers(0, 9), min_size=int(offsets[-1]), max_size=int(offsets[-1]))))
    whole = build_examples(offsets, ids, 10, history=history, negatives=2, seed=3, split=split)
    expected = naive(offsets, ids, history, split)
    assert whole.history.tolist() == [e[0] for e in expected]
    assert whole.positive.tolist() == [e[1] for e in expected]
    assert whole.user.tolist() == [e[2] for e in expected]
    assert whole.position.tolist() == [e[3] for e in expected]

    cut = min(cut, len(lengths))
    a0, a1 = offsets[: cut + 1], offsets[cut:]
    left = build_examples(a0, ids[: a0[-1]], 10, history=history, negatives=2, seed=3, split=split)
    right = build_examples(a1, ids[a1[0] :], 10, history=history, negatives=2, seed=3, split=split, first_user=cut)
    for field in ("history", "positive", "negatives", "user", "position"):
        joined = np.concatenate([getattr(left, field), getattr(right, field)])
        np.testing.assert_array_equal(joined, getattr(whole, field))


def test_bad_arguments_are_refused():
    with pytest.raises(InputError, match="split 'test'; accepted: train, validation, eval"):
        build_examples(OFFSETS, IDS, 40, history=2, negatives=1, seed=0, split="test")
    with pytest.raises(InputError, match="history = 0"):
        build_examples(OFFSETS, IDS, 40, history=0, negatives=1, seed=0)
    with pytest.raises(InputError, match="at least 2 rows"):
        build_examples(OFFSETS, np.zeros(7, dtype=np.int64), 1, history=2, negatives=1, seed=0)


def test_targets_are_counted_per_range_from_offsets_alone_a_slice_of_users_at_a_time():
    rng = np.random.default_rng(5)
    offsets = np.concatenate([[0], np.cumsum(rng.integers(0, 6, size=200))])  # users of 0 to 5 events
    bounds = np.unique(np.concatenate([[0, offsets[-1]], rng.integers(0, offsets[-1], size=30)]))
    targets = target_positions(offsets, "train")
    want = [int(((targets >= a) & (targets < b)).sum()) for a, b in pairwise(bounds)]
    for at_a_time in (1, 3, 1 << 22):
        assert count_train_targets(offsets, bounds, at_a_time).tolist() == want
    for a, b in pairwise(bounds):
        assert target_positions(offsets, "train", a, b).tolist() == targets[(targets >= a) & (targets < b)].tolist()
    assert held_out_positions(offsets).tolist() == target_positions(offsets, "eval").tolist()


def test_a_validation_split_takes_each_users_second_to_last_event_out_of_training():
    offsets = np.array([0, 4, 5, 7, 10])  # users of 4, 1, 2 and 3 events
    assert target_positions(offsets, "train", held=2).tolist() == [1]  # user 3 (7..9): first, validation, test
    assert target_positions(offsets, "validation").tolist() == [2, 8]
    assert target_positions(offsets, "eval").tolist() == [3, 6, 9]
    assert validation_positions(held_out_positions(offsets), offsets).tolist() == [2, 8]
    assert validation_positions(np.array([9]), offsets).tolist() == [8]  # of the users evaluated only
    rng = np.random.default_rng(6)
    offsets = np.concatenate([[0], np.cumsum(rng.integers(0, 7, size=300))])
    bounds = np.unique(np.concatenate([[0, offsets[-1]], rng.integers(0, offsets[-1], size=40)]))
    train, val = target_positions(offsets, "train", held=2), target_positions(offsets, "validation")
    test = target_positions(offsets, "eval")
    assert not (set(train) & set(val)) and not (set(val) & set(test))
    assert sorted([*train, *val]) == target_positions(offsets, "train").tolist()  # the split takes nothing else
    want = [int(((train >= a) & (train < b)).sum()) for a, b in pairwise(bounds)]
    for at_a_time in (1, 5, 1 << 22):
        assert count_train_targets(offsets, bounds, at_a_time, held=2).tolist() == want


def test_eval_negatives_are_uniform_over_the_rows_the_user_never_touched_and_depend_on_the_example_alone():
    rows = 20
    position = np.arange(2000, dtype=np.int64) * 7
    seen_offsets = np.arange(position.size + 1, dtype=np.int64) * 10
    seen = np.tile(np.arange(0, rows, 2), position.size)  # every user touched the even rows
    neg = sample_unseen(position, seen, seen_offsets, rows, 100, seed=3)
    assert neg.shape == (2000, 100) and (neg % 2 == 1).all()
    share = np.bincount(neg.ravel(), minlength=rows)[1::2] / neg.size
    np.testing.assert_allclose(share, 0.1, atol=0.005)  # 2·10^5 draws over the 10 odd rows
    some = slice(500, 520)
    alone = sample_unseen(position[some], seen[5000:5200], seen_offsets[:21], rows, 100, seed=3)
    np.testing.assert_array_equal(alone, neg[some])
    assert not np.array_equal(sample_unseen(position, seen, seen_offsets, rows, 100, seed=4), neg)


def test_a_user_who_touched_all_rows_but_one_gets_that_one_and_one_who_touched_all_is_refused_naming_the_event():
    rows = 1000
    everything_but_17 = np.delete(np.arange(rows), 17)
    neg = sample_unseen(np.array([5]), everything_but_17, np.array([0, rows - 1]), rows, 100, seed=0)
    assert (neg == 17).all()
    with pytest.raises(InputError, match=r"held-out event 42 interacted with all 1000 rows"):
        sample_unseen(np.array([5, 42]), np.concatenate([[3], np.arange(rows)]), np.array([0, 1, rows + 1]), rows,
                      100, seed=0)


@pytest.mark.parametrize("gap", [1 << 16, 0])  # users read as one span, and each on its own
def test_eval_examples_draw_negatives_outside_each_users_whole_sequence(tmp_path, monkeypatch, gap):
    import shardflow.data.batches as batches
    from shardflow.data.batches import TrainData
    from shardflow.model.configs import ModelConfig
    from storage.importers import import_dataset

    rng = np.random.default_rng(5)
    lines = [f"{u} {i}" for u in range(1, 301) for i in rng.choice(60, size=int(rng.integers(2, 40)), replace=True)]
    (tmp_path / "log.txt").write_text("\n".join(lines) + "\n")
    import_dataset("sasrec", tmp_path / "log.txt", tmp_path / "ds")
    monkeypatch.setattr(batches, "USER_SPAN_GAP", gap)
    data = TrainData.load(tmp_path / "ds")
    targets = data.eval_targets[::3]
    ex = data.eval_examples(targets, ModelConfig(history=4), seed=9, negatives=100)
    offsets = data.offsets
    for e, t in enumerate(targets.tolist()):
        u = int(np.searchsorted(offsets, t, side="right") - 1)
        whole = set(data.dataset.column("tables/item", int(offsets[u]), int(offsets[u + 1])).tolist())
        assert ex.positive[e] in whole and not whole & set(ex.negatives[e].tolist()), u
    assert ex.negatives.shape == (targets.size, 100)
    val = TrainData.load(tmp_path / "ds", validation=True)
    ex = val.eval_examples(val.validation_targets, ModelConfig(history=4), seed=9, negatives=100)
    for e, t in enumerate(val.validation_targets.tolist()):  # the draws know nothing of the test item
        u = int(np.searchsorted(offsets, t, side="right") - 1)
        upto = set(data.dataset.column("tables/item", int(offsets[u]), t + 1).tolist())
        assert ex.positive[e] in upto and not upto & set(ex.negatives[e].tolist()), u
    test_item = data.dataset.column("tables/item", 0, int(offsets[-1]))[val.validation_targets + 1]
    assert (ex.negatives == test_item[:, None]).any()  # it may be drawn like any other untouched item
    seen, seen_offsets = data.user_items(targets[::-1])  # in any order, each target's user's whole sequence
    users = np.searchsorted(offsets, targets[::-1], side="right") - 1
    expected = [data.dataset.column("tables/item", int(offsets[u]), int(offsets[u + 1])) for u in users]
    np.testing.assert_array_equal(seen_offsets, np.concatenate([[0], np.cumsum([e.size for e in expected])]))
    np.testing.assert_array_equal(seen, np.concatenate(expected))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 199), max_size=300), st.integers(200, 4000))
def test_a_trainers_lookups_find_their_rows_among_the_distinct_ids_whichever_way_they_are_found(ids, rows):
    """Few rows per id are de-duplicated by marking rows, many by sorting ids: np.unique's answer either way."""
    ids = np.array(ids, dtype=np.int64)
    distinct, where = fetched(ids, "device", rows)
    expected, inverse = np.unique(ids, return_inverse=True)
    assert distinct.tolist() == expected.tolist() and where.tolist() == inverse.tolist()
    assert distinct[where].tolist() == ids.tolist()
    every, at = fetched(ids, "none", rows)
    assert every.tolist() == ids.tolist() and at.tolist() == list(range(ids.size))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 50), min_size=1, max_size=40), st.lists(st.integers(-5, 60), max_size=200),
       st.sampled_from(["left", "right"]))
def test_keys_in_any_order_find_the_places_numpy_finds(ascending, keys, side):
    ascending, keys = np.sort(np.array(ascending, dtype=np.int64)), np.array(keys, dtype=np.int64)
    assert searchsorted_keys(ascending, keys, side).tolist() == np.searchsorted(ascending, keys, side).tolist()


def test_every_sub_batch_of_a_step_carries_its_key_and_each_lookup_the_id_of_the_row_it_reads(tmp_path):
    """The item dropout's row masks are keyed by (the step's key, the row's id): each sub-batch of a step has the
    same key, another step or epoch another, evaluation none; a trainer's index names the id of each row it holds,
    the reference's the same ids and places with item dropout, whole tables (no ids) without."""
    from dataclasses import replace

    from shardflow.data.batches import TrainData, negative_seed
    from shardflow.model.configs import ModelConfig
    from storage.importers import import_dataset

    rng = np.random.default_rng(6)
    lines = [f"{u} {i}" for u in range(1, 201) for i in rng.choice(50, size=int(rng.integers(3, 20)))]
    (tmp_path / "log.txt").write_text("\n".join(lines) + "\n")
    import_dataset("sasrec", tmp_path / "log.txt", tmp_path / "ds")
    data, config = TrainData.load(tmp_path / "ds"), ModelConfig(history=4, negatives=3, item_dropout=0.2)
    keys = {}
    for epoch, step in ((0, 0), (0, 1), (1, 0)):
        seed = negative_seed(3, epoch)
        subs = data.sub_batches(data.batch(epoch, 3, step, 64), 2)
        ex = [data.examples(sub, config, seed, step=step) for sub in subs]
        assert ex[0].step_key == ex[1].step_key is not None
        keys[epoch, step] = ex[0].step_key
        index = data.lookups(ex[0], config, "device").index
        read = np.concatenate([ex[0].history[ex[0].history >= 0], ex[0].positive, ex[0].negatives.ravel()])
        np.testing.assert_array_equal(index.item_ids, np.unique(read))
        np.testing.assert_array_equal(index.item_ids[index.candidates[:, 0]], ex[0].positive)
        assert index.step_key == ex[0].step_key
        whole = data.table_index(ex[0], config)
        np.testing.assert_array_equal(whole.item_ids, index.item_ids)
        np.testing.assert_array_equal(whole.history, index.history)
        assert data.table_index(ex[0], replace(config, item_dropout=0.0)).item_ids is None
    assert len(set(keys.values())) == 3
    assert data.eval_examples(data.eval_targets[:8], config, seed=0, negatives=5).step_key is None
