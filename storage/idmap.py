"""Raw ids to rows, across the parts of a dataset: vectorised, never a Python loop over values.

A table's rows (and the users' indices) are given part by part: the values a part
introduces get the next rows, in sorted order of the raw value; a value seen in an
earlier part keeps its row. One file therefore numbers its values in sorted order, and
an append never moves a row. Hashed tables (criteo) put a value in row
crc32(value) mod rows instead, the same in every part.

Numeric ids that are not too large are collected in a bitmap indexed by the id (direct
addressing); larger ones and text tokens by sorting (numpy) or hashing (arrow).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

# Hashed row ids are stored as int32 (storage.scan): a hashed table has at most this many rows.
MAX_HASH_ROWS = 2**31 - 1

DIRECT_LIMIT = 1 << 26  # ids below this are marked in a bitmap of that many bytes at most


class IntDistinct:
    """The distinct non-negative integers of a stream of blocks."""

    def __init__(self) -> None:
        self._seen = np.zeros(0, dtype=bool)
        self._sorted: np.ndarray | None = None  # once an id is past DIRECT_LIMIT

    def add(self, values: np.ndarray) -> None:
        if values.size == 0:
            return
        top = int(values.max())
        if self._sorted is None and top < DIRECT_LIMIT:
            if top >= self._seen.size:
                self._seen = np.concatenate(
                    [self._seen, np.zeros(max(top + 1, 2 * self._seen.size) - self._seen.size, bool)]
                )
            self._seen[values] = True
            return
        if self._sorted is None:
            self._sorted = np.flatnonzero(self._seen).astype(np.int64)
            self._seen = np.zeros(0, dtype=bool)
        self._sorted = np.union1d(self._sorted, np.unique(values))

    def values(self) -> np.ndarray:
        """Sorted int64."""
        return np.flatnonzero(self._seen).astype(np.int64) if self._sorted is None else self._sorted


class TextDistinct:
    """The distinct strings of a stream of blocks (arrow hashing), kept compact as they come."""

    def __init__(self) -> None:
        self._parts: list[pa.Array] = []
        self._size = 0
        self._compacted = 0

    def add(self, values: pa.Array) -> None:
        u = pc.unique(values)
        self._parts.append(u)
        self._size += len(u)
        if self._size > 2 * max(self._compacted, 1 << 16):
            self._compact()

    def _compact(self) -> None:
        merged = pc.unique(pa.concat_arrays(self._parts))
        self._parts, self._size, self._compacted = [merged], len(merged), len(merged)

    def values(self) -> pa.Array:
        """Sorted (by UTF-8 bytes, i.e. by code point)."""
        if not self._parts:
            return pa.array([], pa.string())
        self._compact()
        merged = self._parts[0]
        return merged.take(pc.sort_indices(merged))


class TextCodes:
    """Per-block dictionary codes of strings, made consistent over a whole part.

    `encode` returns int32 codes into `dictionary` (first-seen order); new strings of a
    block are appended to it.
    """

    def __init__(self) -> None:
        self.dictionary = pa.array([], pa.string())

    def encode(self, values: pa.Array) -> np.ndarray:
        enc = pc.dictionary_encode(values)
        block_dict = enc.dictionary
        where = pc.index_in(block_dict, value_set=self.dictionary)
        known = where.is_valid().to_numpy(zero_copy_only=False)
        position = np.empty(len(block_dict), dtype=np.int32)
        position[known] = where.filter(where.is_valid()).to_numpy()
        new = np.flatnonzero(~known)
        position[new] = len(self.dictionary) + np.arange(new.size, dtype=np.int32)
        if new.size:
            self.dictionary = pa.concat_arrays([self.dictionary, block_dict.take(pa.array(new))])
        return position[enc.indices.to_numpy()]


def _crc_table() -> np.ndarray:
    c = np.arange(256, dtype=np.uint32)
    for _ in range(8):
        c = np.where(c & 1, np.uint32(0xEDB88320) ^ (c >> np.uint32(1)), c >> np.uint32(1))
    return c.astype(np.uint32)


_CRC = _crc_table()


def crc32_text(values: pa.Array) -> np.ndarray:
    """zlib.crc32 of every string's UTF-8 bytes (uint32), one pass per character position."""
    values = values.cast(pa.large_string())
    n = len(values)
    if n == 0:
        return np.zeros(0, dtype=np.uint32)
    offsets = np.frombuffer(values.buffers()[1], dtype=np.int64)[values.offset : values.offset + n + 1]
    data = values.buffers()[2]
    data = np.frombuffer(data, dtype=np.uint8) if data is not None else np.zeros(0, np.uint8)
    starts, lengths = offsets[:-1], np.diff(offsets)
    crc = np.full(n, 0xFFFFFFFF, dtype=np.uint32)
    order = np.argsort(-lengths, kind="stable")  # longest first: position j touches a prefix
    longest = int(lengths[order[0]])
    active = np.searchsorted(-lengths[order], -np.arange(1, longest + 1), side="right")
    for j in range(longest):
        rows = order[: active[j]]
        byte = data[starts[rows] + j]
        crc[rows] = _CRC[(crc[rows] ^ byte) & np.uint32(0xFF)] ^ (crc[rows] >> np.uint32(8))
    return crc ^ np.uint32(0xFFFFFFFF)


class IdMap:
    """Raw value → row of one table (or → index of the users), growing part by part.

    `hash_rows` makes a hashed table of text values (rows fixed, row = crc32 mod
    hash_rows); otherwise rows are dense and new values get the next ones. A table holds
    integers or text, never both.
    """

    def __init__(self, raw: np.ndarray | pa.Array, rows: np.ndarray, *, hash_rows: int | None = None) -> None:
        self.hash_rows = hash_rows
        self.text = not isinstance(raw, np.ndarray) or raw.dtype.kind in "USOT"
        if self.text and isinstance(raw, np.ndarray):
            raw = pa.array(raw if raw.dtype.kind == "T" else raw.astype(object), pa.string())
        rows = np.asarray(rows, dtype=np.int64)
        self.size = int(hash_rows) if hash_rows else (int(rows.max()) + 1 if rows.size else 0)
        if self.text:
            self._known, self._rows = raw, rows
        else:
            order = np.argsort(raw, kind="stable")
            self._known, self._rows = np.asarray(raw, dtype=np.int64)[order], rows[order]

    @classmethod
    def empty(cls, text: bool, hash_rows: int | None = None) -> IdMap:
        raw = pa.array([], pa.string()) if text else np.zeros(0, dtype=np.int64)
        return cls(raw, np.zeros(0, dtype=np.int64), hash_rows=hash_rows)

    def extend(self, distinct: np.ndarray | pa.Array) -> tuple[np.ndarray | pa.Array, np.ndarray]:
        """Give rows to the values of sorted `distinct` not seen before; returns them and their rows."""
        if self.text:
            new = distinct.filter(pc.invert(pc.is_in(distinct, value_set=self._known)))
        else:
            new = distinct[~_isin_sorted(distinct, self._known)]
        if self.hash_rows:
            rows = (crc32_text(new) % np.uint32(self.hash_rows)).astype(np.int64)
        else:
            rows = self.size + np.arange(len(new), dtype=np.int64)
            self.size += len(new)
        if self.text:
            self._known = pa.concat_arrays([self._known, new.cast(pa.string())])
            self._rows = np.concatenate([self._rows, rows])
        else:
            merged = np.concatenate([self._known, new])
            order = np.argsort(merged, kind="stable")
            self._known, self._rows = merged[order], np.concatenate([self._rows, rows])[order]
        return new, rows

    def rows_of(self, values: np.ndarray | pa.Array) -> np.ndarray:
        """Rows of values that are all known (after `extend`)."""
        if self.text:
            return self._rows[pc.index_in(values, value_set=self._known).to_numpy()]
        return self._rows[np.searchsorted(self._known, values)]


class RowLookup:
    """Maps integer raw values to rows: a direct table when they are small, else a sorted search."""

    def __init__(self, distinct: np.ndarray, rows: np.ndarray) -> None:
        dtype = np.int32 if (rows.size == 0 or rows.max() < 2**31) else np.int64
        if distinct.size == 0 or distinct[-1] < DIRECT_LIMIT:
            self._table = np.zeros(int(distinct[-1]) + 1 if distinct.size else 0, dtype=dtype)
            self._table[distinct] = rows
            self._sorted = None
        else:
            self._sorted, self._rows = distinct, rows.astype(dtype)

    def __call__(self, values: np.ndarray) -> np.ndarray:
        if self._sorted is None:
            return self._table[values]
        return self._rows[np.searchsorted(self._sorted, values)]


def _isin_sorted(values: np.ndarray, known_sorted: np.ndarray) -> np.ndarray:
    if known_sorted.size == 0:
        return np.zeros(values.size, dtype=bool)
    at = np.minimum(np.searchsorted(known_sorted, values), known_sorted.size - 1)
    return known_sorted[at] == values
