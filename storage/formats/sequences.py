"""The sequence formats of numeric ids: sasrec (`user item` per line) and s3rec (`user i1 i2 ...`)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from storage.formats.base import (
    Columns,
    Format,
    Refused,
    check_id,
    decimal_only,
    ids_of,
    read_block,
    runs_of,
    spelled_once,
)
from storage.sources import excerpt


class Sasrec(Format):
    name, tables, sequence_table = "sasrec", ("item",), "item"
    delimiter = " "

    def _parse(self, data: bytes) -> Columns:
        decimal_only(data, self.delimiter)
        t = read_block(data, ["user", "item"], {"user": pa.int64(), "item": pa.int64()}, self.delimiter)
        users, items = ids_of(t["user"].combine_chunks()), ids_of(t["item"].combine_chunks())
        spelled_once(data, users, items, separator=self.delimiter)
        run_users, run_lengths = runs_of(users)
        return Columns(events=len(items), tables={"item": items}, run_users=run_users, run_lengths=run_lengths)

    def check_line(self, fields, line):
        if len(fields) != 2:
            return f"{excerpt(line)} has {len(fields)} fields; accepted: 'user item'"
        return check_id(fields[0], "user") or check_id(fields[1], "item")


class S3rec(Format):
    name, tables, sequence_table = "s3rec", ("item",), "item"

    def _parse(self, data: bytes) -> Columns:
        decimal_only(data)
        buf = np.frombuffer(data, dtype=np.uint8)
        ends = np.flatnonzero(buf == 10)
        starts = np.concatenate([[0], ends[:-1] + 1])
        nonblank = ends - starts > (buf[np.maximum(ends - 1, 0)] == 13)  # a line of just '\r' is blank
        spaces = buf == 32
        tokens = np.add.reduceat(spaces, starts, dtype=np.int64) + 1 if starts.size else np.zeros(0, np.int64)
        tokens = tokens[nonblank]
        if (tokens < 2).any():
            raise Refused
        one_per_line = buf.copy()
        one_per_line[spaces] = 10
        values = read_block(one_per_line.tobytes(), ["id"], {"id": pa.int64()}, ",")["id"].combine_chunks()
        if len(values) != int(tokens.sum()):  # an empty field: two spaces, or one at an end
            raise Refused
        values = ids_of(values)
        spelled_once(data, values)
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
        return check_id(fields[0], "user") or next(filter(None, (check_id(f, "item") for f in fields[1:])), None)
