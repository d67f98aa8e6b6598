"""Writing a dataset store (storage.dataset describes its layout): an empty store, one segment column block by
column block (`SegmentWriter`), and the manifest that makes the segments a dataset (`build_manifest`).
Importers (storage.importers) and the synthetic generator (shardflow.data.synthetic) write through it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import zarr

from shardflow.errors import InputError
from storage.checksum import ArrayHash
from storage.dataset import COMPRESSORS, EVENTS_PER_CHUNK, OFFSETS_PER_CHUNK
from storage.dataset_manifest import FORMAT_VERSION, KIND, SEGMENTS, dataset_checksum
from storage.tables import parse_table_name

WRITE_VALUES = 1 << 14  # values of an event column gathered before they are stored


def segment_name(index: int) -> str:
    return f"{index:04d}"


def start_store(stage: Path) -> Path:
    """An empty dataset store (its root and segments groups); segments are written into the result."""
    zarr.open_group(str(stage), mode="w").create_group(SEGMENTS)
    return Path(stage) / SEGMENTS


class SegmentWriter:
    """Writes one segment into `directory`, column block by column block.

    Event columns are written front to back and hashed as they go; the small arrays
    (users, offsets, raw ids) are written whole. `finish` checks that every column was
    written completely and returns the segment's entry for the manifest.
    """

    def __init__(
        self,
        directory: Path,
        *,
        events: int,
        runs: int,
        tables: dict[str, np.dtype],
        dense: tuple[str, ...] = (),
        labels: bool = False,
        events_per_chunk: int = EVENTS_PER_CHUNK,
        widths: dict[str, int] | None = None,
    ) -> None:
        self.directory = Path(directory)
        self.events, self.runs = int(events), int(runs)
        self._root = zarr.open_group(str(self.directory), mode="w")
        self._columns: dict[str, tuple[zarr.Array, ArrayHash]] = {}
        self._written: dict[str, int] = {}  # values given to write()
        self._stored: dict[str, int] = {}  # of those, values in the store; the rest wait in _pending
        self._pending: dict[str, list[np.ndarray]] = {}
        self.new_users = 0
        for name, dtype in tables.items():
            self._add(f"tables/{name}", dtype, self.events, events_per_chunk, (widths or {}).get(name))
        for d in dense:
            self._add(f"dense/{d}", np.float32, self.events, events_per_chunk)
        if labels:
            self._add("labels", np.float32, self.events, events_per_chunk)

    def _add(self, path: str, dtype, length: int, chunk: int, width: int | None = None) -> zarr.Array:
        """An event column: [length], or [length, width] for a table of up to `width` ids per event."""
        within = () if width is None else (width,)
        arr = self._root.create_array(path, shape=(length, *within), dtype=dtype,
                                      chunks=(max(1, min(chunk, length)), *within), compressors=COMPRESSORS)
        self._columns[path] = (arr, ArrayHash(path, arr.dtype, arr.shape))
        self._written[path] = 0
        return arr

    def write(self, path: str, block: np.ndarray) -> None:
        """Append `block` to event column `path` ('tables/item', 'dense/rating', 'labels').

        Blocks are stored WRITE_VALUES values at a time or more: each store call has a fixed cost, which
        short blocks (a store of short chunks) would pay once a chunk."""
        arr, h = self._columns[path]
        stop = self._written[path] + len(block)
        if stop > arr.shape[0]:
            raise RuntimeError(f"internal error: {path}: {stop} values written; the segment declares {arr.shape[0]}")
        block = np.asarray(block).astype(arr.dtype, copy=False)
        h.update(block)
        # A short block waits for the next: a copy, as the caller may refill its buffer. One that is long
        # enough is stored before this returns.
        self._pending.setdefault(path, []).append(block if len(block) >= WRITE_VALUES else block.copy())
        self._written[path] = stop
        if stop - self._stored.get(path, 0) >= WRITE_VALUES:
            self._store(path)

    def _store(self, path: str) -> None:
        blocks = self._pending.pop(path, [])
        if blocks:
            start = self._stored.get(path, 0)
            self._columns[path][0][start : self._written[path]] = np.concatenate(blocks)
            self._stored[path] = self._written[path]

    def write_runs(self, users: np.ndarray, offsets: np.ndarray) -> None:
        self._whole("users", np.asarray(users, dtype=np.int64), OFFSETS_PER_CHUNK)
        self._whole("offsets", np.asarray(offsets, dtype=np.int64), OFFSETS_PER_CHUNK)

    def write_own_users(self, first: int) -> None:
        """Every event its own user (a click log), numbered from `first`: one run per event, and the user's
        raw id is its number. The users, offsets and user ids are written a chunk at a time, as the
        arrays `write_runs` and `write_user_ids` would write, without holding one of the part's length."""
        self.new_users = self.events
        self._counting("users", first, self.events, OFFSETS_PER_CHUNK)
        self._counting("offsets", 0, self.events + 1, OFFSETS_PER_CHUNK)
        self._counting("user_ids", first, self.events, 1 << 20)

    def _counting(self, path: str, first: int, length: int, chunk: int) -> None:
        """Array `path` holding first, first + 1, ..., first + length - 1, appended a chunk at a time."""
        self._add(path, np.int64, length, chunk)
        for a in range(0, length, chunk):
            self.write(path, np.arange(first + a, first + min(a + chunk, length), dtype=np.int64))

    def write_user_ids(self, raw: np.ndarray) -> None:
        """Raw ids of the users this segment introduced, in the order of their indices."""
        self.new_users = len(raw)
        self._whole("user_ids", raw, 1 << 20)

    def write_raw_ids(self, table: str, raw: np.ndarray, rows: np.ndarray) -> None:
        """The id mapping this segment adds to `table`: source value raw[i] became row rows[i].

        Re-indexed tables map one raw value to one row; hashed tables may map several raw
        values to one row.
        """
        self._whole(f"raw_ids/{table}", raw, 1 << 20)
        self._whole(f"raw_rows/{table}", np.asarray(rows, dtype=np.int64), 1 << 20)

    def _whole(self, path: str, values: np.ndarray, chunk: int) -> None:
        values = np.asarray(values)
        if values.dtype.kind in "USOT":
            values, dtype = values.astype(str), str
        else:
            values, dtype = values.astype(np.int64, copy=False), np.int64
        arr = self._root.create_array(
            path, shape=(len(values),), dtype=dtype, chunks=(max(1, min(len(values), chunk)),),
            compressors=COMPRESSORS if dtype is not str else "auto",
        )
        if len(values):
            arr[:] = values
        h = ArrayHash(path, arr.dtype, arr.shape)
        h.update(values)
        self._columns[path] = (arr, h)
        self._written[path] = len(values)

    def finish(self, name: str, version: int) -> dict:
        for path in list(self._pending):
            self._store(path)
        for path, (arr, _) in self._columns.items():
            if self._written[path] != arr.shape[0]:
                raise RuntimeError(f"internal error: {path} has {self._written[path]} of {arr.shape[0]} values")
        for required in ("users", "offsets", "user_ids"):
            if required not in self._columns:
                raise RuntimeError(f"internal error: segment {name} was finished without {required!r}")
        return {
            "name": name,
            "version": version,
            "events": self.events,
            "runs": self.runs,
            "new_users": self.new_users,
            "arrays": {p: h.hexdigest() for p, (_, h) in sorted(self._columns.items())},
        }


def build_manifest(
    *,
    version: int,
    users: int,
    tables: dict[str, dict],
    sequence_table: str | None,
    dense: tuple[str, ...],
    labels: bool,
    source: dict,
    segments: list[dict],
) -> dict:
    interactions = sum(s["events"] for s in segments)
    if interactions < 1 or users < 1:
        raise InputError(f"empty dataset: {users} users, {interactions} interactions; accepted: at least one of each")
    names = list(tables) + [parse_table_name(d) for d in dense]
    if len(set(names)) != len(names):
        raise InputError(f"column names repeat: {names}; accepted: unique names")
    if sequence_table is not None and sequence_table not in tables:
        raise InputError(f"sequence table {sequence_table!r} is not one of the tables {names}")
    manifest = {
        "format": f"shardflow.{KIND}",
        "format_version": FORMAT_VERSION,
        "version": version,
        "users": users,
        "interactions": interactions,
        "sequence_table": sequence_table,
        "tables": tables,
        "dense": list(dense),
        "labels": labels,
        "source": source,
        "segments": segments,
    }
    manifest["checksum"] = dataset_checksum(segments, manifest)
    return manifest
