"""The dataset store: users' time-ordered event sequences, grown one part at a time.

Every part a store was given (one source file: a day's log, say) is one immutable
segment. A segment holds *runs*: consecutive events of one user, in the part's order.
User u's sequence is the concatenation of u's runs, segment by segment, run by run;
`Dataset` reads the store in that order (user 0's events, then user 1's, ...), so a
reader never sees segments unless it asks for them.

Layout of a dataset directory (zarr v3):

    segments/NNNN/                       one per part, NNNN = 0000, 0001, ... in import order
        users         int64 [runs]       the user of each run
        offsets       int64 [runs + 1]   run r holds the segment's events offsets[r]:offsets[r+1]
        tables/<name> int32|int64 [events]  one id per event for every embedding table; the
                                         sequence table holds the item sequence, the others
                                         are categorical feature columns; a table the manifest
                                         gives a width k (token sequences: genres) is
                                         [events, k], up to k ids per event, -1 padding
        dense/<name>  float32 [events]   optional numeric columns (NaN = missing)
        labels        float32 [events]   optional click labels
        user_ids      [new users]        raw ids of the users this part introduced; user
                                         indices follow those of earlier parts
        raw_ids/<name>   [new values]    source values this part introduced in the table,
        raw_rows/<name>  int64           and the row each became (rows follow earlier parts')
    manifest.json                        written last: the version, the parts (name, sha256,
                                         size) and the segments with every array's content
                                         digest; without it this is no dataset

An append writes new segments beside the old ones and then replaces the manifest: the
arrays of an earlier version are never rewritten. This module reads and verifies a store
against its manifest's records (storage.dataset_manifest); storage.dataset_writer writes one.
"""

from __future__ import annotations

import hashlib
import json
from itertools import pairwise
from pathlib import Path

import numpy as np
import zarr
from zarr.codecs import BloscCodec

from shardflow.errors import DamagedStore, InputError, first_line
from shardflow.records import parse_record
from storage.checksum import ArrayHash
from storage.dataset_manifest import (
    FORMAT_VERSION,
    KIND,
    MADE_BY,
    SEGMENTS,
    VERIFIED,
    DatasetInfo,
    Segment,
    dataset_checksum,
    record_verified,
)
from storage.manifest import MANIFEST, read_manifest
from storage.tables import TableSpec

EVENTS_PER_CHUNK = 1 << 22
OFFSETS_PER_CHUNK = 1 << 20
# Fastest compressed read among zstd / blosc-lz4 / blosc-zstd on Zipf ids (docs/benchmarks.md, profiling).
COMPRESSORS = [BloscCodec(cname="zstd", clevel=1, shuffle="shuffle")]


class SegmentRuns:
    """Where one segment's runs lie in user order: run r's events, stored at offsets[r]:offsets[r+1],
    are events starts[r]... of the user-ordered view. Runs are disjoint there, so sorted by start
    the runs a range covers are one slice."""

    def __init__(self, starts: np.ndarray, offsets: np.ndarray) -> None:
        self.offsets, self.lengths = offsets, np.diff(offsets)
        self.order = np.argsort(starts, kind="stable")
        self.starts = starts[self.order]
        self.ends = self.starts + self.lengths[self.order]

    def between(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """(user-order position, stored position) of this segment's events in user-order range start:stop."""
        lo, hi = np.searchsorted(self.ends, start, side="right"), np.searchsorted(self.starts, stop, side="left")
        runs = self.order[lo:hi]
        lengths = self.lengths[runs]
        within = np.arange(int(lengths.sum()), dtype=np.int64) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        logical = np.repeat(self.starts[lo:hi], lengths) + within
        stored = np.repeat(self.offsets[runs], lengths) + within
        keep = (logical >= start) & (logical < stop)
        return logical[keep], stored[keep]


class Dataset:
    """A complete dataset store, validated when opened; read in user order."""

    def __init__(self, path: Path, info: DatasetInfo, root: zarr.Group, segments: tuple[Segment, ...]) -> None:
        self.path = Path(path)
        self.info = info
        self._root = root
        self.segments = segments
        self._layout: tuple[np.ndarray, list[SegmentRuns] | None] | None = None

    @classmethod
    def open(cls, path: str | Path, hashed: bool = True) -> Dataset:
        """The store at `path`, its manifest checked; with `hashed`, its arrays too unless verified.json says
        they were since this manifest was written (`verify`)."""
        path = Path(path)
        m = read_manifest(path, KIND, FORMAT_VERSION, MADE_BY)
        where = path / "manifest.json"
        try:
            tables = tuple(TableSpec(name, spec["rows"]) for name, spec in m["tables"].items())
            widths = {name: _count(spec["width"], f"tables.{name}.width", where) for name, spec in m["tables"].items()
                      if "width" in spec}
            info = DatasetInfo(
                users=_count(m["users"], "users", where),
                interactions=_count(m["interactions"], "interactions", where),
                tables=tables,
                sequence_table=m["sequence_table"],
                dense=tuple(m["dense"]),
                labels=bool(m["labels"]),
                source=m["source"],
                checksum=m["checksum"],
                version=_count(m["version"], "version", where),
                widths=widths,
            )
            segments = tuple(parse_record(Segment, s, f"{where} segments[{i}]") for i, s in enumerate(m["segments"]))
            for s in segments:
                _count(s.events, "events", where)
                _count(s.runs, "runs", where)
        except (KeyError, TypeError, AttributeError) as e:
            raise InputError(f"{where}: malformed manifest ({type(e).__name__}: {e})") from None
        if not tables:
            raise InputError(f"{where}: the dataset has no tables; accepted: at least one table")
        if any(w < 1 for w in widths.values()):
            raise InputError(f"{where}: table widths {widths}; accepted: widths >= 1")
        if info.users < 1 or info.interactions < 1:
            raise InputError(
                f"{where}: empty dataset ({info.users} users, {info.interactions} interactions); "
                "accepted: at least one user with at least one interaction"
            )
        if not segments or sum(s.events for s in segments) != info.interactions:
            raise InputError(
                f"{where}: the segments hold {sum(s.events for s in segments)} events; "
                f"the manifest says {info.interactions}"
            )
        root = zarr.open_group(str(path), mode="r")
        ds = cls(path, info, root, segments)
        for s in segments:
            ds._validate_segment(s)
        try:
            matches = dataset_checksum(m["segments"], m) == m["checksum"]
        except (KeyError, TypeError) as e:
            raise InputError(f"{where}: malformed manifest ({type(e).__name__}: {e})") from None
        if not matches:
            raise InputError(
                f"{where}: its checksum does not match what it declares (an edited manifest?); accepted: the "
                f"manifest as {MADE_BY} wrote it (import the data again)"
            )
        if hashed:
            ds.verify(always=False)
        return ds

    def verify(self, always: bool = True) -> None:
        """Hash every array against its digest (a DamagedStore naming the first that differs or cannot be read).

        The writer records that it hashed what it wrote (verified.json, keyed by the
        manifest's sha256). Opening a store (`always` false) re-hashes it only when its
        manifest changed behind its writer's back or the record is gone; a run verifies
        every array of what it trains on, always (shardflow/importing.py: bring_in), since
        a chunk changed in place leaves the manifest and the record as they were.
        """
        digest = hashlib.sha256((self.path / MANIFEST).read_bytes()).hexdigest()
        if not always:
            try:
                if json.loads((self.path / VERIFIED).read_text()).get("manifest_sha256") == digest:
                    return
            except (OSError, ValueError, AttributeError):
                pass
        for k, s in enumerate(self.segments):
            for name, expected in s.arrays.items():
                where = f"{self.path}/{SEGMENTS}/{s.name}/{name}"
                arr = self._root[f"{SEGMENTS}/{s.name}/{name}"]
                h = ArrayHash(name, arr.dtype, arr.shape)
                step = max(1, int(arr.chunks[0]))
                try:
                    for a in range(0, arr.shape[0], step):
                        h.update(arr[a : a + step])
                except (RuntimeError, ValueError, OSError) as e:
                    raise DamagedStore(f"{where}: unreadable ({first_line(e)}); accepted: the store as {MADE_BY} "
                                       "wrote it", where, k) from None
                if h.hexdigest() != expected:
                    raise DamagedStore(f"{where}: its content does not match the manifest's digest (changed after it "
                                       f"was written); accepted: the store as {MADE_BY} wrote it", where, k)
        try:
            record_verified(self.path)
        except OSError:  # a read-only store: verified again next time
            pass

    def _array(self, name: str, kind: str, length: int, width: int | None = None) -> zarr.Array:
        try:
            arr = self._root[name]
        except KeyError:
            raise InputError(f"{self.path}: array {name!r} is missing; the manifest lists it") from None
        shape = (length,) if width is None else (length, width)
        if not isinstance(arr, zarr.Array) or arr.shape[1:] != shape[1:]:
            raise InputError(f"{self.path}/{name}: not an array of shape {list(shape)}; accepted: that shape, as "
                             "the manifest declares")
        if np.dtype(arr.dtype).kind not in kind:
            accepted = {"iu": "an integer dtype", "f": "a float dtype", "i": "a signed integer dtype"}[kind]
            raise InputError(f"{self.path}/{name}: dtype {arr.dtype}; accepted: {accepted}")
        if arr.shape[0] != length:
            raise InputError(f"{self.path}/{name}: {arr.shape[0]} values; the manifest says {length}")
        return arr

    def _validate_segment(self, segment: Segment) -> None:
        info, seg, events, runs = self.info, f"{SEGMENTS}/{segment.name}", segment.events, segment.runs
        for t in info.tables:
            width = info.widths.get(t.name)  # token sequences pad with -1: a signed dtype
            self._array(f"{seg}/tables/{t.name}", "iu" if width is None else "i", events, width)
        for d in info.dense:
            self._array(f"{seg}/dense/{d}", "f", events)
        if info.labels:
            self._array(f"{seg}/labels", "f", events)
        users_arr = self._array(f"{seg}/users", "i", runs)
        off_arr = self._array(f"{seg}/offsets", "i", runs + 1)
        first, last = int(off_arr[0]), int(off_arr[runs])
        if first != 0 or last != events:
            raise InputError(
                f"{self.path}/{seg}/offsets: runs from {first} to {last}; "
                f"accepted: from 0 to {events} (the segment's events)"
            )
        # A chunk at a time (with the last offset of the chunk before): a 10^8-user segment is
        # checked in the memory of one chunk, not of its whole offsets and users.
        for a in range(0, runs, OFFSETS_PER_CHUNK):
            b = min(a + OFFSETS_PER_CHUNK, runs)
            off = off_arr[a : b + 1]
            steps = np.diff(off)
            if (steps < 0).any():
                bad = int(np.flatnonzero(steps < 0)[0])
                raise InputError(
                    f"{self.path}/{seg}/offsets[{a + bad + 1}] = {int(off[bad + 1])} is below offsets[{a + bad}] = "
                    f"{int(off[bad])}; accepted: non-decreasing offsets"
                )
            users = users_arr[a:b]
            if users.size and (users.min() < 0 or users.max() >= info.users):
                bad = int(np.flatnonzero((users < 0) | (users >= info.users))[0])
                raise InputError(
                    f"{self.path}/{seg}/users[{a + bad}] = {int(users[bad])}; accepted: 0 <= user < {info.users}"
                )

    # -- the user-ordered view -------------------------------------------------------------

    def _runs(self) -> tuple[np.ndarray, list[SegmentRuns] | None]:
        """(offsets over users, per segment where its runs lie in user order).

        The second is None when the store is already in user order (one segment whose runs
        are users 0, 1, 2, ...): then every column is read as stored.
        """
        if self._layout is not None:
            return self._layout
        if len(self.segments) == 1 and self._in_user_order(self.segments[0]):
            # a run per user, in user order: the segment's offsets are the users' (no other temporary)
            stored = self._root[f"{SEGMENTS}/{self.segments[0].name}/offsets"]
            offsets = np.empty(stored.shape[0], dtype=np.int64)
            for a in range(0, offsets.size, OFFSETS_PER_CHUNK):  # into one array: no whole-array temporary
                offsets[a : a + OFFSETS_PER_CHUNK] = stored[a : a + OFFSETS_PER_CHUNK]
            self._layout = (offsets, None)
            return self._layout
        users = [self._root[f"{SEGMENTS}/{s.name}/users"][:] for s in self.segments]
        offsets = [self._root[f"{SEGMENTS}/{s.name}/offsets"][:] for s in self.segments]
        lengths = [np.diff(o) for o in offsets]
        all_users, all_lengths = np.concatenate(users), np.concatenate(lengths)
        per_user = np.bincount(all_users, weights=all_lengths, minlength=self.info.users).astype(np.int64)
        user_offsets = np.concatenate([[0], np.cumsum(per_user)])
        # Runs in user order (stable: a user's runs keep their segment and part order); the
        # logical start of each is the sum of the lengths before it in that order.
        order = np.argsort(all_users, kind="stable")
        starts = np.empty_like(all_lengths)
        starts[order] = np.concatenate([[0], np.cumsum(all_lengths[order])[:-1]])
        bounds = np.cumsum([0] + [len(u) for u in users])
        self._layout = (user_offsets, [SegmentRuns(starts[a:b], off) for (a, b), off in
                                       zip(pairwise(bounds), offsets, strict=True)])
        return self._layout

    def _in_user_order(self, segment: Segment) -> bool:
        """Whether a segment's runs are users 0, 1, 2, ... (checked a chunk at a time)."""
        if segment.runs != self.info.users:
            return False
        users = self._root[f"{SEGMENTS}/{segment.name}/users"]
        step = OFFSETS_PER_CHUNK
        return all(np.array_equal(users[a : a + step], np.arange(a, min(a + step, users.shape[0])))
                   for a in range(0, users.shape[0], step))

    def offsets(self) -> np.ndarray:
        """int64 [users + 1]: user u owns events offsets[u]:offsets[u+1] of every column."""
        return self._runs()[0]

    def _span(self, start: int, stop: int | None) -> tuple[int, int]:
        stop = self.info.interactions if stop is None else min(stop, self.info.interactions)
        return max(0, start), max(max(0, start), stop)

    def column(self, path: str, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Events start:stop of column `path` ('tables/item', 'dense/rating', 'labels'), in user order.

        Reads only the stored events of the users' runs that the range covers, so a block
        of a log far larger than memory costs the block, not the log.
        """
        start, stop = self._span(start, stop)
        _, segments = self._runs()
        if segments is None:
            return self._root[f"{SEGMENTS}/{self.segments[0].name}/{path}"][start:stop]
        arrays = [self._root[f"{SEGMENTS}/{s.name}/{path}"] for s in self.segments]
        out = np.empty((stop - start, *arrays[0].shape[1:]), dtype=np.result_type(*(a.dtype for a in arrays)))
        for runs, arr in zip(segments, arrays, strict=True):
            logical, stored = runs.between(start, stop)
            if stored.size:
                lo = int(stored.min())
                out[logical - start] = arr[lo : int(stored.max()) + 1][stored - lo]
        return out

    def stored_column(self, path: str, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Events start:stop of column `path` in stored order, segment after segment (parts in import order).

        A click log's order: the criteo importer makes every row its own user, numbered as the rows
        arrive, so this equals `column` there, read without the user-ordered view (whose per-user
        offsets cost 8 bytes a row)."""
        start, stop = self._span(start, stop)
        parts, at = [], 0
        for s in self.segments:
            lo, hi = max(start - at, 0), min(stop - at, s.events)
            if hi > lo:
                parts.append(self._root[f"{SEGMENTS}/{s.name}/{path}"][lo:hi])
            at += s.events
        if not parts:
            return self._root[f"{SEGMENTS}/{self.segments[0].name}/{path}"][0:0]
        return np.concatenate(parts)

    def event_segments(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        """int16 [stop - start], in user order: the segment (0 = the first part imported) each event came from."""
        start, stop = self._span(start, stop)
        _, segments = self._runs()
        out = np.zeros(stop - start, dtype=np.int16)
        for index, runs in enumerate(segments or ()):
            out[runs.between(start, stop)[0] - start] = index
        return out

    def users_in(self, first: int = 0) -> np.ndarray:
        """The users (ascending) with events in segments `first` on (every user from segment 0)."""
        if first <= 0:
            return np.arange(self.info.users, dtype=np.int64)
        return np.unique(np.concatenate([np.zeros(0, dtype=np.int64)] + [
            self._root[f"{SEGMENTS}/{s.name}/users"][:].astype(np.int64) for s in self.segments[first:]]))

    def dtype(self, path: str) -> np.dtype:
        """The type `column` and `stored_column` give for `path` (from the arrays' metadata, reading no chunk)."""
        return np.result_type(*(self._root[f"{SEGMENTS}/{s.name}/{path}"].dtype for s in self.segments))

    def event_bytes(self, path: str) -> int:
        """Bytes one event takes in `column`'s result for `path` (a table of token sequences: its width's ids)."""
        within = self._root[f"{SEGMENTS}/{self.segments[0].name}/{path}"].shape[1:]
        return self.dtype(path).itemsize * int(np.prod(within))

    def ids(self, table: str, start: int = 0, stop: int | None = None) -> np.ndarray:
        self.info.table(table)
        return self.column(f"tables/{table}", start, stop)

    def raw_ids(self, table: str) -> tuple[np.ndarray, np.ndarray]:
        """(source values, the rows they became) of `table`, the values of earlier parts first."""
        return self.segment_raw_ids(self.segments, table)

    def segment_raw_ids(self, segments: tuple[Segment, ...], table: str) -> tuple[np.ndarray, np.ndarray]:
        """(source values, the rows they became) that `segments` (of this store) introduced to `table`."""
        self.info.table(table)
        if not segments:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
        raw = [self._root[f"{SEGMENTS}/{s.name}/raw_ids/{table}"][:] for s in segments]
        rows = [self._root[f"{SEGMENTS}/{s.name}/raw_rows/{table}"][:] for s in segments]
        return np.concatenate(raw), np.concatenate(rows)

    def user_ids(self) -> np.ndarray:
        """The raw id of every user, by user index."""
        return self.segment_user_ids(self.segments)

    def segment_user_ids(self, segments: tuple[Segment, ...]) -> np.ndarray:
        """The raw ids of the users `segments` (of this store) introduced, by user index."""
        if not segments:
            return np.zeros(0, dtype=np.int64)
        return np.concatenate([self._root[f"{SEGMENTS}/{s.name}/user_ids"][:] for s in segments])

    # -- the stored order, for readers that do not care about users (profiling) -------------

    def blocks(self, table: str, parts: int, first: int = 0) -> list[tuple[str, int, int]]:
        """The stored events of `table` (of segments `first` on) in at most about `parts` chunk-aligned
        (array, start, stop) ranges.

        Every event lies in exactly one range; ranges never cross segments.
        """
        arrays = [(f"{SEGMENTS}/{s.name}/tables/{table}", s.events) for s in self.segments[first:]]
        chunks = [(path, n, int(self._root[path].chunks[0])) for path, n in arrays if n]
        total = sum(-(-n // c) for _, n, c in chunks)
        out = []
        for path, n, chunk in chunks:
            count = -(-n // chunk)
            share = max(1, round(parts * count / total))
            bounds = np.linspace(0, count, min(share, count) + 1).round().astype(np.int64) * chunk
            bounds = np.unique(np.minimum(bounds, n))
            out += [(path, int(a), int(b)) for a, b in pairwise(bounds)]
        return out


def _count(value, name: str, where: Path) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InputError(f"{where}: {name} = {value!r}; accepted: an integer >= 0")
    return value


def open_column(dataset: str | Path, array: str) -> zarr.Array:
    """One stored array (a path from `Dataset.blocks`) of a dataset already validated by `Dataset.open`."""
    return zarr.open_array(str(Path(dataset) / array), mode="r")
