"""The dataset store: users' time-ordered event sequences, held ragged.

Layout of a dataset directory (zarr v3):

    offsets             int64 [users + 1]    user u owns events offsets[u]:offsets[u+1]
    tables/<name>       int32|int64 [events] one id per event for every embedding table;
                                             the sequence table holds the item sequence,
                                             the others are categorical feature columns
    raw_ids/<name>      [distinct raw]       every source value seen in the table's column,
    raw_rows/<name>     int64 [distinct raw] and the row it became
    dense/<name>        float32 [events]     optional numeric columns (NaN = missing)
    labels              float32 [events]     optional click labels
    manifest.json                            written last; without it this is no dataset
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import zarr
from zarr.codecs import BloscCodec

from shardflow.errors import InputError
from shardflow.tables import TableSpec, parse_table_name
from storage.checksum import ArrayHash, combine
from storage.manifest import read_manifest, write_manifest

KIND = "dataset"
FORMAT_VERSION = 1
MADE_BY = "'shardflow import' or 'shardflow synth'"
EVENTS_PER_CHUNK = 1 << 22
OFFSETS_PER_CHUNK = 1 << 20
# Fastest compressed read among zstd / blosc-lz4 / blosc-zstd on Zipf ids (see README, profiling).
COMPRESSORS = [BloscCodec(cname="zstd", clevel=1, shuffle="shuffle")]


@dataclass(frozen=True)
class DatasetInfo:
    users: int
    interactions: int
    tables: tuple[TableSpec, ...]
    sequence_table: str | None
    dense: tuple[str, ...] = ()
    labels: bool = False
    source: dict = field(default_factory=dict)
    checksum: str = ""

    def table(self, name: str) -> TableSpec:
        for t in self.tables:
            if t.name == name:
                return t
        raise InputError(f"no table {name!r} in this dataset; accepted: {', '.join(self.table_names)}")

    @property
    def table_names(self) -> list[str]:
        return [t.name for t in self.tables]

    @property
    def feature_tables(self) -> tuple[str, ...]:
        """Every table other than the item sequence: the model's categorical features."""
        return tuple(t for t in self.table_names if t != self.sequence_table)


class DatasetWriter:
    """Writes a dataset into a staging directory, column block by column block.

    Each column is written front to back; its content hash is fed as it goes. `finish`
    checks that every column was written completely and publishes the manifest.
    """

    def __init__(
        self,
        stage: Path,
        *,
        users: int,
        interactions: int,
        tables: list[TableSpec],
        sequence_table: str | None,
        dense: list[str] = (),
        labels: bool = False,
        events_per_chunk: int = EVENTS_PER_CHUNK,
    ) -> None:
        if interactions < 1 or users < 1:
            raise InputError(
                f"empty dataset: {users} users, {interactions} interactions; accepted: at least one of each"
            )
        names = [t.name for t in tables] + [parse_table_name(d) for d in dense]
        if len(set(names)) != len(names):
            raise InputError(f"column names repeat: {names}; accepted: unique names")
        if sequence_table is not None and sequence_table not in {t.name for t in tables}:
            raise InputError(f"sequence table {sequence_table!r} is not one of the tables {names}")
        self.stage = Path(stage)
        self.info = DatasetInfo(
            users=int(users),
            interactions=int(interactions),
            tables=tuple(tables),
            sequence_table=sequence_table,
            dense=tuple(dense),
            labels=labels,
        )
        self._root = zarr.open_group(str(self.stage), mode="w")
        self._columns: dict[str, tuple[zarr.Array, ArrayHash]] = {}
        self._written: dict[str, int] = {}
        self._add("offsets", np.int64, users + 1, OFFSETS_PER_CHUNK)
        for t in tables:
            self._add(f"tables/{t.name}", t.id_dtype, interactions, events_per_chunk)
        for d in dense:
            self._add(f"dense/{d}", np.float32, interactions, events_per_chunk)
        if labels:
            self._add("labels", np.float32, interactions, events_per_chunk)

    def _add(self, path: str, dtype, length: int, chunk: int) -> None:
        arr = self._root.create_array(
            path, shape=(length,), dtype=dtype, chunks=(min(chunk, length),), compressors=COMPRESSORS
        )
        self._columns[path] = (arr, ArrayHash(path, arr.dtype, arr.shape))
        self._written[path] = 0

    def write(self, path: str, block: np.ndarray) -> None:
        """Append `block` to column `path` (e.g. 'tables/item', 'offsets', 'labels')."""
        arr, h = self._columns[path]
        start = self._written[path]
        stop = start + len(block)
        if stop > arr.shape[0]:
            raise InputError(f"{path}: {stop} values written; the dataset declares {arr.shape[0]}")
        block = np.asarray(block).astype(arr.dtype, copy=False)
        arr[start:stop] = block
        h.update(block)
        self._written[path] = stop

    def write_raw_ids(self, table: str, raw: np.ndarray, rows: np.ndarray) -> None:
        """Store the id mapping of `table`: source value raw[i] became row rows[i].

        Re-indexed tables map one raw value to one row; hashed tables may map several
        raw values to one row.
        """
        raw = np.asarray(raw)
        is_text = raw.dtype.kind in "USOT"
        for path, values, dtype in (
            (f"raw_ids/{table}", raw, str if is_text else np.int64),
            (f"raw_rows/{table}", np.asarray(rows), np.int64),
        ):
            arr = self._root.create_array(
                path, shape=(len(values),), dtype=dtype, chunks=(max(1, min(len(values), 1 << 20)),)
            )
            values = values.astype(str if is_text and dtype is str else np.int64)
            arr[:] = values
            h = ArrayHash(path, arr.dtype, arr.shape)
            h.update(values)
            self._columns[path] = (arr, h)
            self._written[path] = len(values)

    def finish(self, source: dict) -> dict:
        for path, (arr, _) in self._columns.items():
            if self._written[path] != arr.shape[0]:
                raise RuntimeError(f"internal error: {path} has {self._written[path]} of {arr.shape[0]} values")
        info = self.info
        manifest = {
            "format": f"shardflow.{KIND}",
            "format_version": FORMAT_VERSION,
            "users": info.users,
            "interactions": info.interactions,
            "sequence_table": info.sequence_table,
            "tables": {t.name: {"rows": t.rows, "dtype": str(t.id_dtype)} for t in info.tables},
            "dense": list(info.dense),
            "labels": info.labels,
            "source": source,
            "checksum": combine({p: h.hexdigest() for p, (_, h) in self._columns.items()}),
        }
        write_manifest(self.stage, manifest)
        return manifest


class Dataset:
    """A complete dataset store, validated when opened."""

    def __init__(self, path: Path, info: DatasetInfo, root: zarr.Group) -> None:
        self.path = Path(path)
        self.info = info
        self._root = root

    @classmethod
    def open(cls, path: str | Path) -> "Dataset":
        path = Path(path)
        m = read_manifest(path, KIND, FORMAT_VERSION, MADE_BY)
        where = path / "manifest.json"
        try:
            tables = tuple(TableSpec(name, spec["rows"]) for name, spec in m["tables"].items())
            info = DatasetInfo(
                users=_count(m["users"], "users", where),
                interactions=_count(m["interactions"], "interactions", where),
                tables=tables,
                sequence_table=m["sequence_table"],
                dense=tuple(m["dense"]),
                labels=bool(m["labels"]),
                source=m["source"],
                checksum=m["checksum"],
            )
        except (KeyError, TypeError, AttributeError) as e:
            raise InputError(f"{where}: malformed manifest ({type(e).__name__}: {e})") from None
        if not tables:
            raise InputError(f"{where}: the dataset has no tables; accepted: at least one table")
        if info.users < 1 or info.interactions < 1:
            raise InputError(
                f"{where}: empty dataset ({info.users} users, {info.interactions} interactions); "
                "accepted: at least one user with at least one interaction"
            )
        root = zarr.open_group(str(path), mode="r")
        ds = cls(path, info, root)
        ds._validate()
        return ds

    def _array(self, name: str, kind: str, length: int) -> zarr.Array:
        try:
            arr = self._root[name]
        except KeyError:
            raise InputError(f"{self.path}: array {name!r} is missing; the manifest lists it") from None
        if not isinstance(arr, zarr.Array) or arr.ndim != 1:
            raise InputError(f"{self.path}/{name}: not a 1-d array; accepted: a 1-d array of {length} values")
        if np.dtype(arr.dtype).kind not in kind:
            accepted = {"iu": "an integer dtype", "f": "a float dtype", "i": "a signed integer dtype"}[kind]
            raise InputError(f"{self.path}/{name}: dtype {arr.dtype}; accepted: {accepted}")
        if arr.shape[0] != length:
            raise InputError(f"{self.path}/{name}: {arr.shape[0]} values; the manifest says {length}")
        return arr

    def _validate(self) -> None:
        info = self.info
        self._array("offsets", "i", info.users + 1)
        for t in info.tables:
            self._array(f"tables/{t.name}", "iu", info.interactions)
        for d in info.dense:
            self._array(f"dense/{d}", "f", info.interactions)
        if info.labels:
            self._array("labels", "f", info.interactions)
        off = self.offsets()
        if off[0] != 0 or off[-1] != info.interactions:
            raise InputError(
                f"{self.path}/offsets: runs from {int(off[0])} to {int(off[-1])}; "
                f"accepted: from 0 to {info.interactions} (the number of interactions)"
            )
        steps = np.diff(off)
        if (steps < 0).any():
            bad = int(np.flatnonzero(steps < 0)[0])
            raise InputError(
                f"{self.path}/offsets[{bad + 1}] = {int(off[bad + 1])} is below offsets[{bad}] = {int(off[bad])}; "
                "accepted: non-decreasing offsets"
            )

    def offsets(self) -> np.ndarray:
        return self._root["offsets"][:]

    def column(self, path: str, start: int = 0, stop: int | None = None) -> np.ndarray:
        return self._root[path][start : self.info.interactions if stop is None else stop]

    def ids(self, table: str, start: int = 0, stop: int | None = None) -> np.ndarray:
        self.info.table(table)
        return self.column(f"tables/{table}", start, stop)

    def raw_ids(self, table: str) -> tuple[np.ndarray, np.ndarray]:
        """(source values, the rows they became) of `table`."""
        return self._root[f"raw_ids/{table}"][:], self._root[f"raw_rows/{table}"][:]

    def chunk_events(self, table: str) -> int:
        return int(self._root[f"tables/{table}"].chunks[0])

    def blocks(self, table: str, parts: int) -> list[tuple[int, int]]:
        """Split the events into at most `parts` contiguous, chunk-aligned ranges of near-equal size."""
        n, chunk = self.info.interactions, self.chunk_events(table)
        chunks = -(-n // chunk)
        bounds = np.linspace(0, chunks, min(parts, chunks) + 1).round().astype(np.int64) * chunk
        bounds = np.unique(np.minimum(bounds, n))
        return [(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]


def _count(value, name: str, where: Path) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InputError(f"{where}: {name} = {value!r}; accepted: an integer >= 0")
    return value


def open_ids(path: str | Path, table: str) -> zarr.Array:
    """The id column of one table of a dataset already validated by `Dataset.open`."""
    return zarr.open_array(str(Path(path) / "tables" / table), mode="r")
