"""The published formats, parsed block by block by pyarrow's CSV reader.

Each format turns one block of whole lines (storage.sources.Block) into columns:
the users of the block's runs, one column per table, the numeric columns, labels and
time stamps. Nothing is done per line or per token in Python on this path; arrow's C++
reader converts the text and numpy does the rest. Only when arrow refuses a block is it
read again line by line (`diagnose`) to name the first bad line and what is accepted.

Formats (see data/README.md for the files they come from):
    sasrec   `user item` per line, a user's lines in time order (SASRec's data/*.txt)
    s3rec    `user i1 i2 ...`, one user per line in time order (S3-Rec / ICLRec)
    recbole  RecBole's atomic `.inter` file: tab-separated, typed header `name:type`; a sequence
             log, or with a click label (`rating>=4`) a click log whose examples are the
             interactions in time order, joined by id with RecBole's `.user` and `.item`
             feature files where they are given (`read_features`)
    criteo   Criteo display-ads CSV/TSV: label, I1..I13 integers, C1..C26 hashed categoricals;
             or Avazu's CSV: id, click (the label), hour (YYMMDDHH: its hour of day is a
             categorical `hour`), every other column a hashed categorical, id dropped

Numeric ids (sasrec, s3rec) are ASCII decimal digits only, at most 18 of them; recbole
tokens and criteo categoricals are text.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv

from shardflow.errors import InputError
from storage.tables import parse_table_name
from storage.sources import FEATURE_SUFFIXES, Block, count_lines, excerpt

FORMATS = ("sasrec", "s3rec", "recbole", "criteo")
CRITEO_DENSE = [f"I{i}" for i in range(1, 14)]
CRITEO_SPARSE = [f"C{i}" for i in range(1, 27)]
RECBOLE_TYPES = ("token", "float")
RECBOLE_FEATURE_TYPES = ("token", "float", "token_seq", "float_seq")  # a .user / .item file's field types
FEATURE_FILES = dict(zip(FEATURE_SUFFIXES, ("user_id", "item_id")))  # RecBole's feature files: suffix -> their id
_CLICK_LABEL = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_]*)\s*>=\s*([-+]?(?:[0-9]+\.?[0-9]*|\.[0-9]+))\s*")
ID_DIGITS = 18  # every id of at most 18 digits fits int64
_ID = re.compile(rb"[0-9]{1,%d}" % ID_DIGITS)
_BLANK_LINE = re.compile(rb"(?m)^[ \t\r\f\v]+$")
_ARROW_PARSE_BLOCK = 1 << 20  # arrow converts a block in pieces of this size on its threads


@dataclass
class Columns:
    """What one block holds, in the block's line order.

    Users come either as runs (`run_users` with `run_lengths`: consecutive events of one
    user, for formats grouped by user) or one per event (`event_users`); criteo has
    neither (every example is its own user).
    """

    events: int
    tables: dict[str, pa.Array | np.ndarray]
    run_users: pa.Array | np.ndarray | None = None
    run_lengths: np.ndarray | None = None
    event_users: pa.Array | None = None
    order: np.ndarray | None = None
    dense: dict[str, np.ndarray] = field(default_factory=dict)
    labels: np.ndarray | None = None


def _without_blank_lines(data: bytes) -> bytes:
    """The block with whitespace-only lines emptied (arrow skips empty lines); line count kept."""
    return _BLANK_LINE.sub(b"", data)


def _read(data: bytes, names: list[str], types: dict, delimiter: str) -> pa.Table:
    return pacsv.read_csv(
        pa.py_buffer(data),
        read_options=pacsv.ReadOptions(column_names=names, block_size=_ARROW_PARSE_BLOCK, use_threads=True),
        parse_options=pacsv.ParseOptions(delimiter=delimiter, quote_char=False, double_quote=False),
        convert_options=pacsv.ConvertOptions(
            column_types=types, null_values=[""], strings_can_be_null=False, quoted_strings_can_be_null=False
        ),
    )


class Format:
    """One source format: its header (if any), its block parser, and its line-by-line diagnosis."""

    name: str
    tables: tuple[str, ...]
    sequence_table: str | None = None
    dense: tuple[str, ...] = ()
    labels: bool = False
    has_header: bool = False
    body_starts_at_line_1: bool = False  # a header-less file of a format that may have one (criteo)

    def header(self, path: Path, line: bytes) -> None:
        """Read the header line of a part (formats with has_header)."""

    def parse(self, path: Path, block: Block) -> Columns:
        try:
            return self._parse(block.data)
        except (pa.ArrowInvalid, pa.ArrowTypeError, _Refused):
            pass
        # A whitespace-only line (which every format skips) makes arrow refuse the block:
        # only then is the block searched for such lines.
        cleaned = _without_blank_lines(block.data)
        if cleaned != block.data:
            try:
                return self._parse(cleaned)
            except (pa.ArrowInvalid, pa.ArrowTypeError, _Refused):
                pass
        raise diagnose(self, path, block)

    def _parse(self, data: bytes) -> Columns:
        raise NotImplementedError

    def check_line(self, fields: list[bytes], line: bytes) -> str | None:
        """Why one line (already split) is refused, or None."""
        raise NotImplementedError


class _Refused(Exception):
    """A block holds a value arrow accepted but the format does not (a negative id, a label of 2)."""


_DECIMAL = b"0123456789 \r\n"  # all a numeric-id format's block may hold (blank lines aside)


def _decimal_only(data: bytes) -> None:
    """Refuse a block with anything but ASCII digits, spaces and line ends: arrow's integer parser alone
    would take '0x10' as 16."""
    if data.translate(None, _DECIMAL):
        raise _Refused


def _ids(values: pa.Array) -> np.ndarray:
    out = values.to_numpy()
    if out.size and out.min() < 0:
        raise _Refused
    return out


def _check_id(token: bytes, what: str) -> str | None:
    if _ID.fullmatch(token):
        return None
    return f"{what} {excerpt(token)} is not accepted; accepted: an integer >= 0 (ASCII digits, at most {ID_DIGITS})"


def runs_of(users: np.ndarray, lengths: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Runs of consecutive equal users: (their users, their lengths); `lengths` weights each entry.

    Also joins the runs a block boundary cut in two, given the blocks' runs and lengths.
    """
    if users.size == 0:
        return users, np.zeros(0, dtype=np.int64)
    starts = np.concatenate([[0], np.flatnonzero(users[1:] != users[:-1]) + 1])
    if lengths is None:
        run_lengths = np.diff(np.concatenate([starts, [users.size]]))
    else:
        run_lengths = np.add.reduceat(lengths, starts)
    return users[starts], run_lengths.astype(np.int64)


class Sasrec(Format):
    name, tables, sequence_table = "sasrec", ("item",), "item"
    delimiter = " "

    def _parse(self, data: bytes) -> Columns:
        _decimal_only(data)
        t = _read(data, ["user", "item"], {"user": pa.int64(), "item": pa.int64()}, self.delimiter)
        users, items = _ids(t["user"].combine_chunks()), _ids(t["item"].combine_chunks())
        run_users, run_lengths = runs_of(users)
        return Columns(events=len(items), tables={"item": items}, run_users=run_users, run_lengths=run_lengths)

    def check_line(self, fields, line):
        if len(fields) != 2:
            return f"{excerpt(line)} has {len(fields)} fields; accepted: 'user item'"
        return _check_id(fields[0], "user") or _check_id(fields[1], "item")


class S3rec(Format):
    name, tables, sequence_table = "s3rec", ("item",), "item"

    def _parse(self, data: bytes) -> Columns:
        _decimal_only(data)
        buf = np.frombuffer(data, dtype=np.uint8)
        ends = np.flatnonzero(buf == 10)
        starts = np.concatenate([[0], ends[:-1] + 1])
        nonblank = ends - starts > (buf[np.maximum(ends - 1, 0)] == 13)  # a line of just '\r' is blank
        spaces = buf == 32
        tokens = np.add.reduceat(spaces, starts, dtype=np.int64) + 1 if starts.size else np.zeros(0, np.int64)
        tokens = tokens[nonblank]
        if (tokens < 2).any():
            raise _Refused
        one_per_line = buf.copy()
        one_per_line[spaces] = 10
        values = _read(one_per_line.tobytes(), ["id"], {"id": pa.int64()}, ",")["id"].combine_chunks()
        if len(values) != int(tokens.sum()):  # an empty field: two spaces, or one at an end
            raise _Refused
        values = _ids(values)
        first = np.concatenate([[0], np.cumsum(tokens)[:-1]])
        is_user = np.zeros(values.size, dtype=bool)
        is_user[first] = True
        run_users, run_lengths = runs_of(values[first], tokens - 1)
        return Columns(
            events=int(values.size - first.size), tables={"item": values[~is_user]},
            run_users=run_users, run_lengths=run_lengths,
        )

    def check_line(self, fields, line):
        if len(fields) < 2:
            return f"{excerpt(line)} has no items; accepted: 'user item1 item2 ...'"
        if b"" in fields:
            return f"{excerpt(line)}: an empty field; accepted: 'user item1 item2 ...' separated by single spaces"
        return _check_id(fields[0], "user") or next(filter(None, (_check_id(f, "item") for f in fields[1:])), None)


def parse_click_label(text: str) -> tuple[str, float]:
    """`FIELD>=THRESHOLD` (`rating>=4`): an interaction is a click when its float field FIELD is at least THRESHOLD."""
    match = _CLICK_LABEL.fullmatch(text) if isinstance(text, str) else None
    if match is None:
        raise InputError(f"click label {text!r}; accepted: FIELD>=NUMBER, a float field of the .inter file and "
                         "its threshold ('rating>=4': a rating of 4 or more is a click)")
    return match.group(1), float(match.group(2))


@dataclass(frozen=True)
class FeatureFile:
    """One of RecBole's feature files (`.user`, `.item`), held whole: its id field, and the fields joined."""

    path: Path
    key: str  # user_id or item_id
    table: pa.Table  # the key and the fields joined, tokens as strings and floats as float64
    tokens: tuple[str, ...]
    floats: tuple[str, ...]
    skipped: tuple[str, ...]  # sequence fields (token_seq, float_seq), not joined yet

    @property
    def fields(self) -> tuple[str, ...]:
        return (*self.tokens, *self.floats)


def read_features(path: Path, key: str) -> FeatureFile:
    """A `.user` or `.item` file: typed header, one line per id; every id once."""
    with open(path, "rb") as f:
        head = f.readline().decode("utf-8", errors="replace").rstrip("\r\n")
    names, types = [], []
    for entry in head.split("\t"):
        name, sep, kind = entry.partition(":")
        if not sep or kind not in RECBOLE_FEATURE_TYPES:
            raise InputError(f"{path}:1: header field {excerpt(entry)}; accepted: 'name:type' with type one of "
                             f"{', '.join(RECBOLE_FEATURE_TYPES)}")
        names.append(name)
        types.append(kind)
    if dict(zip(names, types)).get(key) != "token" or len(set(names)) != len(names):
        raise InputError(f"{path}:1: header {names}; accepted: one '{key}:token' field and each name once")
    tokens = tuple(parse_table_name(n) for n, k in zip(names, types) if k == "token" and n != key)
    floats = tuple(n for n, k in zip(names, types) if k == "float")
    column_types = {n: pa.string() if k != "float" else pa.float64() for n, k in zip(names, types)}
    try:
        table = pacsv.read_csv(
            path,
            read_options=pacsv.ReadOptions(column_names=names, skip_rows=1),
            parse_options=pacsv.ParseOptions(delimiter="\t", quote_char=False, double_quote=False),
            convert_options=pacsv.ConvertOptions(column_types=column_types, include_columns=[key, *tokens, *floats],
                                                 null_values=[""], strings_can_be_null=False),
        )
    except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
        raise InputError(f"{path}: {str(e).splitlines()[0]}; accepted: {len(names)} tab-separated fields per line "
                         "as in the header, floats as numbers") from None
    if pc.count_distinct(table[key]).as_py() != table.num_rows:
        raise InputError(f"{path}: a {key} on more than one line; accepted: each {key} once")
    for n in floats:
        values = table[n].to_numpy()
        if np.isinf(values).any() or np.isnan(values[~np.asarray(table[n].is_null())]).any():
            raise InputError(f"{path}: {n} holds a NaN or an infinity; accepted: finite numbers or empty")
    skipped = tuple(n for n, k in zip(names, types) if k.endswith("_seq"))
    return FeatureFile(Path(path), key, table.combine_chunks(), tokens, floats, skipped)


class Recbole(Format):
    name, sequence_table, has_header = "recbole", "item", True
    delimiter = "\t"

    def __init__(self, label: str | None = None) -> None:
        self.names: list[str] | None = None
        self.types: list[str] = []
        self.label = parse_click_label(label) if label is not None else None
        self.features: tuple[FeatureFile, ...] = ()
        if self.label is not None:  # a click log: every interaction its own example, with its label
            self.sequence_table, self.labels = None, True

    def join(self, features: tuple[FeatureFile, ...]) -> None:
        """Join every interaction (of a click log) with these feature files' fields, by user or item id."""
        self.features = tuple(features)

    def header(self, path, line):
        names, types = [], []
        for entry in line.decode("utf-8", errors="replace").rstrip("\r\n").split("\t"):
            name, sep, kind = entry.partition(":")
            if not sep or kind not in RECBOLE_TYPES:
                raise InputError(
                    f"{path}:1: header field {excerpt(entry)}; accepted: 'name:type' with type one of "
                    f"{', '.join(RECBOLE_TYPES)} (sequence types are not supported)"
                )
            names.append(name)
            types.append(kind)
        for required in ("user_id", "item_id"):
            if required not in names:
                raise InputError(f"{path}:1: no '{required}:token' field in the header {names}")
        if self.names is not None and (names, types) != (self.names, self.types):
            raise InputError(f"{path}:1: header {names}; accepted: the header of the first part, {self.names}")
        self.names, self.types = names, types
        tokens = [n for n, k in zip(names, types) if k == "token" and n not in ("user_id", "item_id")]
        floats = [n for n, k in zip(names, types) if k == "float" and n != "timestamp"]
        if self.label is None:
            self.tables = ("item", *(parse_table_name(n) for n in tokens))
            self.dense = tuple(floats)
            return
        field_name = self.label[0]
        if field_name not in floats:  # the time stamp orders the examples: it labels none
            raise InputError(f"{path}:1: click label {field_name}>={self.label[1]:g}: no '{field_name}:float' field "
                             f"in the header {names} other than timestamp; accepted: a float field, one of "
                             f"{', '.join(floats) or 'none'}")
        floats.remove(field_name)  # the label's source is no input
        joined = [f for feature in self.features for f in feature.fields]
        own = ["user", "item", *tokens, *floats]
        clash = sorted({n for n in joined if joined.count(n) > 1 or n in own})
        if clash:
            raise InputError(f"field {clash[0]!r} is in more than one of {path} and the feature files "
                             f"{', '.join(str(f.path) for f in self.features)}; accepted: each field name once")
        self.tables = ("user", "item", *(parse_table_name(n) for n in tokens),
                       *(n for feature in self.features for n in feature.tokens))
        self.dense = (*floats, *(n for feature in self.features for n in feature.floats))

    def _parse(self, data):
        types = {n: pa.string() if k == "token" else pa.float64() for n, k in zip(self.names, self.types)}
        t = _read(data, self.names, types, self.delimiter)
        floats = {n: _finite(t[n].combine_chunks()) for n, k in zip(self.names, self.types) if k == "float"}
        tokens = {n: t[n].combine_chunks() for n, k in zip(self.names, self.types) if k == "token"}
        users, items = tokens.pop("user_id"), tokens.pop("item_id")
        order = floats.pop("timestamp", None)
        if self.label is None:
            return Columns(
                events=t.num_rows, tables={"item": items, **tokens}, event_users=users, order=order,
                dense={n: v.astype(np.float32) for n, v in floats.items()},
            )
        field_name, threshold = self.label
        rating = floats.pop(field_name)
        if np.isnan(rating).any():
            raise _Refused
        tables, dense = {"user": users, "item": items, **tokens}, dict(floats)
        for feature in self.features:
            at = pc.index_in(users if feature.key == "user_id" else items, value_set=feature.table[feature.key])
            joined = feature.table.take(at)  # an id the file lacks: nulls, the token '' and a missing float (NaN)
            for n in feature.tokens:
                tables[n] = pc.fill_null(joined[n], "").combine_chunks()
            for n in feature.floats:
                dense[n] = joined[n].to_numpy()
        return Columns(
            events=t.num_rows, tables=tables, order=order, labels=(rating >= threshold).astype(np.float32),
            dense={n: np.asarray(v, dtype=np.float32) for n, v in dense.items()},
        )

    def check_line(self, fields, line):
        if len(fields) != len(self.names):
            return f"{len(fields)} tab-separated fields; accepted: {len(self.names)} as in the header"
        for name, kind, value in zip(self.names, self.types, fields):
            if kind == "float" and (why := _check_float(value, name)):
                return why
            if self.label is not None and name == self.label[0] and value == b"":
                return f"{name} is empty; accepted: a number (the click label is {name}>={self.label[1]:g})"
        return None


def _finite(values: pa.Array) -> np.ndarray:
    """float64 values, missing ones NaN; a spelled-out NaN or infinity is refused."""
    out = values.to_numpy(zero_copy_only=False)
    present = ~np.asarray(values.is_null().to_numpy(zero_copy_only=False))
    if not np.isfinite(out[present]).all():
        raise _Refused
    return np.where(present, out, np.nan)


def _check_float(token: bytes, name: str) -> str | None:
    if token == b"":
        return None
    try:
        value = float(token)
    except ValueError:
        value = math.nan
    return None if math.isfinite(value) else f"{name} = {excerpt(token)}; accepted: a finite number or empty"


AVAZU_FIRST = ["id", "click"]  # the header of Avazu's CSV starts so
AVAZU_HOUR = re.compile(rb"[0-9]{8}")


class Criteo(Format):
    name, has_header, labels = "criteo", True, True

    def __init__(self) -> None:
        self.names: list[str] | None = None
        self.delimiter = ","
        self.avazu = False

    def header(self, path, line):
        text = line.decode("utf-8", errors="replace").rstrip("\r\n")
        delimiter = "\t" if "\t" in text else ","
        fields = text.split(delimiter)
        if fields[:2] == AVAZU_FIRST:
            return self._avazu_header(path, fields, delimiter)
        if fields[0] == "label":
            names, headed = fields, True
        else:
            names, headed = ["label", *CRITEO_DENSE, *CRITEO_SPARSE], False
        unknown = [n for n in names if n != "label" and not (n[:1] in "IC" and n[1:].isdigit())]
        if unknown or "label" not in names:
            raise InputError(
                f"{path}:1: header columns {unknown or names}; accepted: 'label', 'I<n>' (integer) and "
                "'C<n>' (categorical) columns"
            )
        if self.names is not None and (names, delimiter) != (self.names, self.delimiter):
            raise InputError(f"{path}:1: columns {names}; accepted: those of the first part, {self.names}")
        self.names, self.delimiter, self.body_starts_at_line_1 = names, delimiter, not headed
        self.tables = tuple(n for n in names if n.startswith("C"))
        self.dense = tuple(n for n in names if n.startswith("I"))

    def _avazu_header(self, path, fields: list[str], delimiter: str) -> None:
        names = [parse_table_name(n) if n not in AVAZU_FIRST else n for n in fields]
        if "hour" not in names or len(set(names)) != len(names):
            raise InputError(f"{path}:1: Avazu columns {names}; accepted: id, click, hour and categorical "
                             "columns, each once")
        if self.names is not None and (names, delimiter) != (self.names, self.delimiter):
            raise InputError(f"{path}:1: columns {names}; accepted: those of the first part, {self.names}")
        self.names, self.delimiter, self.avazu, self.body_starts_at_line_1 = names, delimiter, True, False
        self.tables = tuple(n for n in names if n not in AVAZU_FIRST)
        self.dense = ()

    def _parse(self, data):
        if self.avazu:
            return self._parse_avazu(data)
        types = {n: pa.string() if n.startswith("C") else pa.float64() for n in self.names}
        t = _read(data, self.names, types, self.delimiter)
        labels = _finite(t["label"].combine_chunks())
        if not np.isin(labels, (0.0, 1.0)).all():
            raise _Refused
        return Columns(
            events=t.num_rows,
            tables={n: t[n].combine_chunks() for n in self.tables},
            dense={n: _finite(t[n].combine_chunks()).astype(np.float32) for n in self.dense},
            labels=labels.astype(np.float32),
        )

    def _parse_avazu(self, data):
        types = {n: pa.float64() if n == "click" else pa.string() for n in self.names}
        t = _read(data, self.names, types, self.delimiter)
        labels = _finite(t["click"].combine_chunks())
        hour = t["hour"].combine_chunks()
        if not np.isin(labels, (0.0, 1.0)).all() or not pc.all(pc.match_substring_regex(hour, "^[0-9]{8}$")).as_py():
            raise _Refused
        tables = {n: t[n].combine_chunks() for n in self.tables}
        tables["hour"] = pc.utf8_slice_codeunits(hour, 6, 8)  # YYMMDDHH: the hour of the day
        return Columns(events=t.num_rows, tables=tables, labels=labels.astype(np.float32))

    def check_line(self, fields, line):
        if len(fields) != len(self.names):
            return (
                f"{len(fields)} fields separated by {self.delimiter!r}; accepted: {len(self.names)} "
                f"({', '.join(self.names[:3])}, ...)"
            )
        for name, value in zip(self.names, fields):
            if name in ("label", "click") and value not in (b"0", b"1"):
                return f"{name} {excerpt(value)}; accepted: 0 or 1"
            if self.avazu and name == "hour" and not AVAZU_HOUR.fullmatch(value):
                return f"hour {excerpt(value)}; accepted: YYMMDDHH, 8 digits"
            if not self.avazu and name.startswith("I") and (why := _check_float(value, name)):
                return why
        return None


def make_format(name: str, label: str | None = None) -> Format:
    """The parser of format `name`; `label`: recbole's click label (a click log), None for the others."""
    if name not in FORMATS:
        raise InputError(f"format {name!r} is not known; accepted: {', '.join(FORMATS)}")
    if name == "recbole":
        return Recbole(label)
    return {"sasrec": Sasrec, "s3rec": S3rec, "criteo": Criteo}[name]()


def feature_files(src: Path) -> dict[str, Path]:
    """RecBole's feature files of a source, by suffix: beside a file X.inter, X.user and X.item; in a
    directory of parts, its one file of each suffix (storage.sources never takes them for parts)."""
    src = Path(src)
    if src.is_dir():
        found = {}
        for suffix in FEATURE_FILES:
            files = sorted(p for p in src.iterdir() if p.name.endswith(suffix) and not p.name.startswith("."))
            if len(files) > 1:
                raise InputError(f"{src}: {len(files)} {suffix} files ({', '.join(p.name for p in files)}); "
                                 f"accepted: at most one")
            found.update({suffix: files[0]} if files else {})
        return found
    stem = src.name.removesuffix(".gz").removesuffix(".inter")
    return {suffix: src.parent / f"{stem}{suffix}" for suffix in FEATURE_FILES
            if (src.parent / f"{stem}{suffix}").is_file()}


def sniff_delimiter(fmt: Format, first_line: bytes) -> None:
    """sasrec files separate user and item by a space or a tab: whichever the first line uses."""
    if isinstance(fmt, Sasrec):
        fmt.delimiter = "\t" if b"\t" in first_line and b" " not in first_line.strip() else " "


def diagnose(fmt: Format, path: Path, block: Block) -> InputError:
    """The first bad line of a block arrow refused, named by file and line, with what is accepted."""
    try:
        block.data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = block.first_line + block.data.count(b"\n", 0, e.start)
        column = e.start - (block.data.rfind(b"\n", 0, e.start) + 1)
        return InputError(f"{path}:{line}: not UTF-8 text (byte {column} of the line); accepted: a UTF-8 text file")
    separator = {"s3rec": b" "}.get(fmt.name, getattr(fmt, "delimiter", " ").encode())
    for number, line in enumerate(block.data.split(b"\n")[:-1], start=block.first_line):
        text = line.rstrip(b"\r")
        if not text.strip():
            continue
        why = fmt.check_line(text.split(separator), text)
        if why:
            return InputError(f"{path}:{number}: {why}")
    last = block.first_line + count_lines(block.data) - 1
    return InputError(f"{path}:{block.first_line}-{last}: lines arrow's CSV reader cannot parse as {fmt.name}")
