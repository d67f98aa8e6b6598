"""Click logs of hashed categoricals: Criteo's display-ads layout and Avazu's CSV."""

from __future__ import annotations

import re

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from shardflow.errors import InputError
from storage.formats.base import Columns, Format, Refused, check_float, finite, read_block
from storage.sources import excerpt
from storage.tables import parse_table_name

CRITEO_DENSE = [f"I{i}" for i in range(1, 14)]
CRITEO_SPARSE = [f"C{i}" for i in range(1, 27)]
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
        t = read_block(data, self.names, types, self.delimiter)
        labels = finite(t["label"].combine_chunks())
        if not np.isin(labels, (0.0, 1.0)).all():
            raise Refused
        return Columns(
            events=t.num_rows,
            tables={n: t[n].combine_chunks() for n in self.tables},
            dense={n: finite(t[n].combine_chunks()).astype(np.float32) for n in self.dense},
            labels=labels.astype(np.float32),
        )

    def _parse_avazu(self, data):
        types = {n: pa.float64() if n == "click" else pa.string() for n in self.names}
        t = read_block(data, self.names, types, self.delimiter)
        labels = finite(t["click"].combine_chunks())
        hour = t["hour"].combine_chunks()
        if not np.isin(labels, (0.0, 1.0)).all() or not pc.all(pc.match_substring_regex(hour, "^[0-9]{8}$")).as_py():
            raise Refused
        tables = {n: t[n].combine_chunks() for n in self.tables}
        tables["hour"] = pc.utf8_slice_codeunits(hour, 6, 8)  # YYMMDDHH: the hour of the day
        return Columns(events=t.num_rows, tables=tables, labels=labels.astype(np.float32))

    def check_line(self, fields, line):
        if len(fields) != len(self.names):
            return (
                f"{len(fields)} fields separated by {self.delimiter!r}; accepted: {len(self.names)} "
                f"({', '.join(self.names[:3])}, ...)"
            )
        for name, value in zip(self.names, fields, strict=True):
            if name in ("label", "click") and value not in (b"0", b"1"):
                return f"{name} {excerpt(value)}; accepted: 0 or 1"
            if self.avazu and name == "hour" and not AVAZU_HOUR.fullmatch(value):
                return f"hour {excerpt(value)}; accepted: YYMMDDHH, 8 digits"
            if not self.avazu and name.startswith("I") and (why := check_float(value, name)):
                return why
        return None
