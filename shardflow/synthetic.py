"""Seeded synthetic sequences with Zipf(alpha)-distributed ids, generated block by block.

Row popularity follows a bounded Zipf law: the row of popularity rank r (1-based) is
read with probability proportional to r^-alpha. Ranks are mapped to row ids by a
seeded affine permutation (id = (a*rank + b) mod rows), so hot rows are scattered over
the id space as they are after re-indexing real data, not packed at the front.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from shardflow.errors import InputError
from shardflow.tables import TableSpec


@dataclass(frozen=True)
class SynthTable:
    """One synthetic table: `rows` rows read with Zipf(`alpha`) popularity."""

    name: str
    rows: int
    alpha: float

    def __post_init__(self) -> None:
        TableSpec(self.name, self.rows)
        if not (isinstance(self.alpha, (int, float)) and math.isfinite(self.alpha) and self.alpha >= 0):
            raise InputError(f"table '{self.name}': alpha = {self.alpha!r}; accepted: a finite number >= 0")

    @property
    def spec(self) -> TableSpec:
        return TableSpec(self.name, self.rows)


def parse_synth_table(text: str) -> SynthTable:
    """'NAME:ROWS[:ALPHA]' -> SynthTable (alpha defaults to 1.0)."""
    parts = text.split(":")
    if len(parts) not in (2, 3):
        raise InputError(f"table {text!r}; accepted: NAME:ROWS or NAME:ROWS:ALPHA, e.g. item:1000000:1.2")
    try:
        rows = int(float(parts[1])) if "e" in parts[1].lower() else int(parts[1])
        alpha = float(parts[2]) if len(parts) == 3 else 1.0
    except ValueError:
        raise InputError(f"table {text!r}: ROWS must be an integer and ALPHA a number, e.g. item:1000000:1.2") from None
    return SynthTable(parts[0], rows, alpha)


class ZipfRows:
    """Samples row ids of one table; the CDF over ranks is built once (8 bytes a row)."""

    def __init__(self, table: SynthTable, seed: tuple[int, ...]) -> None:
        self.rows = table.rows
        weights = np.arange(1, table.rows + 1, dtype=np.float64) ** -table.alpha
        self._cdf = np.cumsum(weights)
        self._cdf /= self._cdf[-1]
        rng = np.random.default_rng([*seed, table.rows])
        # a must be coprime to rows for the map to be a permutation; a*rank stays below 2^63.
        a_max = max(2, min(table.rows, (1 << 62) // table.rows))
        a = int(rng.integers(1, a_max))
        while math.gcd(a, table.rows) != 1:
            a += 1
        self._a, self._b = a, int(rng.integers(0, table.rows))

    def row_of_rank(self, rank: np.ndarray) -> np.ndarray:
        """Row id of 0-based popularity ranks."""
        return (self._a * rank.astype(np.int64) + self._b) % self.rows

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        rank = np.searchsorted(self._cdf, rng.random(n), side="right")
        return self.row_of_rank(np.minimum(rank, self.rows - 1))


def user_lengths(interactions: int, mean_length: float, seed: int) -> np.ndarray:
    """Sequence lengths (geometric, at least 1, mean about `mean_length`) summing to `interactions`."""
    if interactions < 1:
        raise InputError(f"interactions = {interactions}; accepted: an integer >= 1")
    if not mean_length >= 1:
        raise InputError(f"mean length = {mean_length}; accepted: a number >= 1")
    rng = np.random.default_rng([seed, 0x5EC])
    parts, total = [], 0
    while total < interactions:
        draw = rng.geometric(1.0 / mean_length, size=int((interactions - total) / mean_length * 1.1) + 16)
        parts.append(draw)
        total += int(draw.sum())
    lengths = np.concatenate(parts)
    ends = np.cumsum(lengths)
    users = int(np.searchsorted(ends, interactions)) + 1
    lengths = lengths[:users]
    lengths[-1] -= int(ends[users - 1]) - interactions
    return lengths


def synth_blocks(
    tables: list[SynthTable], interactions: int, seed: int, block: int
) -> Iterator[tuple[str, np.ndarray]]:
    """(table name, ids) blocks of `block` events, table by table, front to back.

    Block k of table t is drawn from its own generator seeded (seed, t, k): the data does
    not depend on which process draws which block, only on the block size.
    """
    for t, table in enumerate(tables):
        sampler = ZipfRows(table, (seed, t))
        for k, start in enumerate(range(0, interactions, block)):
            rng = np.random.default_rng([seed, t, k])
            yield table.name, sampler.sample(rng, min(block, interactions - start))
