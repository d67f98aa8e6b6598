"""Full-catalog ranking: each held-out item ranked among every item of the catalog, not among sampled ones.

Sampled metrics can rank models wrongly (Krichene & Rendle, KDD 2020); current papers rank
the whole catalog, with the items a user already has removed (the eSASRec benchmark's
`filter_viewed`). HR@K and NDCG@K need only the held-out item's rank, and a rank is a count
that adds up over any split of the catalog: per user, how many items score above the
held-out one and how many tie with it. So each block of item rows (a device's shard, an
export's chunk) is scored where it is read against the users' states, and only two small
integers per user travel (`CatalogRanks`, added with `+`); no place ever holds the item
table whole. Ties count as a random order would place them (metrics.rank_gains).

What is ranked, one of metrics.SEEN: `exclude-seen` (the default, as the published full-ranking
figures) leaves the items each user interacted with before the held-out event out of its
ranking, and a held-out item the user had already is a miss, as a recommender that filters
seen items could never show it; `include-seen` ranks every item.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from shardflow.model.configs import ModelConfig
from shardflow.model.metrics import rank_gains
from shardflow.model.sequence import candidate_scores
from shardflow.model.tensors import Tensors, UserState

CUTOFFS = (10, 20)
# Users and catalog rows scored at once: [users, rows, MLP width] floats that stay in a core's cache (2 MB
# here). Larger tiles were slower: 2.1 M (user, item) pairs a second at 128 × 2,048 against 5.5 M at 32 × 512
# (the mean encoder, dim 64, MLP 64-32, one core).
USERS_AT_A_TIME = 32
ROWS_AT_A_TIME = 512


@dataclass(frozen=True)
class CatalogRanks:
    """Per user, the items that score above its held-out item and those tied with it, over the blocks counted
    so far; `missed`: its held-out item is one it already had (with seen items excluded: never ranked)."""

    above: np.ndarray  # int64 [users]
    tied: np.ndarray  # int64 [users]
    missed: np.ndarray  # bool [users]

    def __add__(self, other: CatalogRanks) -> CatalogRanks:
        return CatalogRanks(self.above + other.above, self.tied + other.tied, self.missed | other.missed)

    def metrics(self) -> dict[str, float]:
        """full_hr_at_K and full_ndcg_at_K (K in CUTOFFS), means over the users (a missed user scores 0)."""
        out = {}
        users = max(self.above.size, 1)
        for k in CUTOFFS:
            hit, gain = rank_gains(self.above, self.tied, k)
            out[f"full_hr_at_{k}"] = float(np.where(self.missed, 0.0, hit).sum() / users)
            out[f"full_ndcg_at_{k}"] = float(np.where(self.missed, 0.0, gain).sum() / users)
        return out


@dataclass(frozen=True)
class UsersToRank:
    """The users one ranking scores: their states (model.sequence.user_state, on the CPU), their held-out items'
    ids and scores, and the (user, item) pairs left out of their rankings (the items they had already)."""

    state: UserState
    target: np.ndarray  # int64 [users]: the held-out item of each
    target_score: torch.Tensor  # [users]
    left_user: np.ndarray  # int64: pairs (left_user[i], left_item[i]) are not ranked
    left_item: np.ndarray

    @property
    def users(self) -> int:
        return self.target.size

    @classmethod
    def joined(cls, parts: list[UsersToRank]) -> UsersToRank:
        """The users of `parts` in order, as one ranking's (each device's held-out users, made where their rows
        are read)."""
        firsts = np.cumsum([0, *(p.users for p in parts[:-1])])
        return cls(tuple(torch.cat(xs) for xs in zip(*(p.state for p in parts), strict=True)),
                   np.concatenate([p.target for p in parts]), torch.cat([p.target_score for p in parts]),
                   np.concatenate([p.left_user + f for p, f in zip(parts, firsts, strict=True)]),
                   np.concatenate([p.left_item for p in parts]))


def users_to_rank(config: ModelConfig, dense: Tensors, state: UserState, target: np.ndarray, target_rows: torch.Tensor,
                  seen: np.ndarray, seen_offsets: np.ndarray, include_seen: bool) -> tuple[UsersToRank, np.ndarray]:
    """The users' ranking inputs, and which of them are missed outright (a held-out item seen before, with seen
    items excluded). `seen`/`seen_offsets`: each user's items up to and including its held-out event (its last).

    A held-out item's score is computed as the catalog's are (a shared block of rows), so the same row scores
    the same there and here."""
    scores = torch.zeros(target.size)
    with torch.no_grad():
        for s in range(0, target.size, USERS_AT_A_TIME):  # the diagonal of each group's users × their own items
            e = min(s + USERS_AT_A_TIME, target.size)
            scores[s:e] = candidate_scores(config, dense, _rows_of(state, slice(s, e)), target_rows[s:e]).diagonal()
    per_user = np.diff(seen_offsets) - 1  # the held-out event itself is each range's last
    user = np.repeat(np.arange(target.size, dtype=np.int64), np.maximum(per_user, 0))
    keep = np.ones(seen.size, dtype=bool)
    keep[seen_offsets[1:] - 1] = False
    before = seen[keep]
    missed = np.zeros(target.size, dtype=bool)
    if include_seen:
        user, before = np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    else:
        missed[user[before == target[user]]] = True
    return UsersToRank(state, target.astype(np.int64), scores, user, before), missed


def _rows_of(state: UserState, sel: slice | np.ndarray) -> UserState:
    """The states of users `sel` (a slice or an index array)."""
    return tuple(x[sel] for x in state)


def rank_block(config: ModelConfig, dense: Tensors, users: UsersToRank, ids: np.ndarray,
               rows: torch.Tensor) -> CatalogRanks:
    """The counts of the catalog's items `ids` (ascending; their rows `rows`: a contiguous block of an export, or
    the rows a device is home to) for every user: above and tied with its held-out item, the held-out item itself
    and the user's left-out pairs not counted."""
    n = ids.size
    above = np.zeros(users.users, dtype=np.int64)
    tied = np.zeros(users.users, dtype=np.int64)
    left_at, left = _positions(ids, users.left_item)
    left_user, left_item = users.left_user[left], left_at[left]
    own_at, own = _positions(ids, users.target)
    with torch.no_grad():
        for s in range(0, users.users, USERS_AT_A_TIME):
            e = min(s + USERS_AT_A_TIME, users.users)
            state = _rows_of(users.state, slice(s, e))
            scores = torch.cat([candidate_scores(config, dense, state, rows[r : r + ROWS_AT_A_TIME])
                                for r in range(0, n, ROWS_AT_A_TIME)], dim=1) if n else torch.zeros(e - s, 0)
            counted = torch.ones_like(scores, dtype=torch.bool)
            mine = np.flatnonzero(own[s:e])
            counted[_on(mine, scores), _on(own_at[s:e][mine], scores)] = False
            pair = (left_user >= s) & (left_user < e)
            counted[_on(left_user[pair] - s, scores), _on(left_item[pair], scores)] = False
            target = users.target_score[s:e, None]
            above[s:e] = ((scores > target) & counted).sum(1).cpu().numpy()
            tied[s:e] = ((scores == target) & counted).sum(1).cpu().numpy()
    return CatalogRanks(above, tied, np.zeros(users.users, dtype=bool))


def _on(index: np.ndarray, like: torch.Tensor) -> torch.Tensor:
    """An index array as a tensor on `like`'s device (a CUDA shard's rows are ranked where they are)."""
    return torch.from_numpy(index).to(like.device)


def _positions(ids: np.ndarray, items: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Where each of `items` is in the ascending `ids`, and whether it is there at all."""
    at = np.searchsorted(ids, items)
    there = at < ids.size
    there[there] = ids[at[there]] == items[there]
    return np.where(there, at, 0), there
