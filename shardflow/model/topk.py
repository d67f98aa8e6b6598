"""The top-K items of the whole catalog for each user, block by block of item rows: the night's product.

As full-catalog ranking (shardflow.model.ranking) scores the catalog a block of rows at a
time, so does the top-K list: each block's best K candidates per user are merged with the
best K so far (`TopK.merge`), so a user's list never needs more than K + one block of
scores, and no place holds the item table whole. The items a user already had are left
out (as the full-ranking metrics leave them out by default): a recommender shows new items.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from shardflow.model.configs import ModelConfig
from shardflow.model.ranking import ROWS_AT_A_TIME, USERS_AT_A_TIME
from shardflow.model.sequence import candidate_scores
from shardflow.model.tensors import Tensors, UserState


@dataclass(frozen=True)
class TopK:
    """Per user, the K best items so far (ids and scores, best first; id -1 and score -inf where fewer items
    were scored than K)."""

    items: np.ndarray  # int64 [users, K]
    scores: np.ndarray  # float32 [users, K]

    @classmethod
    def empty(cls, users: int, k: int) -> TopK:
        return cls(np.full((users, k), -1, dtype=np.int64), np.full((users, k), -np.inf, dtype=np.float32))

    def merge(self, items: np.ndarray, scores: np.ndarray) -> TopK:
        """These K and another block's candidates (same users), the best K of both; ties: the smaller id first
        (the order a list is read back in does not depend on how the catalog was split)."""
        k = self.items.shape[1]
        all_items = np.concatenate([self.items, items], axis=1)
        all_scores = np.concatenate([self.scores, scores], axis=1)
        order = np.lexsort((np.where(all_items < 0, np.iinfo(np.int64).max, all_items), -all_scores), axis=1)[:, :k]
        return TopK(np.take_along_axis(all_items, order, 1), np.take_along_axis(all_scores, order, 1))


def top_block(config: ModelConfig, dense: Tensors, state: UserState, seen_user: np.ndarray, seen_item: np.ndarray,
              first: int, rows: torch.Tensor, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The best min(k, rows) items of the catalog's items first .. first + len(rows) - 1 for every user of `state`
    (ids and scores [users, min(k, rows)], best first), leaving out the pairs (seen_user[i], seen_item[i])."""
    users, n = state[0].shape[0], rows.shape[0]
    keep = min(k, n)
    out_items = np.empty((users, keep), dtype=np.int64)
    out_scores = np.empty((users, keep), dtype=np.float32)
    inside = (seen_item >= first) & (seen_item < first + n)
    left_user, left_item = seen_user[inside], seen_item[inside] - first
    with torch.no_grad():
        for s in range(0, users, USERS_AT_A_TIME):
            e = min(s + USERS_AT_A_TIME, users)
            part = tuple(x[s:e] for x in state)
            scores = torch.cat([candidate_scores(config, dense, part, rows[r : r + ROWS_AT_A_TIME])
                                for r in range(0, n, ROWS_AT_A_TIME)], dim=1)
            pair = (left_user >= s) & (left_user < e)
            scores[torch.from_numpy(left_user[pair] - s), torch.from_numpy(left_item[pair])] = -torch.inf
            best, where = torch.topk(scores, keep, dim=1)
            out_scores[s:e] = best.numpy()
            out_items[s:e] = np.where(np.isfinite(out_scores[s:e]), where.numpy() + first, -1)
    return out_items, out_scores
