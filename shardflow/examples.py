"""Training and evaluation examples from users' sequences: one deterministic, vectorised builder.

For a user with items s[0..n-1] (time order):
    train  targets s[1..n-2], each with the window of up to `history` items before it
    eval   target s[n-1] (leave-last-out), with the window before it
Histories are left-padded with PAD. Negatives are drawn uniformly from the other rows of
the table by a counter-based hash of (seed, target position, k): the same example gets
the same negatives whichever block of users it is built in.

The planner's cost model counts lookups from these examples; the trainer trains on them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from shardflow.errors import InputError

PAD = -1
SPLITS = ("train", "eval")


@dataclass(frozen=True)
class Examples:
    history: np.ndarray  # int64 [E, L], PAD-padded on the left
    positive: np.ndarray  # int64 [E]
    negatives: np.ndarray  # int64 [E, K], never equal to the positive
    user: np.ndarray  # int64 [E]
    position: np.ndarray  # int64 [E], the target's event index in the dataset

    def __len__(self) -> int:
        return len(self.positive)


def splitmix64(x: np.ndarray) -> np.ndarray:
    """A bijective 64-bit mixer (Steele et al., SplitMix64); uint64 arithmetic wraps."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def sample_negatives(positive: np.ndarray, position: np.ndarray, rows: int, k: int, seed: int) -> np.ndarray:
    """k ids per example, uniform over the table's rows other than the positive."""
    if k == 0:
        return np.empty((len(positive), 0), dtype=np.int64)
    if rows < 2:
        raise InputError(f"negatives need a table of at least 2 rows; this one has {rows}")
    counter = position.astype(np.uint64)[:, None] * np.uint64(k) + np.arange(k, dtype=np.uint64)[None, :]
    with np.errstate(over="ignore"):
        mixed = splitmix64(counter ^ splitmix64(np.full(1, seed, dtype=np.uint64)))
    neg = (mixed % np.uint64(rows - 1)).astype(np.int64)
    return neg + (neg >= positive[:, None])


def target_positions(offsets: np.ndarray, split: str = "train") -> np.ndarray:
    """Absolute event indices of the targets of every user `offsets` delimits (offsets[0] = 0)."""
    if split not in SPLITS:
        raise InputError(f"split {split!r}; accepted: {', '.join(SPLITS)}")
    offsets = np.asarray(offsets, dtype=np.int64)
    lengths = np.diff(offsets)
    user = np.repeat(np.arange(len(lengths), dtype=np.int64), lengths)
    pos = np.arange(int(offsets[-1] - offsets[0]), dtype=np.int64) - (offsets[:-1][user] - offsets[0])
    n = lengths[user]
    mask = (pos >= 1) & (pos <= n - 2) if split == "train" else (pos == n - 1) & (n >= 2)
    return np.flatnonzero(mask) + offsets[0]


def examples_at(
    offsets: np.ndarray,
    ids: np.ndarray,
    targets: np.ndarray,
    rows: int,
    *,
    history: int,
    negatives: int,
    seed: int,
    first_user: int = 0,
) -> Examples:
    """The examples whose targets are the absolute event indices `targets`.

    `ids` holds the sequence table's ids of events offsets[0]:offsets[-1]; every target
    must lie inside that span (and not be its user's first event).
    """
    if history < 1 or negatives < 0:
        raise InputError(f"history = {history}, negatives = {negatives}; accepted: history >= 1, negatives >= 0")
    offsets = np.asarray(offsets, dtype=np.int64)
    base = int(offsets[0])
    if len(ids) != offsets[-1] - base:
        raise InputError(f"{len(ids)} ids for offsets spanning {int(offsets[-1] - base)} events")
    targets = np.asarray(targets, dtype=np.int64)
    user = np.searchsorted(offsets, targets, side="right") - 1
    start = offsets[user] - base
    local = targets - base
    window = local[:, None] - history + np.arange(history, dtype=np.int64)[None, :]
    valid = window >= start[:, None]
    ids = np.asarray(ids)
    hist = np.where(valid, ids[np.maximum(window, 0)].astype(np.int64), PAD)
    positive = ids[local].astype(np.int64)
    return Examples(
        history=hist,
        positive=positive,
        negatives=sample_negatives(positive, targets, rows, negatives, seed),
        user=user + first_user,
        position=targets,
    )


def build_examples(
    offsets: np.ndarray,
    ids: np.ndarray,
    rows: int,
    *,
    history: int,
    negatives: int,
    seed: int,
    split: str = "train",
    first_user: int = 0,
) -> Examples:
    """Examples of the users whose events `offsets` delimits.

    `offsets` are absolute event indices of a run of consecutive users (offsets[0] may be
    > 0 for a block of users, the first of them user `first_user`); `ids` holds the
    sequence table's ids of events offsets[0]:offsets[-1].
    """
    return examples_at(
        offsets,
        ids,
        target_positions(offsets, split),
        rows,
        history=history,
        negatives=negatives,
        seed=seed,
        first_user=first_user,
    )
