"""A dataset store's manifest as typed records: what it declares (DatasetInfo), each part's segment
(Segment), the checksum that covers both, and the note that a writer hashed what it wrote.

storage.dataset reads and verifies a store against these; storage.dataset_writer and
storage.importers write them.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from shardflow.errors import InputError
from storage.checksum import combine
from storage.manifest import MANIFEST
from storage.tables import TableSpec

KIND = "dataset"
FORMAT_VERSION = 2
MADE_BY = "'shardflow import' or 'shardflow synth'"
SEGMENTS = "segments"
VERIFIED = "verified.json"  # the manifest whose arrays were last hashed and found matching
# What a manifest declares about its arrays (and each segment's name, events, runs, new
# users); covered by its checksum beside the arrays' digests, not the import history.
DECLARED = ("users", "interactions", "sequence_table", "tables", "dense", "labels")


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
    version: int = 1
    # A table of token sequences (genres) -> the most ids an event holds: its column is [events, width], -1 padding.
    widths: dict = field(default_factory=dict)

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


@dataclass(frozen=True)
class Segment:
    """One part's segment as the manifest lists it (in import order)."""

    name: str  # its directory under segments/
    version: int  # the store version that wrote it
    events: int
    runs: int  # a run: one user's consecutive events in the part
    new_users: int  # users this part introduced
    arrays: dict  # array path in the segment -> sha256 of its content

    @property
    def checksum(self) -> str:
        """The digest of its content: equal for two stores only if every array is."""
        return combine(self.arrays)


def dataset_checksum(segments: list[dict], manifest: dict) -> str:
    """The digests of every segment's arrays and of what the manifest declares about them.

    A manifest edited to claim other rows, users or columns no longer matches its checksum.
    """
    declared = {k: manifest[k] for k in DECLARED}
    declared["segments"] = [{k: s[k] for k in ("name", "events", "runs", "new_users")} for s in segments]
    declared = json.dumps(declared, sort_keys=True).encode()
    return combine({
        **{f"{SEGMENTS}/{s['name']}": combine(s["arrays"]) for s in segments},
        "declared": hashlib.sha256(declared).hexdigest(),
    })


def record_verified(store: Path) -> None:
    """Note that the arrays of `store` match its manifest (its writer hashed them as it wrote)."""
    digest = hashlib.sha256((Path(store) / MANIFEST).read_bytes()).hexdigest()
    tmp = Path(store) / f".{VERIFIED}.tmp-{os.getpid()}"
    tmp.write_text(json.dumps({"manifest_sha256": digest}))
    os.replace(tmp, Path(store) / VERIFIED)
