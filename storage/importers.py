"""Importers for the published formats of recommendation data.

Each parser reads the whole source file, checks every line, and returns events
(user, time order, raw values per column) before anything is written; `import_dataset`
then re-indexes ids densely per table, groups events by user in time order and
writes a dataset store through a staging directory.

Formats (see data/README.md for the files they come from):
    sasrec   `user item` per line, a user's lines in time order (SASRec's data/*.txt)
    s3rec    `user i1 i2 ...`, one user per line in time order (S3-Rec / ICLRec)
    recbole  RecBole's atomic `.inter` file: tab-separated, typed header `name:type`
    criteo   Criteo display-ads CSV/TSV: label, I1..I13 integers, C1..C26 hashed categoricals
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from shardflow.errors import InputError
from shardflow.tables import TableSpec, parse_table_name
from storage.checksum import file_sha256
from storage.dataset import DatasetWriter
from storage.staging import check_destination, staged

DEFAULT_HASH_ROWS = 1 << 20
CRITEO_DENSE = [f"I{i}" for i in range(1, 14)]
CRITEO_SPARSE = [f"C{i}" for i in range(1, 27)]


@dataclass
class Column:
    """One table's events: raw values, or ids already hashed into a fixed number of rows."""

    raw: np.ndarray
    hash_rows: int | None = None


@dataclass
class Events:
    users: np.ndarray
    columns: dict[str, Column]
    sequence_table: str | None
    order: np.ndarray | None = None
    dense: dict[str, np.ndarray] = field(default_factory=dict)
    labels: np.ndarray | None = None


def _lines(src: Path) -> list[tuple[int, str]]:
    """(1-based line number, text) of every non-blank line."""
    try:
        text = src.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputError(f"{src}: not UTF-8 text (byte {e.start}); accepted: a UTF-8 text file") from None
    lines = [(i + 1, line) for i, line in enumerate(text.splitlines()) if line.strip()]
    if not lines:
        raise InputError(f"{src}: empty file; accepted: at least one interaction")
    return lines


def _ints(tokens: list[str], numbers: list[int], src: Path, what: str) -> np.ndarray:
    """Parse non-negative integer tokens, naming the line of the first one that is not."""
    try:
        values = np.array(tokens, dtype=np.int64)
    except (ValueError, OverflowError):
        values = None
    if values is None or (values < 0).any():
        for token, number in zip(tokens, numbers):
            if not token.isdigit() or int(token) > np.iinfo(np.int64).max:
                raise InputError(f"{src}:{number}: {what} {token!r} is not accepted; accepted: an integer >= 0")
    return values


def parse_sasrec(src: Path) -> Events:
    users, items, numbers = [], [], []
    for number, line in _lines(src):
        fields = line.split()
        if len(fields) != 2:
            raise InputError(f"{src}:{number}: {line.strip()!r} has {len(fields)} fields; accepted: 'user item'")
        users.append(fields[0])
        items.append(fields[1])
        numbers.append(number)
    return Events(
        users=_ints(users, numbers, src, "user"),
        columns={"item": Column(_ints(items, numbers, src, "item"))},
        sequence_table="item",
    )


def parse_s3rec(src: Path) -> Events:
    users, items, numbers = [], [], []
    for number, line in _lines(src):
        fields = line.split()
        if len(fields) < 2:
            raise InputError(f"{src}:{number}: {line.strip()!r} has no items; accepted: 'user item1 item2 ...'")
        users.extend([fields[0]] * (len(fields) - 1))
        items.extend(fields[1:])
        numbers.extend([number] * (len(fields) - 1))
    return Events(
        users=_ints(users, numbers, src, "user"),
        columns={"item": Column(_ints(items, numbers, src, "item"))},
        sequence_table="item",
    )


RECBOLE_TYPES = ("token", "float")


def parse_recbole(src: Path) -> Events:
    lines = _lines(src)
    header_number, header = lines[0]
    names, types = [], []
    for entry in header.rstrip("\n").split("\t"):
        name, sep, kind = entry.partition(":")
        if not sep or kind not in RECBOLE_TYPES:
            raise InputError(
                f"{src}:{header_number}: header field {entry!r}; accepted: 'name:type' with type one of "
                f"{', '.join(RECBOLE_TYPES)} (sequence types are not supported)"
            )
        names.append(name)
        types.append(kind)
    for required in ("user_id", "item_id"):
        if required not in names:
            raise InputError(f"{src}:{header_number}: no '{required}:token' field in the header {names}")
    rows = []
    for number, line in lines[1:]:
        fields = line.rstrip("\n").split("\t")
        if len(fields) != len(names):
            raise InputError(
                f"{src}:{number}: {len(fields)} tab-separated fields; accepted: {len(names)} as in the header"
            )
        rows.append(fields)
    if not rows:
        raise InputError(f"{src}: a header but no interactions; accepted: at least one interaction")
    cols = list(zip(*rows))
    numbers = [n for n, _ in lines[1:]]
    floats = {n: _floats(list(c), numbers, src, n) for n, k, c in zip(names, types, cols) if k == "float"}
    tokens = {n: np.array(c) for n, k, c in zip(names, types, cols) if k == "token"}
    columns = {"item": Column(tokens.pop("item_id"))}
    for name, values in tokens.items():
        if name != "user_id":
            columns[parse_table_name(name)] = Column(values)
    order = floats.pop("timestamp", None)
    return Events(
        users=tokens["user_id"],
        columns=columns,
        sequence_table="item",
        order=order,
        dense={name: v.astype(np.float32) for name, v in floats.items()},
    )


def _floats(tokens: list[str], numbers: list[int], src: Path, column: str) -> np.ndarray:
    """Parse float tokens ('' is missing: NaN); NaN and inf spelled out are refused."""
    out = np.empty(len(tokens), dtype=np.float64)
    for i, (token, number) in enumerate(zip(tokens, numbers)):
        if token == "":
            out[i] = np.nan
            continue
        try:
            out[i] = float(token)
        except ValueError:
            out[i] = np.nan
        if not math.isfinite(out[i]):
            raise InputError(f"{src}:{number}: {column} = {token!r}; accepted: a finite number or empty")
    return out


def parse_criteo(src: Path, *, table_rows: dict[str, int], hash_rows: int) -> Events:
    lines = _lines(src)
    first_number, first = lines[0]
    sep = "\t" if "\t" in first else ","
    fields = first.rstrip("\n").split(sep)
    if fields[0] == "label":
        names, body = fields, lines[1:]
    else:
        names, body = ["label", *CRITEO_DENSE, *CRITEO_SPARSE], lines
    unknown = [n for n in names if n != "label" and not (n[:1] in "IC" and n[1:].isdigit())]
    if unknown or "label" not in names:
        raise InputError(
            f"{src}:{first_number}: header columns {unknown or names}; accepted: 'label', 'I<n>' (integer) and "
            "'C<n>' (categorical) columns"
        )
    for name in table_rows:
        if name not in names or not name.startswith("C"):
            categorical = [n for n in names if n.startswith("C")]
            raise InputError(f"--table-rows {name}: no such categorical column; accepted: {', '.join(categorical)}")
    if not body:
        raise InputError(f"{src}: a header but no examples; accepted: at least one example")
    rows = []
    for number, line in body:
        values = line.rstrip("\n").split(sep)
        if len(values) != len(names):
            raise InputError(
                f"{src}:{number}: {len(values)} fields separated by {sep!r}; accepted: {len(names)} "
                f"({', '.join(names[:3])}, ...)"
            )
        rows.append(values)
    numbers = [n for n, _ in body]
    cols = dict(zip(names, zip(*rows)))
    labels = _floats(list(cols["label"]), numbers, src, "label")
    bad = np.flatnonzero(~np.isin(labels, (0.0, 1.0)))
    if bad.size:
        i = int(bad[0])
        raise InputError(f"{src}:{numbers[i]}: label {cols['label'][i]!r}; accepted: 0 or 1")
    return Events(
        users=np.arange(len(rows)),
        columns={
            n: Column(np.array(c), hash_rows=table_rows.get(n, hash_rows)) for n, c in cols.items() if n[0] == "C"
        },
        sequence_table=None,
        dense={n: _floats(list(c), numbers, src, n).astype(np.float32) for n, c in cols.items() if n[0] == "I"},
        labels=labels.astype(np.float32),
    )


FORMATS = ("sasrec", "s3rec", "recbole", "criteo")


def _reindex(column: Column) -> tuple[np.ndarray, int, np.ndarray, np.ndarray]:
    """(ids, rows, raw values, their rows): dense re-indexing, or a stable hash into fixed rows."""
    raw, ids = np.unique(column.raw, return_inverse=True)
    if column.hash_rows is None:
        return ids, len(raw), raw, np.arange(len(raw))
    buckets = np.array([zlib.crc32(str(v).encode()) % column.hash_rows for v in raw.tolist()], dtype=np.int64)
    return buckets[ids], column.hash_rows, raw, buckets


def import_dataset(
    fmt: str,
    src: str | Path,
    dest: str | Path,
    *,
    overwrite: bool = False,
    table_rows: dict[str, int] | None = None,
    hash_rows: int = DEFAULT_HASH_ROWS,
) -> dict:
    """Parse `src` in format `fmt` and write it as a dataset store at `dest`; returns the manifest."""
    src, dest = Path(src), Path(dest)
    if fmt not in FORMATS:
        raise InputError(f"format {fmt!r} is not known; accepted: {', '.join(FORMATS)}")
    if not src.is_file():
        raise InputError(f"{src}: no such file; accepted: a {fmt} file")
    table_rows = dict(table_rows or {})
    if fmt != "criteo" and (table_rows or hash_rows != DEFAULT_HASH_ROWS):
        raise InputError(f"table sizes are set only for hashed criteo columns, not for format {fmt!r}")
    for name, rows in [*table_rows.items(), ("--hash-rows", hash_rows)]:
        if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
            raise InputError(f"{name}: {rows!r} rows; accepted: an integer >= 1")
    check_destination(dest, overwrite=overwrite)

    if fmt == "criteo":
        events = parse_criteo(src, table_rows=table_rows, hash_rows=hash_rows)
    else:
        events = {"sasrec": parse_sasrec, "s3rec": parse_s3rec, "recbole": parse_recbole}[fmt](src)

    user_raw, user = np.unique(events.users, return_inverse=True)
    by_user = np.lexsort((events.order, user)) if events.order is not None else np.argsort(user, kind="stable")
    offsets = np.concatenate([[0], np.cumsum(np.bincount(user, minlength=len(user_raw)))])
    reindexed = {name: _reindex(col) for name, col in events.columns.items()}
    tables = [TableSpec(name, rows) for name, (_, rows, _, _) in reindexed.items()]

    with staged(dest, overwrite=overwrite) as stage:
        writer = DatasetWriter(
            stage,
            users=len(user_raw),
            interactions=len(user),
            tables=tables,
            sequence_table=events.sequence_table,
            dense=list(events.dense),
            labels=events.labels is not None,
        )
        writer.write("offsets", offsets)
        for name, (ids, _, raw, raw_rows) in reindexed.items():
            writer.write(f"tables/{name}", ids[by_user])
            writer.write_raw_ids(name, raw, raw_rows)
        for name, values in events.dense.items():
            writer.write(f"dense/{name}", values[by_user])
        if events.labels is not None:
            writer.write("labels", events.labels[by_user])
        return writer.finish({"format": fmt, "path": str(src), "sha256": file_sha256(src)})
