"""Seeded synthetic sequences with Zipf(alpha)-distributed ids, generated block by block and stored.

Row popularity follows a bounded Zipf law: the row of popularity rank r (1-based) is
read with probability proportional to r^-alpha. Ranks are mapped to row ids by a
seeded affine permutation (id = (a*rank + b) mod rows), so hot rows are scattered over
the id space as they are after re-indexing real data, not packed at the front.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any

import numpy as np

from shardflow.errors import InputError
from storage.dataset import EVENTS_PER_CHUNK
from storage.dataset_manifest import record_verified
from storage.dataset_writer import SegmentWriter, build_manifest, segment_name, start_store
from storage.lock import writer_lock
from storage.manifest import write_manifest
from storage.staging import check_destination, staged
from storage.tables import TableSpec

# Memory a synthetic log holds while it is made: a table's CDF (float64) and its identity raw ids (int64) per row;
# per user, the geometric draws, their sum, the offsets and the runs' and user ids (int64 each, with slack).
SYNTH_ROW_BYTES = 16
SYNTH_USER_BYTES = 48


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
        exact = Decimal(parts[1])  # 1e20 exactly, not as a float
        huge = exact.is_finite() and exact.adjusted() > 18
        rows = 0 if huge else int(exact) if "e" in parts[1].lower() else int(parts[1])
        alpha = float(parts[2]) if len(parts) == 3 else 1.0
    except (ValueError, ArithmeticError):
        raise InputError(f"table {text!r}: ROWS must be an integer and ALPHA a number, e.g. item:1000000:1.2") from None
    if huge:
        raise InputError(f"table {text!r}: rows = {parts[1]}; accepted: fewer than 2^63")
    return SynthTable(parts[0], rows, alpha)


class ZipfRows:
    """Samples row ids of one table; the CDF over ranks is built once (8 bytes a row)."""

    def __init__(self, table: SynthTable, seed: tuple[int, ...]) -> None:
        self.rows = table.rows
        self._cdf = np.arange(1, table.rows + 1, dtype=np.float64)  # the weights, then their CDF, in place
        self._cdf **= -table.alpha
        np.cumsum(self._cdf, out=self._cdf)
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


@dataclass(frozen=True)
class Repeats:
    """Session-like sequences: a `share` of events (each user's first excepted) repeat one of the user's
    last `window` items, picked uniformly among those the user has."""

    share: float = 0.0
    window: int = 5

    def __post_init__(self) -> None:
        if not (isinstance(self.share, (int, float)) and 0 <= self.share <= 1):
            raise InputError(f"repeat share = {self.share!r}; accepted: a number from 0 to 1")
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 1:
            raise InputError(f"repeat window = {self.window!r}; accepted: an integer >= 1")

    def apply(self, ids: np.ndarray, start: int, offsets: np.ndarray, before: np.ndarray,
              rng: np.random.Generator) -> np.ndarray:
        """`ids` (events start.., drawn independently) with repeats; `before` holds the final ids of the
        `window` events before `start` (fewer at the front of the log)."""
        n = ids.size
        pos = np.arange(start, start + n, dtype=np.int64)
        first = offsets[np.searchsorted(offsets, pos, side="right") - 1]
        have = np.minimum(pos - first, self.window)  # earlier items of the same user within the window
        repeat = (rng.random(n) < self.share) & (have >= 1)
        source = pos - 1 - np.floor(rng.random(n) * np.maximum(have, 1)).astype(np.int64)
        out = ids.copy()
        outside = repeat & (source < start)  # a source in the block before: its final id is known
        out[outside] = before[source[outside] - start + before.size]
        # inside the block a source may itself be a repeat: follow the chains (pointer doubling)
        link = np.arange(n)
        inside = repeat & ~outside
        link[inside] = source[inside] - start
        while True:
            nxt = link[link]
            if np.array_equal(nxt, link):
                break
            link = nxt
        return out[link]


def synth_dataset(
    dest: str | Path,
    tables: list[SynthTable],
    *,
    interactions: int,
    seed: int,
    mean_length: float = 20.0,
    overwrite: bool = False,
    events_per_chunk: int = EVENTS_PER_CHUNK,
    repeats: Repeats = Repeats(),
) -> dict[str, Any]:
    """Generate and store a dataset; the first table is the item sequence, the others feature columns.

    At most one block of `events_per_chunk` ids per table is in memory at a time. With
    `repeats`, the item sequence has session-like repeats (Repeats); without, every id
    is an independent Zipf draw.
    """
    _check_synth(tables, interactions, seed, events_per_chunk, mean_length)
    dest = Path(dest)
    check_destination(dest, overwrite=overwrite)
    lengths = user_lengths(interactions, mean_length, seed)
    users = len(lengths)
    with writer_lock(dest), staged(dest, overwrite=overwrite) as stage:
        writer = SegmentWriter(
            start_store(stage) / segment_name(0),
            events=interactions,
            runs=users,
            tables={t.name: t.spec.id_dtype for t in tables},
            events_per_chunk=events_per_chunk,
        )
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        writer.write_runs(np.arange(users), offsets)
        writer.write_user_ids(np.arange(users))
        _write_ids(writer, tables, interactions, seed, events_per_chunk, repeats, offsets)
        manifest = build_manifest(
            version=1,
            users=users,
            tables={t.name: {"rows": t.rows, "dtype": str(t.spec.id_dtype)} for t in tables},
            sequence_table=tables[0].name,
            dense=(),
            labels=False,
            source=_source(tables, interactions, mean_length, seed, repeats),
            segments=[writer.finish(segment_name(0), 1)],
        )
        write_manifest(stage, manifest)
        record_verified(stage)
        return manifest


def _source(tables: list[SynthTable], interactions: int, mean_length: float, seed: int,
            repeats: Repeats) -> dict[str, Any]:
    """The manifest's record of how the log was made: enough to make it again."""
    return {
        "generator": "shardflow synth",
        "tables": [f"{t.name}:{t.rows}:{t.alpha}" for t in tables],
        "interactions": interactions,
        "mean_length": mean_length,
        "seed": seed,
        **({"repeats": {"share": repeats.share, "window": repeats.window}} if repeats.share else {}),
    }


def _check_synth(tables: list[SynthTable], interactions: int, seed: int, events_per_chunk: int,
                 mean_length: float) -> None:
    if not tables:
        raise InputError("no tables given; accepted: at least one NAME:ROWS[:ALPHA]")
    names = [t.name for t in tables]
    if len(set(names)) != len(names):
        raise InputError(f"table names repeat: {names}; accepted: unique names")
    if isinstance(interactions, bool) or not isinstance(interactions, int) or interactions < 1:
        raise InputError(f"interactions = {interactions!r}; accepted: an integer >= 1")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise InputError(f"seed = {seed!r}; accepted: an integer >= 0")
    if events_per_chunk < 1:
        raise InputError(f"events per chunk = {events_per_chunk}; accepted: an integer >= 1")
    if not (isinstance(mean_length, (int, float)) and math.isfinite(mean_length) and mean_length >= 1):
        raise InputError(f"mean length = {mean_length}; accepted: a number >= 1")
    _fits_memory(tables, interactions, mean_length)


def _fits_memory(tables: list[SynthTable], interactions: int, mean_length: float) -> None:
    """The largest table's CDF and identity ids, and the users' lengths and offsets, must fit half this machine's
    memory, checked before anything is written (a table of 3·10^9 rows was killed for memory; 10^20 rows or
    interactions ended in numpy's "Maximum allowed size exceeded")."""
    import psutil

    have = psutil.virtual_memory().total // 2
    largest = max(tables, key=lambda t: t.rows)
    if largest.rows * SYNTH_ROW_BYTES > have:
        raise InputError(f"table '{largest.name}': rows = {largest.rows:,} need {SYNTH_ROW_BYTES} bytes each to draw "
                         f"and store ({largest.rows * SYNTH_ROW_BYTES / 1e9:,.1f} GB), over half this machine's memory "
                         f"({have / 1e9:,.1f} GB); accepted: at most {have // SYNTH_ROW_BYTES:,} rows")
    users = interactions / mean_length
    if users * SYNTH_USER_BYTES > have:
        raise InputError(f"interactions = {interactions:,} at mean length {mean_length:g}: about {users:,.0f} users of "
                         f"{SYNTH_USER_BYTES} bytes each ({users * SYNTH_USER_BYTES / 1e9:,.1f} GB), over half this "
                         f"machine's memory ({have / 1e9:,.1f} GB); accepted: at most "
                         f"{int(have // SYNTH_USER_BYTES * mean_length):,} interactions, or a longer mean length")


def _write_ids(writer: SegmentWriter, tables: list[SynthTable], interactions: int, seed: int, events_per_chunk: int,
               repeats: Repeats, offsets: np.ndarray) -> None:
    """Every table's ids, block by block (the item sequence with its repeats), and each table's identity raw ids."""
    start, before = 0, np.zeros(0, dtype=np.int64)
    for k, (name, block) in enumerate(synth_blocks(tables, interactions, seed, events_per_chunk)):
        if name == tables[0].name and repeats.share > 0:
            block = repeats.apply(block, start, offsets, before, np.random.default_rng([seed, 0x5E55, k]))
            start += block.size
            before = np.concatenate([before, block])[-repeats.window:]
        writer.write(f"tables/{name}", block)
    for t in tables:
        identity = np.arange(t.rows)
        writer.write_raw_ids(t.name, identity, identity)
