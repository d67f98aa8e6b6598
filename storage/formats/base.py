"""What every format shares: the columns a block becomes, arrow's CSV reader, the `Format` base with its
block parser and line-by-line diagnosis, and the checks of ids, numbers and runs."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv

from shardflow.errors import InputError, OtherFormat
from storage.sources import Block, count_lines, excerpt

ID_DIGITS = 18  # every id of at most 18 digits fits int64
# One spelling per id: '7', never '07' or '007' (which would read as the same row as '7'). A raw id is its
# integer, so two spellings of one number would silently share a row; a leading zero is refused instead.
_ID = re.compile(rb"0|[1-9][0-9]{0,%d}" % (ID_DIGITS - 1))
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
    tables: dict[str, pa.Array | np.ndarray]  # a table of token sequences: a list array, a list per event
    run_users: pa.Array | np.ndarray | None = None
    run_lengths: np.ndarray | None = None
    event_users: pa.Array | None = None
    order: np.ndarray | None = None
    dense: dict[str, np.ndarray] = field(default_factory=dict)
    labels: np.ndarray | None = None


def without_blank_lines(data: bytes) -> bytes:
    """The block with whitespace-only lines emptied (arrow skips empty lines); line count kept."""
    return _BLANK_LINE.sub(b"", data)


def read_block(data: bytes, names: list[str], types: dict, delimiter: str) -> pa.Table:
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
    widths: Mapping[str, int] = MappingProxyType({})  # a table of token sequences -> the most ids an event holds
    labels: bool = False
    has_header: bool = False
    body_starts_at_line_1: bool = False  # a header-less file of a format that may have one (criteo)

    def header(self, path: Path, line: bytes) -> None:
        """Read the header line of a part (formats with has_header)."""

    def parse(self, path: Path, block: Block) -> Columns:
        try:
            return self._parse(block.data)
        except (pa.ArrowInvalid, pa.ArrowTypeError, Refused):
            pass
        # A whitespace-only line (which every format skips) makes arrow refuse the block:
        # only then is the block searched for such lines.
        cleaned = without_blank_lines(block.data)
        if cleaned != block.data:
            try:
                return self._parse(cleaned)
            except (pa.ArrowInvalid, pa.ArrowTypeError, Refused):
                pass
        raise diagnose(self, path, block)

    def _parse(self, data: bytes) -> Columns:
        raise NotImplementedError

    def check_line(self, fields: list[bytes], line: bytes) -> str | None:
        """Why one line (already split) is refused, or None."""
        raise NotImplementedError


class Refused(Exception):
    """A block holds a value arrow accepted but the format does not (a negative id, a label of 2)."""


_DECIMAL = b"0123456789\r\n"  # all a numeric-id format's block may hold besides its separator (blank lines aside)


def decimal_only(data: bytes, separator: str = " ") -> None:
    """Refuse a block with anything but ASCII digits, the format's separator (a space, or a tab-separated sasrec
    file's tab) and line ends: arrow's integer parser alone would take '0x10' as 16."""
    if data.translate(None, _DECIMAL + separator.encode()):
        raise Refused


def spelled_once(data: bytes, *ids: np.ndarray, separator: str = " ") -> None:
    """Refuse a block (decimal_only's: digits and separators) one of whose ids has a leading zero ('007', which
    arrow reads as 7): then its digits are more than its parsed ids' own digits. Three byte counts and a
    comparison a power of ten, vectorised; no pass of Python over the block."""
    digits = len(data) - data.count(separator.encode()) - data.count(b"\n") - data.count(b"\r")
    if digits != sum(digit_count(v) for v in ids):
        raise Refused


def digit_count(values: np.ndarray) -> int:
    """The decimal digits of non-negative `values` written without leading zeros, all together."""
    total, power, top = int(values.size), 10, int(values.max()) if values.size else 0
    while power <= top:
        total += int(np.count_nonzero(values >= power))
        power *= 10
    return total


def ids_of(values: pa.Array) -> np.ndarray:
    """The ids of a parsed column; Refused if one is negative or has more than ID_DIGITS digits (without a
    leading zero, which decimal_only refuses, that is a value of 10^ID_DIGITS or more)."""
    out = values.to_numpy()
    if out.size and (out.min() < 0 or out.max() >= 10**ID_DIGITS):
        raise Refused
    return out


def check_id(token: bytes, what: str) -> str | None:
    if _ID.fullmatch(token):
        return None
    return (f"{what} {excerpt(token)} is not accepted; accepted: an integer >= 0 (ASCII digits, at most "
            f"{ID_DIGITS}, no leading zero)")


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


def finite(values: pa.Array) -> np.ndarray:
    """float64 values, missing ones NaN; a spelled-out NaN or infinity is refused."""
    out = values.to_numpy(zero_copy_only=False)
    present = ~np.asarray(values.is_null().to_numpy(zero_copy_only=False))
    if not np.isfinite(out[present]).all():
        raise Refused
    return np.where(present, out, np.nan)


def check_float(token: bytes, name: str) -> str | None:
    if token == b"":
        return None
    try:
        value = float(token)
    except ValueError:
        value = math.nan
    return None if math.isfinite(value) else f"{name} = {excerpt(token)}; accepted: a finite number or empty"


def reads_as(line: bytes, refused_by: str, separator: bytes = b" ") -> str | None:
    """The format a line that `refused_by` (its fields between `separator`s) refused plainly is, if one is: a header
    of typed names (recbole), columns between commas or tabs (criteo's header and rows), a user and all its items
    (s3rec, where sasrec wants two)."""
    if b":token" in line or b":float" in line:
        other = "recbole"
    # a tab: criteo's columns, not recbole's (its rows have tabs too) nor a tab-separated sasrec file's
    elif b"," in line or (b"\t" in line and separator != b"\t" and refused_by in ("sasrec", "s3rec")):
        other = "criteo"
    elif refused_by == "sasrec" and len(fields := line.split(b" ")) > 2 and all(f.isdigit() for f in fields):
        other = "s3rec"
    else:
        return None
    return None if other == refused_by else other


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
            message = f"{path}:{number}: {why}"
            other = reads_as(text, fmt.name, separator)
            return OtherFormat(f"{message} (the line reads as the {other} format)", other) if other else \
                InputError(message)
    last = block.first_line + count_lines(block.data) - 1
    return InputError(f"{path}:{block.first_line}-{last}: lines arrow's CSV reader cannot parse as {fmt.name}")
