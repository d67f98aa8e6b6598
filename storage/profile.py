"""The profile store: per-row access counts of every table of one dataset.

Layout:
    counts/<table>   int64 [rows]   times each row occurs in the dataset
    manifest.json                   the dataset it profiles, per-table skew statistics
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import zarr

from shardflow.errors import DamagedStore, InputError, first_line
from shardflow.records import parse_record, plain
from storage.checksum import ArrayHash, combine
from storage.dataset import COMPRESSORS
from storage.manifest import read_manifest, write_manifest

KIND = "profile"
FORMAT_VERSION = 1
MADE_BY = "'shardflow profile'"
ROWS_PER_CHUNK = 1 << 22


def start_profile(stage: Path) -> None:
    zarr.open_group(str(stage), mode="w")


def write_counts(stage: str | Path, table: str, counts: np.ndarray) -> str:
    """Write one table's counts (its only writer); returns their content digest."""
    path = f"counts/{table}"
    arr = zarr.open_group(str(stage), mode="a").create_array(
        path,
        shape=counts.shape,
        dtype=np.int64,
        chunks=(min(ROWS_PER_CHUNK, counts.size),),
        compressors=COMPRESSORS,
    )
    arr[:] = counts
    h = ArrayHash(path, arr.dtype, arr.shape)
    h.update(counts)
    return h.hexdigest()


@dataclass(frozen=True)
class TableStats:
    """How skewed the accesses to one table are (shardflow.profiling.counting.table_stats), as a profile's
    manifest keeps them under its table's name."""

    rows: int
    accesses: int
    distinct: int  # rows read at least once
    top1pct_share: float  # of all accesses, to the most-read 1% of the rows read
    top10pct_share: float
    zipf_slope: float

    def to_dict(self) -> dict:
        return asdict(self)


def finish_profile(stage: Path, dataset: ProfiledDataset, stats: dict[str, TableStats],
                   digests: dict[str, str]) -> ProfileManifest:
    """The manifest, written last: `stats[table]` is that table's figures (rows, accesses, skew)."""
    named = {f"counts/{name}": d for name, d in digests.items()}
    manifest = ProfileManifest(dataset, stats, combine(named), named)
    write_manifest(stage, manifest.record())
    return manifest


@dataclass(frozen=True)
class Window:
    """What a profile of a model version's training window counted: the examples of parts `first_part` on,
    each reading a `history`-item history (a whole log's profile: part 0 on, no history), each user's last
    `held` events kept out of training (2 with a validation split; a profile from before the key: 1)."""

    first_part: int = 0
    history: int | None = None
    examples: int | None = None  # with item_lookups: the item sequence's lookups per example, counted
    item_lookups: int | None = None
    held: int = 1


@dataclass(frozen=True)
class ProfiledDataset:
    """The dataset a profile counts, as its manifest records it."""

    path: str
    checksum: str
    window: Window = field(default_factory=Window)


@dataclass(frozen=True)
class ProfileManifest:
    """What a profile store's manifest says: the dataset (and window) it counts, every table's figures, and the
    checksum of its counts."""

    dataset: ProfiledDataset
    tables: dict[str, TableStats]
    checksum: str
    digests: dict[str, str] = field(default_factory=dict)  # "counts/<table>" -> its sha256 (profiles before: none)

    @classmethod
    def parse(cls, manifest: dict, where: str) -> ProfileManifest:
        return cls(parse_record(ProfiledDataset, manifest.get("dataset"), f"{where} dataset"),
                   {name: parse_record(TableStats, s, f"{where} tables.{name}")
                    for name, s in manifest["tables"].items()},
                   manifest["checksum"], dict(manifest.get("digests", {})))

    def record(self) -> dict:
        return {"format": f"shardflow.{KIND}", "format_version": FORMAT_VERSION, "dataset": plain(self.dataset),
                "tables": {name: s.to_dict() for name, s in self.tables.items()}, "checksum": self.checksum,
                "digests": self.digests}


class Profile:
    """A complete profile store, validated when opened."""

    def __init__(self, path: Path, manifest: dict) -> None:
        self.path = Path(path)
        self.manifest = ProfileManifest.parse(manifest, f"{path}/manifest.json")
        self.dataset = self.manifest.dataset
        self.stats = self.manifest.tables  # table -> its figures
        self.rows = {name: s.rows for name, s in self.stats.items()}

    @classmethod
    def open(cls, path: str | Path) -> Profile:
        path = Path(path)
        manifest = read_manifest(path, KIND, FORMAT_VERSION, MADE_BY)
        try:
            profile = cls(path, manifest)
        except (KeyError, TypeError, ValueError) as e:
            raise InputError(f"{path}/manifest.json: malformed profile manifest ({type(e).__name__}: {e})") from None
        root = zarr.open_group(str(path), mode="r")
        for name in profile.stats:
            try:
                arr = root[f"counts/{name}"]
            except KeyError:
                raise InputError(f"{path}: array 'counts/{name}' is missing; the manifest lists it") from None
            if arr.dtype != np.int64 or arr.shape != (profile.rows[name],):
                raise InputError(f"{path}/counts/{name}: {arr.dtype} {arr.shape}; accepted: int64 "
                                 f"({profile.rows[name]},) as the manifest says")
        profile._verify(root)
        return profile

    def _verify(self, root) -> None:
        """Every table's counts against the digests written with them (a DamagedStore naming the first that
        differs or cannot be read)."""
        digests = {}
        for name in self.stats:
            key, where = f"counts/{name}", f"{self.path}/counts/{name}"
            arr = root[key]
            try:
                values = arr[:]
            except (RuntimeError, ValueError, OSError) as e:
                raise DamagedStore(f"{where}: unreadable ({first_line(e)}); accepted: the profile as {MADE_BY} "
                                   "wrote it (profile again)", where) from None
            h = ArrayHash(key, arr.dtype, arr.shape)
            h.update(values)
            digests[key] = h.hexdigest()
            if self.manifest.digests.get(key, digests[key]) != digests[key]:
                raise DamagedStore(f"{where}: its content does not match the manifest's digest (changed after it "
                                   f"was written); accepted: the profile as {MADE_BY} wrote it (profile again)", where)
        if combine(digests) != self.manifest.checksum:
            raise DamagedStore(f"{self.path}: its counts do not match the manifest's checksum (changed after they "
                               f"were written); accepted: the profile as {MADE_BY} wrote it (profile again)",
                               str(self.path))

    def counts(self, table: str) -> np.ndarray:
        if table not in self.stats:
            raise InputError(f"no table {table!r} in profile {self.path}; accepted: {', '.join(self.stats)}")
        return zarr.open_array(str(self.path / "counts" / table), mode="r")[:]
