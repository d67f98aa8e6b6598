"""Each user's top-K items, block by block of the catalog, against every item scored by the model's own
per-candidate forward: the same items in the same order, whatever the blocks; seen items never listed."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shardflow.errors import InputError
from shardflow.model.configs import BatchIndex
from shardflow.model.forward import on_device
from shardflow.model.sequence import scores, user_state
from shardflow.model.topk import TopK, top_block
from shardflow.training.recommend import check_request
from support import tiny_scorer

CPU = torch.device("cpu")
ITEMS, USERS, K = 53, 9, 7


def problem(encoder: str, seed: int = 0):
    config, dense, rows, history, rng = tiny_scorer(encoder, seed, ITEMS, USERS)
    seen_lists = [np.unique(np.r_[h[h >= 0], rng.integers(0, ITEMS, size=3)]) for h in history]
    seen_lists[4] = np.arange(ITEMS - 3)  # a user who had all but 3 items: a list shorter than K
    return config, dense, rows, history, seen_lists


def oracle(config, dense, rows, history, seen_lists) -> list[list[int]]:
    """Every (user, item) scored by the per-candidate forward; each user's unseen items, best first (ties: the
    smaller id first), at most K."""
    every = np.repeat(np.arange(ITEMS)[None], USERS, axis=0)
    full = BatchIndex(item="item", history=history, candidates=every, features={})
    with torch.no_grad():
        s = scores(config, dense, rows, on_device(full, CPU)).numpy()
    out = []
    for u in range(USERS):
        unseen = np.setdiff1d(np.arange(ITEMS), seen_lists[u])
        out.append(unseen[np.lexsort((unseen, -s[u, unseen]))][:K].tolist())
    return out


@pytest.mark.parametrize("encoder", ["mean", "self-attention"])
@pytest.mark.parametrize("block", [1, 5, 16, ITEMS])
def test_lists_merged_block_by_block_are_the_whole_catalogs_best_unseen_items(encoder, block):
    config, dense, rows, history, seen_lists = problem(encoder)
    index = BatchIndex(item="item", history=history, candidates=np.zeros((USERS, 1), dtype=np.int64), features={})
    with torch.no_grad():
        state = user_state(config, dense, rows, on_device(index, CPU))
    seen_user = np.concatenate([np.full(s.size, u) for u, s in enumerate(seen_lists)]).astype(np.int64)
    seen = np.concatenate(seen_lists).astype(np.int64)
    best = TopK.empty(USERS, K)
    for s in range(0, ITEMS, block):
        best = best.merge(*top_block(config, dense, state, seen_user, seen, s, rows["item"][s : s + block], K))
    got = [[int(i) for i in row if i >= 0] for row in best.items]
    assert got == oracle(config, dense, rows, history, seen_lists)
    assert len(got[4]) == 3 and (best.items[4, 3:] == -1).all() and np.isneginf(best.scores[4, 3:]).all()
    assert (np.diff(best.scores[:, :3], axis=1) <= 0).all()  # best first


def test_ties_list_the_smaller_id_first_whatever_block_it_came_from():
    best = TopK.empty(2, 3).merge(np.array([[9, 4, 1], [2, 3, 4]]), np.array([[1.0, 1.0, 0.5], [0.0, 0.0, 0.0]]))
    none = -np.inf
    best = best.merge(np.array([[3, -1, -1], [1, -1, -1]]), np.array([[1.0, none, none], [0.0, none, none]]))
    assert best.items.tolist() == [[3, 4, 9], [1, 2, 3]]


@pytest.mark.parametrize("k, users, refusal", [
    (0, "window", r"k = 0; accepted: an integer from 1 to 10,000"),
    (10_001, "window", r"k = 10001; accepted"),
    (True, "window", r"k = True; accepted"),
    (10, "everyone", r"users 'everyone'; accepted: window, all"),
])
def test_a_list_length_or_user_choice_out_of_range_is_one_line(k, users, refusal):
    with pytest.raises(InputError, match=refusal):
        check_request(k, users)
