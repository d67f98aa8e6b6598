"""What the profile says about lookups, in the form the planner needs.

A table's rows fall into classes of equal access count: every row of a class has the
same lookup probability, so it costs and is worth the same. Zipf tables of 10^8 rows
have only tens of thousands of distinct counts, so costs, the relaxation and the bound
are computed per class, and only tiers and homes are per row.

Lookups of one training example (shardflow.data.examples): the non-padded history, the
positive and K uniform negatives for the sequence table; one per example for a feature
table. History items and positives follow the profile's occurrence counts; negatives
are uniform over the rows, so a row's lookup probability mixes the two.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from shardflow.errors import InputError

CHUNK_ROWS = 1 << 22  # rows handled at a time in per-row passes: bounds memory for 10^8-row tables


@dataclass(frozen=True)
class TableAccess:
    """Per-row lookup probabilities of one table, grouped in classes, and lookups per example."""

    name: str
    rows: int
    lookups_per_example: float
    class_prob: np.ndarray  # float64 [C]: probability that one lookup reads a given row of the class
    class_rows: np.ndarray  # int64 [C]: rows in the class
    row_class: np.ndarray  # int32 [rows]: class of every row

    @classmethod
    def from_counts(
        cls, name: str, counts: np.ndarray, lookups_per_example: float, uniform_share: float = 0.0
    ) -> TableAccess:
        """Probabilities from occurrence counts, mixed with a uniform part (`uniform_share` of lookups)."""
        counts = np.asarray(counts)
        if counts.ndim != 1 or counts.size == 0 or not np.issubdtype(counts.dtype, np.integer):
            raise InputError(f"table '{name}': counts {counts.dtype} {counts.shape}; accepted: a 1-d integer array")
        if (counts < 0).any():
            raise InputError(f"table '{name}': negative access counts; accepted: counts >= 0")
        total = int(counts.sum())
        if total == 0 and uniform_share == 0:
            raise InputError(f"table '{name}' was never read; accepted: a profile with at least one access")
        if not (lookups_per_example > 0 and np.isfinite(lookups_per_example)):
            raise InputError(f"table '{name}': lookups per example = {lookups_per_example}; accepted: a number > 0")
        if not 0 <= uniform_share <= 1:
            raise InputError(f"table '{name}': uniform share = {uniform_share}; accepted: 0 <= share <= 1")
        values, class_rows = np.unique(counts, return_counts=True)
        row_class = np.empty(counts.size, dtype=np.int32)
        for s in range(0, counts.size, CHUNK_ROWS):
            row_class[s : s + CHUNK_ROWS] = np.searchsorted(values, counts[s : s + CHUNK_ROWS])
        share = (1.0 - uniform_share) if total else 0.0
        prob = share * values / max(total, 1) + (uniform_share if total else 1.0) / counts.size
        return cls(
            name=name,
            rows=int(counts.size),
            lookups_per_example=float(lookups_per_example),
            class_prob=prob.astype(np.float64),
            class_rows=class_rows.astype(np.int64),
            row_class=row_class,
        )

    @cached_property
    def class_order(self) -> np.ndarray:
        """Classes from the most-read to the least-read."""
        return np.argsort(-self.class_prob, kind="stable")

    @cached_property
    def rank_in_class(self) -> np.ndarray:
        """int32 [rows]: each row's rank among the rows of its class, in id order.

        A counting sort, chunk by chunk, so a 10^8-row table needs no 10^8-element argsort.
        """
        classes = self.class_prob.size
        rank = np.empty(self.rows, dtype=np.int32)
        seen = np.zeros(classes, dtype=np.int64)
        for s in range(0, self.rows, CHUNK_ROWS):
            c = self.row_class[s : s + CHUNK_ROWS]
            order = np.argsort(c, kind="stable")
            counts = np.bincount(c, minlength=classes)
            within = np.empty(c.size, dtype=np.int64)
            within[order] = np.arange(c.size) - (np.cumsum(counts) - counts)[c[order]]
            rank[s : s + CHUNK_ROWS] = within + seen[c]
            seen += counts
        return rank


def sequence_lookups(offsets: np.ndarray, history: int, negatives: int) -> tuple[float, float]:
    """(lookups per training example, share of them that are uniform negatives) for the item table.

    Exact for the examples `build_examples(split="train")` makes: targets s[1..n-2], each
    with min(position, history) non-padded history items, one positive and `negatives`
    negatives.
    """
    k = np.maximum(np.diff(np.asarray(offsets, dtype=np.int64)) - 2, 0)
    examples = int(k.sum())
    if examples == 0:
        raise InputError("no training examples: every user has fewer than 3 items; accepted: users with >= 3")
    short = np.minimum(k, history)
    hist = short * (short + 1) // 2 + (k - short) * history
    per_example = (int(hist.sum()) + examples) / examples + negatives
    return per_example, negatives / per_example
