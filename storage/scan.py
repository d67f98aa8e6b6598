"""The scan phase of an import (storage.importers): one part read block by block and parsed with arrow;
its events spilled to plain files in the staging directory and every column's distinct raw values collected.

A part's scan runs wherever the import sends it (a Dask worker when there are several parts) and
returns a `PartScan`, small enough to travel back: distinct values and runs, never the events.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from shardflow.errors import InputError, stop_if_asked
from storage.formats import Format, runs_of, sniff_delimiter
from storage.idmap import IntDistinct, TextCodes, TextDistinct, crc32_text
from storage.sources import Block, Part, PartReader


class Spill:
    """Per-event columns of one part in plain binary files, appended block by block."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.dtypes: dict[str, str] = {}
        self._files: dict[str, object] = {}

    def add(self, name: str, values: np.ndarray) -> None:
        """Append `values`; integer ids are kept as int32 while they fit (half the bytes to spill)."""
        if name not in self._files:
            dtype = values.dtype
            if dtype == np.int64 and (values.size == 0 or values.max() < 2**31):
                dtype = np.dtype(np.int32)
            self.dtypes[name] = dtype.str
            self._files[name] = open(self.directory / f"{name}.bin", "wb")
        elif self.dtypes[name] == np.dtype(np.int32).str and values.dtype == np.int64 and values.max() >= 2**31:
            self._widen(name)
        values.astype(self.dtypes[name], copy=False).tofile(self._files[name])

    def _widen(self, name: str) -> None:
        """Rewrite an int32 column as int64: an id past 2^31 arrived after smaller ones."""
        self._files[name].close()
        path = self.directory / f"{name}.bin"
        wide = np.fromfile(path, dtype=np.int32).astype(np.int64)
        self._files[name] = open(path, "wb")
        wide.tofile(self._files[name])
        self.dtypes[name] = np.dtype(np.int64).str

    def close(self) -> None:
        for f in self._files.values():
            f.close()


def read_spill(directory: Path, name: str, dtype: str, start: int = 0, count: int = -1) -> np.ndarray:
    dtype = np.dtype(dtype)
    return np.fromfile(Path(directory) / f"{name}.bin", dtype=dtype, count=count, offset=start * dtype.itemsize)


@dataclass
class PartScan:
    """What the scan of one part found: small enough to travel back from a Dask worker."""

    part: Part
    sha256: str
    lines: int
    events: int
    spill: str
    dtypes: dict
    run_users: np.ndarray | pa.Array | None = None  # grouped formats: users of the runs
    run_lengths: np.ndarray | None = None
    user_codes: pa.Array | None = None  # recbole: the dictionary of the user codes spilled
    distinct: dict = field(default_factory=dict)  # table -> sorted distinct raw values
    codes: dict = field(default_factory=dict)  # text table -> dictionary of its spilled codes


def scan_part(fmt: Format, part: Part, spill_dir: str, hash_rows: dict[str, int], block_bytes: int) -> PartScan:
    """Read and parse one part; spill its events; collect the distinct values of every column."""
    reader = PartReader(part, block_bytes)
    collected = _Collector(fmt, hash_rows, Spill(Path(spill_dir)))
    first = True
    try:
        for block in reader.blocks():
            stop_if_asked()  # a stop whose exception a finalizer lost ends the scan at the next block
            if first:
                first = False
                block = _take_header(fmt, part, block)
                if block is None:
                    continue
            collected.add(fmt.parse(part.path, block))
    finally:
        collected.spill.close()
    if first:  # not even a header
        raise InputError(f"{part.path}: empty file; accepted: at least one interaction")
    if collected.events == 0:
        what = "a header but no interactions" if fmt.has_header and not fmt.body_starts_at_line_1 else "empty file"
        raise InputError(f"{part.path}: {what}; accepted: at least one interaction")
    return collected.scan(PartScan(part=part, sha256=reader.sha256, lines=reader.lines, events=collected.events,
                                   spill=spill_dir, dtypes=collected.spill.dtypes))


class _Collector:
    """What the scan of one part gathers block by block: the events spilled, each table's distinct values
    (numeric ids, hashed text, or text codes), the users' runs or codes."""

    def __init__(self, fmt: Format, hash_rows: dict[str, int], spill: Spill) -> None:
        self.hash_rows, self.spill, self.events = hash_rows, spill, 0
        self.numeric = {t: IntDistinct() for t in fmt.tables} if fmt.name in ("sasrec", "s3rec") else {}
        self.hashed = {t: TextDistinct() for t in fmt.tables if t in hash_rows}
        self.coded = {t: TextCodes() for t in fmt.tables if t not in hash_rows and t not in self.numeric}
        self.widths = dict(fmt.widths)
        self.users_numeric, self.user_codes = IntDistinct(), TextCodes()
        self.run_users, self.run_lengths = [], []

    def add(self, cols) -> None:
        self.events += cols.events
        for name, values in cols.tables.items():
            if name in self.numeric:
                self.numeric[name].add(values)
                self.spill.add(f"table.{name}", values)
            elif name in self.hashed:
                enc = pc.dictionary_encode(values)
                self.hashed[name].add(enc.dictionary)
                rows = (crc32_text(enc.dictionary) % np.uint32(self.hash_rows[name])).astype(np.int32)
                self.spill.add(f"table.{name}", rows[enc.indices.to_numpy()])
            elif name in self.widths:
                self.spill.add(f"code.{name}", padded_codes(self.coded[name], values, self.widths[name]))
            else:
                self.spill.add(f"code.{name}", self.coded[name].encode(values))
        for name, values in cols.dense.items():
            self.spill.add(f"dense.{name}", values)
        for name, values in (("labels", cols.labels), ("order", cols.order)):
            if values is not None:
                self.spill.add(name, values)
        if cols.run_users is not None:
            self.users_numeric.add(cols.run_users)
            self.run_users.append(cols.run_users)
            self.run_lengths.append(cols.run_lengths)
        if cols.event_users is not None:
            self.spill.add("users", self.user_codes.encode(cols.event_users))

    def scan(self, scan: PartScan) -> PartScan:
        """`scan` with what was collected."""
        if self.run_users:
            # Runs a block boundary cut in two join here.
            scan.run_users, scan.run_lengths = runs_of(np.concatenate(self.run_users),
                                                       np.concatenate(self.run_lengths))
            scan.distinct["users"] = self.users_numeric.values()
        if "users" in self.spill.dtypes:
            scan.user_codes = self.user_codes.dictionary
        for name, d in {**self.numeric, **self.hashed}.items():
            scan.distinct[name] = d.values()
        for name, c in self.coded.items():
            scan.codes[name] = c.dictionary
        return scan


def padded_codes(codes: TextCodes, lists: pa.ListArray, width: int) -> np.ndarray:
    """int32 [events, width]: the codes of each event's tokens, in order, then -1."""
    lengths = pc.fill_null(pc.list_value_length(lists), 0).to_numpy(zero_copy_only=False)
    event = np.repeat(np.arange(len(lists)), lengths)
    within = np.arange(lengths.sum()) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    out = np.full((len(lists), width), -1, dtype=np.int32)
    out[event, within] = codes.encode(pc.list_flatten(lists))
    return out


def _take_header(fmt: Format, part: Part, block: Block) -> Block | None:
    """The first block of a part without its header line (formats that have one)."""
    sniff_delimiter(fmt, block.data[: block.data.find(b"\n")])
    if not fmt.has_header:
        return block
    line, _, rest = block.data.partition(b"\n")
    fmt.header(part.path, line)
    if fmt.body_starts_at_line_1:
        return block
    if not rest:
        return None
    return Block(rest, block.first_line + 1)
