"""RecBole's atomic files: the `.inter` file (a sequence log, or with a click label a click log) and the
`.user` / `.item` feature files joined to it by id."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv

from shardflow.errors import InputError
from storage.formats.base import Columns, Format, Refused, check_float, finite, read_block
from storage.sources import FEATURE_SUFFIXES, excerpt
from storage.tables import parse_table_name

RECBOLE_TYPES = ("token", "float")
RECBOLE_FEATURE_TYPES = ("token", "float", "token_seq", "float_seq")  # a .user / .item file's field types
# RecBole's feature files: suffix -> their id
FEATURE_FILES = dict(zip(FEATURE_SUFFIXES, ("user_id", "item_id"), strict=True))
_CLICK_LABEL = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_]*)\s*>=\s*([-+]?(?:[0-9]+\.?[0-9]*|\.[0-9]+))\s*")


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
    table: pa.Table  # the key and the fields joined: tokens as strings, token sequences as lists of them, floats
    tokens: tuple[str, ...]
    floats: tuple[str, ...]
    skipped: tuple[str, ...]  # float_seq fields, not joined
    sequences: dict = field(default_factory=dict)  # token_seq field -> the most tokens one line holds (>= 1)

    @property
    def fields(self) -> tuple[str, ...]:
        return (*self.tokens, *self.sequences, *self.floats)


def token_lists(values: pa.Array) -> pa.ListArray:
    """A token_seq field's text as lists of its whitespace-separated tokens (an empty field: none)."""
    split = pc.utf8_split_whitespace(values)
    flat, parents = pc.list_flatten(split), pc.list_parent_indices(split).to_numpy()
    keep = pc.not_equal(flat, "")
    lengths = np.bincount(parents[keep.to_numpy(zero_copy_only=False)], minlength=len(values))
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    return pa.ListArray.from_arrays(pa.array(offsets), flat.filter(keep))


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
    if dict(zip(names, types, strict=True)).get(key) != "token" or len(set(names)) != len(names):
        raise InputError(f"{path}:1: header {names}; accepted: one '{key}:token' field and each name once")
    tokens = tuple(parse_table_name(n) for n, k in zip(names, types, strict=True) if k == "token" and n != key)
    sequences = tuple(parse_table_name(n) for n, k in zip(names, types, strict=True) if k == "token_seq")
    floats = tuple(n for n, k in zip(names, types, strict=True) if k == "float")
    column_types = {n: pa.string() if k != "float" else pa.float64() for n, k in zip(names, types, strict=True)}
    try:
        table = pacsv.read_csv(
            path,
            read_options=pacsv.ReadOptions(column_names=names, skip_rows=1),
            parse_options=pacsv.ParseOptions(delimiter="\t", quote_char=False, double_quote=False),
            convert_options=pacsv.ConvertOptions(column_types=column_types,
                                                 include_columns=[key, *tokens, *sequences, *floats],
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
    table = table.combine_chunks()
    widths = {}
    for n in sequences:
        lists = token_lists(table[n].combine_chunks())
        table = table.set_column(table.schema.get_field_index(n), n, lists)
        widths[n] = max(1, int(pc.max(pc.list_value_length(lists)).as_py() or 0))
    skipped = tuple(n for n, k in zip(names, types, strict=True) if k == "float_seq")
    return FeatureFile(Path(path), key, table, tokens, floats, skipped, widths)


class Recbole(Format):
    name, sequence_table, has_header = "recbole", "item", True
    delimiter = "\t"

    def __init__(self, label: str | None = None) -> None:
        self.names: list[str] | None = None
        self.types: list[str] = []
        self.label = parse_click_label(label) if label is not None else None
        self.features: tuple[FeatureFile, ...] = ()
        self.widths: dict[str, int] = {}  # a joined token_seq field -> the most tokens an interaction reads of it
        if self.label is not None:  # a click log: every interaction its own example, with its label
            self.sequence_table, self.labels = None, True

    def join(self, features: tuple[FeatureFile, ...]) -> None:
        """Join every interaction (of a click log) with these feature files' fields, by user or item id."""
        self.features = tuple(features)
        self.widths = {n: w for feature in self.features for n, w in feature.sequences.items()}

    def fit_widths(self, stored: dict[str, int]) -> None:
        """Read every token_seq field into the width a store already gives it (`stored`: table -> width), which
        is fixed at its first import: a field whose lines now hold more tokens than that is refused."""
        if set(self.widths) != set(stored):
            raise InputError(f"token sequence fields {sorted(self.widths)}; the store holds {sorted(stored)}; "
                             "accepted: the field types of the store's first import")
        for n, w in self.widths.items():
            if w > stored[n]:
                path = next(f.path for f in self.features if n in f.sequences)
                raise InputError(f"{path}: a {n} of {w} tokens; accepted: at most {stored[n]}, the most the store's "
                                 "first import read (import into a new store to read more)")
            self.widths[n] = stored[n]

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
        tokens = [n for n, k in zip(names, types, strict=True) if k == "token" and n not in ("user_id", "item_id")]
        floats = [n for n, k in zip(names, types, strict=True) if k == "float" and n != "timestamp"]
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
                       *(n for feature in self.features for n in (*feature.tokens, *feature.sequences)))
        self.dense = (*floats, *(n for feature in self.features for n in feature.floats))

    def _parse(self, data):
        types = {n: pa.string() if k == "token" else pa.float64() for n, k in zip(self.names, self.types, strict=True)}
        t = read_block(data, self.names, types, self.delimiter)
        floats = {n: finite(t[n].combine_chunks()) for n, k in zip(self.names, self.types, strict=True) if k == "float"}
        tokens = {n: t[n].combine_chunks() for n, k in zip(self.names, self.types, strict=True) if k == "token"}
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
            raise Refused
        tables, dense = {"user": users, "item": items, **tokens}, dict(floats)
        for feature in self.features:
            at = pc.index_in(users if feature.key == "user_id" else items, value_set=feature.table[feature.key])
            joined = feature.table.take(at)  # an id the file lacks: nulls, the token '' and a missing float (NaN)
            for n in feature.tokens:
                tables[n] = pc.fill_null(joined[n], "").combine_chunks()
            for n in feature.sequences:  # an id the file lacks: no tokens
                tables[n] = joined[n].combine_chunks()
            for n in feature.floats:
                dense[n] = joined[n].to_numpy()
        return Columns(
            events=t.num_rows, tables=tables, order=order, labels=(rating >= threshold).astype(np.float32),
            dense={n: np.asarray(v, dtype=np.float32) for n, v in dense.items()},
        )

    def check_line(self, fields, line):
        if len(fields) != len(self.names):
            return f"{len(fields)} tab-separated fields; accepted: {len(self.names)} as in the header"
        for name, kind, value in zip(self.names, self.types, fields, strict=True):
            if kind == "float" and (why := check_float(value, name)):
                return why
            if self.label is not None and name == self.label[0] and value == b"":
                return f"{name} is empty; accepted: a number (the click label is {name}>={self.label[1]:g})"
        return None


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
