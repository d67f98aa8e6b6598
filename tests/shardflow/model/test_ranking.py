"""Full-catalog ranking against a plain count: every item scored for every user by the model's own per-candidate
forward, the held-out item's rank counted item by item; ties shared; seen items left out or not."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from shardflow.model.configs import BatchIndex
from shardflow.model.forward import on_device
from shardflow.model.ranking import CatalogRanks, UsersToRank, rank_block, users_to_rank
from shardflow.model.sequence import scores, user_state
from support import tiny_scorer

CPU = torch.device("cpu")
ITEMS, USERS = 53, 9


def problem(encoder: str, seed: int = 0):
    config, dense, rows, history, rng = tiny_scorer(encoder, seed, ITEMS, USERS)
    target = rng.integers(0, ITEMS, size=USERS)
    target[3] = history[3, 2]  # user 3's held-out item is one it had already
    # each user's items up to and including its held-out event (the held-out one last), as user_items gives them
    seen_lists = [np.r_[h[h >= 0], rng.integers(0, ITEMS, size=2), t] for h, t in zip(history, target, strict=True)]
    seen = np.concatenate(seen_lists)
    offsets = np.r_[0, np.cumsum([s.size for s in seen_lists])]
    index = BatchIndex(item="item", history=history, candidates=target[:, None], features={})
    return config, dense, rows, index, target, seen, offsets, seen_lists


def oracle(config, dense, rows, index, target, seen_lists, include_seen: bool) -> CatalogRanks:
    """Every (user, item) scored by the model's per-candidate forward; the rank counted in plain numpy."""
    every = np.repeat(np.arange(ITEMS)[None], USERS, axis=0)
    full = BatchIndex(item="item", history=index.history, candidates=np.c_[target, every], features={})
    with torch.no_grad():
        s = scores(config, dense, rows, on_device(full, CPU)).numpy()
    above, tied, missed = np.zeros(USERS, int), np.zeros(USERS, int), np.zeros(USERS, bool)
    for u in range(USERS):
        before = set(seen_lists[u][:-1].tolist())
        missed[u] = not include_seen and int(target[u]) in before
        for item in range(ITEMS):
            if item == target[u] or (not include_seen and item in before):
                continue
            above[u] += s[u, 1 + item] > s[u, 0]
            tied[u] += s[u, 1 + item] == s[u, 0]
    return CatalogRanks(above, tied, missed)


def ranked(config, dense, rows, index, target, seen, offsets, include_seen: bool, block: int) -> CatalogRanks:
    with torch.no_grad():
        state = user_state(config, dense, rows, on_device(index, CPU))
    users, missed = users_to_rank(config, dense, state, target, rows["item"][target], seen, offsets, include_seen)
    zeros = np.zeros(USERS, dtype=np.int64)
    return sum((rank_block(config, dense, users, np.arange(s, min(s + block, ITEMS)), rows["item"][s : s + block])
                for s in range(0, ITEMS, block)), CatalogRanks(zeros, zeros, missed))


@pytest.mark.parametrize("encoder", ["mean", "self-attention"])
@pytest.mark.parametrize("include_seen", [False, True])
def test_block_counts_add_up_to_the_plain_count_of_every_item(encoder, include_seen):
    config, dense, rows, index, target, seen, offsets, seen_lists = problem(encoder)
    want = oracle(config, dense, rows, index, target, seen_lists, include_seen)
    for block in (ITEMS, 17, 1):  # one block, uneven blocks, a row at a time: the same counts
        got = ranked(config, dense, rows, index, target, seen, offsets, include_seen, block)
        np.testing.assert_array_equal(got.above, want.above)
        np.testing.assert_array_equal(got.tied, want.tied)
        np.testing.assert_array_equal(got.missed, want.missed)
    assert want.missed[3] != include_seen  # not vacuous: a user whose held-out item was seen before
    assert want.above.max() > 0  # real ranks (the mean encoder's dead ReLUs also make exact ties: counted alike)


@pytest.mark.parametrize("encoder", ["mean", "self-attention"])
def test_rows_scattered_over_devices_and_users_made_on_each_add_up_to_the_plain_count(encoder):
    """A device ranks the rows it is home to (row-wise: id % 3), for every device's users joined in order."""
    config, dense, rows, index, target, seen, offsets, seen_lists = problem(encoder)
    want = oracle(config, dense, rows, index, target, seen_lists, False)
    with torch.no_grad():
        state = user_state(config, dense, rows, on_device(index, CPU))
    parts, missed = [], []
    for users in (slice(0, 4), slice(4, USERS)):  # each device's users, with their own seen pairs
        first, last = offsets[users.start], offsets[users.stop]
        part, miss = users_to_rank(config, dense, tuple(x[users] for x in state), target[users],
                                   rows["item"][target[users]], seen[first:last], offsets[users.start : users.stop + 1]
                                   - first, False)
        parts.append(part)
        missed.append(miss)
    joined = UsersToRank.joined(parts)
    zeros = np.zeros(USERS, dtype=np.int64)
    homes = [np.flatnonzero(np.arange(ITEMS) % 3 == d) for d in range(3)]
    got = sum((rank_block(config, dense, joined, ids, rows["item"][ids]) for ids in homes),
              CatalogRanks(zeros, zeros, np.concatenate(missed)))
    np.testing.assert_array_equal(got.above, want.above)
    np.testing.assert_array_equal(got.tied, want.tied)
    np.testing.assert_array_equal(got.missed, want.missed)
    assert want.above.max() > 0


def test_a_model_that_scores_every_item_alike_gets_chance_not_a_perfect_score():
    config, dense, rows, index, target, seen, offsets, seen_lists = problem("mean", seed=1)
    rows = {"item": torch.zeros_like(rows["item"])}
    dense = {k: torch.zeros_like(v) for k, v in dense.items()}
    got = ranked(config, dense, rows, index, target, seen, offsets, True, 17).metrics()
    assert math.isclose(got["full_hr_at_10"], 10 / ITEMS) and math.isclose(got["full_hr_at_20"], 20 / ITEMS)
    excluded = ranked(config, dense, rows, index, target, seen, offsets, False, 17)
    candidates = [ITEMS - len(set(s[:-1].tolist()) - {int(t)}) for s, t in zip(seen_lists, target, strict=True)]
    expected = [0.0 if m else 10 / c for m, c in zip(excluded.missed, candidates, strict=True)]
    assert math.isclose(excluded.metrics()["full_hr_at_10"], sum(expected) / USERS)


def test_items_added_since_the_export_are_ranked_as_zero_rows(tmp_path):
    """A version exported before the dataset grew is ranked over the grown catalog: the new items score as zero
    rows, as the sampled protocol scores them."""
    import zarr

    from shardflow.training.evaluate import rank_export_block

    config, dense, rows, index, target, seen, offsets, _ = problem("self-attention")
    dense = {k: v.float() for k, v in dense.items()}
    rows = {"item": rows["item"].float()}
    exported = 40  # of ITEMS rows: the rest were added after the export
    arr = zarr.create_array(str(tmp_path / "model" / "tables" / "item"), shape=(exported, 4), dtype="float32")
    arr[:] = rows["item"][:exported].numpy()
    padded = torch.cat([rows["item"][:exported], torch.zeros(ITEMS - exported, 4)])
    with torch.no_grad():
        state = user_state(config, dense, {"item": padded}, on_device(index, CPU))
    users, _ = users_to_rank(config, dense, state, target, padded[target], seen, offsets, True)
    got = rank_export_block(str(tmp_path / "model"), "item", 32, ITEMS, config, dense, users)
    want = rank_block(config, dense, users, np.arange(32, padded.shape[0]), padded[32:])
    np.testing.assert_array_equal(got.above, want.above)
    np.testing.assert_array_equal(got.tied, want.tied)
    assert got.tied.sum() > 0  # not vacuous: the zero rows tie with each other for users whose item is new
