"""Profiling kernels: per-row access counts and the skew statistics derived from them.

Numpy only; the statistics are the profile store's record (storage.profile.TableStats).
The distributed driver (shardflow.profiling.profiles) calls `count_ids` on each block of a
dataset's chunks and `table_stats` once per table on the summed counts.
"""

from __future__ import annotations

import math

import numpy as np

from shardflow.errors import InputError
from storage.profile import TableStats


def count_ids(
    ids: np.ndarray, rows: int, *, where: str, first_position: int = 0, out: np.ndarray | None = None
) -> np.ndarray:
    """Occurrences of every row of a `rows`-row table in `ids` (an int64 array of length `rows`).

    With `out`, the occurrences are added to it in place: a block of ids is counted without
    allocating a table-sized array per block. `where` names the array and `first_position`
    the position of ids[0] in it, so that a bad id is reported where it actually is.
    """
    if not np.issubdtype(ids.dtype, np.integer):
        raise InputError(f"{where}: ids have dtype {ids.dtype}; accepted: an integer dtype")
    counts = np.zeros(rows, dtype=np.int64) if out is None else out
    if ids.size == 0:
        return counts
    if ids.min() < 0 or ids.max() >= rows:
        bad = int(np.flatnonzero((ids < 0) | (ids >= rows))[0])
        raise InputError(
            f"{where}[{first_position + bad}] = {int(ids[bad])} is outside the table; "
            f"accepted: 0 <= id < {rows}"
        )
    np.add.at(counts, ids, 1)
    return counts


def _read_rows_descending(counts: np.ndarray) -> np.ndarray:
    """Counts of the rows that were read, most-read first."""
    return np.sort(counts[counts > 0])[::-1]


def top_share(counts: np.ndarray, fraction: float, *, descending: np.ndarray | None = None) -> float:
    """Fraction of all accesses that go to the most-read `fraction` of the rows read (at least one row).

    Over the rows read, not the table's: a hashed table of 2^20 rows of which 4,000 are
    read would otherwise report its top 1% (10,486 rows) as taking every access.
    """
    desc = _read_rows_descending(counts) if descending is None else descending
    total = int(desc.sum())
    if total == 0:
        return 0.0
    k = max(1, math.ceil(fraction * desc.size))
    return float(desc[:k].sum() / total)


def zipf_slope(counts: np.ndarray, *, descending: np.ndarray | None = None) -> float:
    """Slope of log(count) against log(rank) over the rows that were read, sign flipped.

    A Zipf(alpha) table gives about alpha; 0 means every read row was read equally often.
    """
    read = _read_rows_descending(counts) if descending is None else descending
    if read.size < 2:
        return 0.0
    # Least squares in closed form: slope = cov(x, y) / var(x).
    x = np.log(np.arange(1, read.size + 1, dtype=np.float64))
    y = np.log(read.astype(np.float64))
    x -= x.mean()
    return float(-np.dot(x, y - y.mean()) / np.dot(x, x))


def table_stats(counts: np.ndarray) -> TableStats:
    desc = _read_rows_descending(counts)
    return TableStats(
        rows=int(counts.size),
        accesses=int(desc.sum()),
        distinct=int(desc.size),
        top1pct_share=top_share(counts, 0.01, descending=desc),
        top10pct_share=top_share(counts, 0.10, descending=desc),
        zipf_slope=zipf_slope(counts, descending=desc),
    )
