"""The number and write phases of an import (storage.importers): the rows and users a part's raw values
get, in part order (`Numberer`), and the part's segment written from its spill (`write_segment`).
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from storage.dataset import EVENTS_PER_CHUNK
from storage.dataset_writer import SegmentWriter, segment_name
from storage.formats import Format
from storage.idmap import IdMap, RowLookup
from storage.scan import PartScan, read_spill
from storage.tables import TableSpec

REGROUP_EVENTS = 1 << 20  # events sorted at a time when a part is regrouped by user and time


@dataclass
class Numbering:
    """How one part's raw values become rows and users: what `write_segment` needs."""

    index: int
    run_users: np.ndarray | None = None  # grouped: the user index of every run
    code_users: np.ndarray | None = None  # recbole: user index of every user code
    lookups: dict = field(default_factory=dict)  # numeric table -> (distinct, rows)
    code_rows: dict = field(default_factory=dict)  # text table -> row of every code
    new_users: np.ndarray | pa.Array | None = None  # raw ids of the users the part introduces
    own_users_from: int | None = None  # every event its own user, numbered from here (new_users stays None)
    new_raw: dict = field(default_factory=dict)  # table -> (raw values introduced, their rows)


class Numberer:
    """The dataset's id maps, extended part by part in order."""

    def __init__(self, users: IdMap | None, tables: dict[str, IdMap], user_count: int) -> None:
        self.users, self.tables, self.user_count = users, tables, user_count

    def number(self, index: int, scan: PartScan) -> Numbering:
        n = Numbering(index=index)
        if scan.run_users is not None:
            new, _ = self.users.extend(scan.distinct["users"])
            n.run_users, n.new_users = self.users.rows_of(scan.run_users), new
        elif scan.user_codes is not None:
            distinct = scan.user_codes.take(pc.sort_indices(scan.user_codes))
            new, _ = self.users.extend(distinct)
            n.code_users, n.new_users = self.users.rows_of(scan.user_codes), new
        else:  # every example its own user: numbered, never held (write_segment writes the numbers)
            n.own_users_from = self.user_count
        self.user_count += scan.events if n.own_users_from is not None else len(n.new_users)
        for name, idmap in self.tables.items():
            if name in scan.codes:
                dictionary = scan.codes[name]
                n.new_raw[name] = idmap.extend(dictionary.take(pc.sort_indices(dictionary)))
                n.code_rows[name] = idmap.rows_of(dictionary)
            else:
                n.new_raw[name] = idmap.extend(scan.distinct[name])
                if not idmap.hash_rows:
                    n.lookups[name] = (scan.distinct[name], idmap.rows_of(scan.distinct[name]))
        return n


# -- write -------------------------------------------------------------------------------


def write_segment(
    fmt: Format, scan: PartScan, numbering: Numbering, directory: str, version: int, rows: dict[str, int],
    events_per_chunk: int = EVENTS_PER_CHUNK,
) -> dict:
    """Write one part's segment into `directory`; returns its manifest entry."""
    dtypes = {t: TableSpec(t, max(1, rows[t])).id_dtype for t in fmt.tables}
    perm, runs = _event_order(scan, numbering)
    writer = SegmentWriter(
        Path(directory), events=scan.events, runs=scan.events if runs is None else len(runs[0]), tables=dtypes,
        dense=fmt.dense, labels=fmt.labels, events_per_chunk=events_per_chunk, widths=dict(fmt.widths),
    )
    if runs is not None:
        writer.write_runs(runs[0], np.concatenate([[0], np.cumsum(runs[1])]))
        writer.write_user_ids(as_numpy(numbering.new_users))
    else:
        writer.write_own_users(numbering.own_users_from)

    def column(spilled: str, target: str, transform=None, width: int | None = None) -> None:
        for values in _spilled_blocks(scan, spilled, perm, events_per_chunk, width):
            writer.write(target, values if transform is None else transform(values))

    for t in fmt.tables:
        if t in numbering.lookups:
            column(f"table.{t}", f"tables/{t}", RowLookup(*numbering.lookups[t]))
        elif t in numbering.code_rows:  # a token sequence's padding, code -1, stays -1 (the last entry)
            rows = np.append(numbering.code_rows[t], -1).astype(dtypes[t])
            column(f"code.{t}", f"tables/{t}", rows.__getitem__, fmt.widths.get(t))
        else:
            column(f"table.{t}", f"tables/{t}")
        raw, raw_rows = numbering.new_raw[t]
        writer.write_raw_ids(t, as_numpy(raw), raw_rows)
    for d in fmt.dense:
        column(f"dense.{d}", f"dense/{d}")
    if fmt.labels:
        column("labels", "labels")
    shutil.rmtree(scan.spill, ignore_errors=True)
    return writer.finish(segment_name(numbering.index), version)


def _event_order(scan: PartScan, numbering: Numbering) -> tuple[np.ndarray | None, tuple | None]:
    """(the order the part's events are written in, None for line order; the runs' users and lengths, None
    when every event is its own user)."""
    if scan.run_users is not None:  # distinct raw users of adjacent runs stay distinct users
        return None, (numbering.run_users, scan.run_lengths)
    if numbering.code_users is not None:
        perm, run_users, run_lengths = _regroup(scan, numbering.code_users, REGROUP_EVENTS)
        return perm, (run_users, run_lengths)
    if "order" in scan.dtypes:  # a click log with time stamps: its examples in time order, then line order
        return np.argsort(read_spill(Path(scan.spill), "order", scan.dtypes["order"]), kind="stable"), None
    return None, None


def _spilled_blocks(scan: PartScan, spilled: str, perm: np.ndarray | None, step: int, width: int | None = None):
    """A spilled column, `step` events at a time, in the order `perm` (gathered chunk by chunk: one column and
    the order in memory) or as spilled; [events, width] blocks for a table of token sequences."""
    dtype, k = scan.dtypes[spilled], width or 1
    shape = (-1,) if width is None else (-1, width)
    if perm is not None:
        whole = read_spill(Path(scan.spill), spilled, dtype).reshape(shape)
        return (whole[perm[a : a + step]] for a in range(0, scan.events, step))
    return (read_spill(Path(scan.spill), spilled, dtype, a * k, step * k).reshape(shape)
            for a in range(0, scan.events, step))


def _regroup(scan: PartScan, code_users: np.ndarray, chunk: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The order that groups a part's events by user, then time, then line; and the runs it makes.

    A counting sort, chunk by chunk: events are bucketed by their user's rank (int32
    positions, stable in line order), then each group of users holding at most `chunk`
    events is sorted by time. Memory: the order (4 bytes per event) and the time stamps
    (8) while they are sorted; never a sort over the whole part.
    """
    spill, events = Path(scan.spill), scan.events
    index = np.int32 if events < 2**31 else np.int64
    codes = len(code_users)
    by_user = np.argsort(code_users, kind="stable")
    rank = np.empty(codes, dtype=index)
    rank[by_user] = np.arange(codes, dtype=index)

    def ranks(a: int) -> np.ndarray:
        return rank[read_spill(spill, "users", scan.dtypes["users"], a, chunk)]

    counts = np.zeros(codes, dtype=np.int64)
    for a in range(0, events, chunk):
        counts += np.bincount(ranks(a), minlength=codes)
    starts = np.concatenate([[0], np.cumsum(counts)])
    cursor = starts[:-1].copy()
    perm = np.empty(events, dtype=index)
    for a in range(0, events, chunk):
        r = ranks(a)
        o = np.argsort(r, kind="stable")
        sorted_r = r[o]
        within = np.arange(r.size) - np.searchsorted(sorted_r, sorted_r, side="left")
        perm[cursor[sorted_r] + within] = a + o
        cursor += np.bincount(r, minlength=codes)
    if "order" in scan.dtypes:
        time = read_spill(spill, "order", scan.dtypes["order"])
        # Groups of whole users, each about `chunk` events (a larger user is a group alone).
        cuts = np.unique(np.searchsorted(starts, np.arange(0, events, chunk), side="right") - 1)
        bounds = np.concatenate([cuts, [codes]])
        for u0, u1 in pairwise(bounds):
            g0, g1 = starts[u0], starts[u1]
            segment = perm[g0:g1]
            local = np.repeat(np.arange(u1 - u0), counts[u0:u1])
            perm[g0:g1] = segment[np.lexsort((time[segment], local))]
        del time
    return perm, code_users[by_user].astype(np.int64), counts


def as_numpy(values: np.ndarray | pa.Array) -> np.ndarray:
    if isinstance(values, np.ndarray):
        return values
    return np.asarray(values.to_numpy(zero_copy_only=False), dtype=str)
