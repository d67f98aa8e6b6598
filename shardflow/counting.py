"""Profiling kernels: per-row access counts and the skew statistics derived from them.

Pure numpy. The distributed driver (shardflow.profiling) calls `count_ids` on each
block of a dataset's chunks and `table_stats` once per table on the summed counts.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from shardflow.errors import InputError


def count_ids(ids: np.ndarray, rows: int, *, where: str, first_position: int = 0) -> np.ndarray:
    """Occurrences of every row of a `rows`-row table in `ids` (an int64 array of length `rows`).

    `where` names the array and `first_position` the position of ids[0] in it, so that a bad
    id is reported where it actually is.
    """
    if not np.issubdtype(ids.dtype, np.integer):
        raise InputError(f"{where}: ids have dtype {ids.dtype}; accepted: an integer dtype")
    if ids.size == 0:
        return np.zeros(rows, dtype=np.int64)
    if ids.min() < 0 or ids.max() >= rows:
        bad = int(np.flatnonzero((ids < 0) | (ids >= rows))[0])
        raise InputError(
            f"{where}[{first_position + bad}] = {int(ids[bad])} is outside the table; "
            f"accepted: 0 <= id < {rows}"
        )
    return np.bincount(ids, minlength=rows).astype(np.int64, copy=False)


@dataclass(frozen=True)
class TableStats:
    """How skewed the accesses to one table are."""

    rows: int
    accesses: int
    distinct: int
    top1pct_share: float
    top10pct_share: float
    zipf_slope: float

    def to_dict(self) -> dict:
        return asdict(self)


def top_share(counts: np.ndarray, fraction: float) -> float:
    """Fraction of all accesses that go to the most-read `fraction` of rows (at least one row)."""
    total = int(counts.sum())
    if total == 0:
        return 0.0
    k = max(1, math.ceil(fraction * counts.size))
    return float(np.partition(counts, counts.size - k)[counts.size - k :].sum() / total)


def zipf_slope(counts: np.ndarray) -> float:
    """Slope of log(count) against log(rank) over the rows that were read, sign flipped.

    A Zipf(alpha) table gives about alpha; 0 means every read row was read equally often.
    """
    read = np.sort(counts[counts > 0])[::-1]
    if read.size < 2:
        return 0.0
    ranks = np.arange(1, read.size + 1, dtype=np.float64)
    slope, _ = np.polyfit(np.log(ranks), np.log(read.astype(np.float64)), 1)
    return float(-slope)


def table_stats(counts: np.ndarray) -> TableStats:
    return TableStats(
        rows=int(counts.size),
        accesses=int(counts.sum()),
        distinct=int(np.count_nonzero(counts)),
        top1pct_share=top_share(counts, 0.01),
        top10pct_share=top_share(counts, 0.10),
        zipf_slope=zipf_slope(counts),
    )
