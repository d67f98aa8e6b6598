"""The plan store: every row's tier and home, the inputs that made them, and the summary.

Layout:
    tables/<name>/tier   int8  [rows]   0 single, 1 node, 2 global
    tables/<name>/home   int32 [rows]   device of the (primary) copy
    tables/<name>/partial_ids    int64  node rows copied onto some nodes only (ascending;
    tables/<name>/partial_nodes  int64  only where there are any): a bit per node with a copy
    summary.json                        what `shardflow plan --json` prints
    manifest.json                       written last: strategy, topology, step shape,
                                        budget, the profile it came from, checksum

Arrays and JSON only: shardflow.sharding.stage turns them into plans, topologies and shapes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import zarr

from shardflow.errors import DamagedStore, InputError, first_line
from shardflow.records import parse_record
from storage.checksum import ArrayHash, combine
from storage.dataset import COMPRESSORS
from storage.manifest import read_manifest, write_manifest

KIND = "plan"
FORMAT_VERSION = 1
MADE_BY = "'shardflow plan'"
ROWS_PER_CHUNK = 1 << 22


def write_plan(stage: Path, tables: dict[str, dict[str, np.ndarray]], manifest: dict, summary: dict) -> dict:
    """`tables[name]` = {"tier", "home"[, "partial_ids", "partial_nodes"]: array}; `manifest` the plan's
    description (strategy, topology, step, budget, source), completed with the format, the tables' rows
    and the checksum and written last."""
    root = zarr.open_group(str(stage), mode="w")
    digests = {}
    for name, arrays in tables.items():
        for kind, values in arrays.items():
            if kind.startswith("partial") and not values.size:
                continue
            path = f"tables/{name}/{kind}"
            arr = root.create_array(
                path, shape=values.shape, dtype=values.dtype, chunks=(min(ROWS_PER_CHUNK, values.size),),
                compressors=COMPRESSORS,
            )
            arr[:] = values
            h = ArrayHash(path, arr.dtype, arr.shape)
            h.update(values)
            digests[path] = h.hexdigest()
    (Path(stage) / "summary.json").write_text(json.dumps(summary, indent=2))
    manifest = {
        "format": f"shardflow.{KIND}",
        "format_version": FORMAT_VERSION,
        **manifest,
        "tables": {name: int(arrays["tier"].size) for name, arrays in tables.items()},
        "checksum": combine(digests),
        "digests": digests,
    }
    write_manifest(stage, manifest)
    return manifest


@dataclass(frozen=True)
class PlanSource:
    """The profile a plan was made from, and the lookups per example it assumed."""

    profile: str  # its path, resolved
    profile_checksum: str
    history: int
    negatives: int
    memory_slack: float


@dataclass(frozen=True)
class PlanManifest:
    """A plan store's manifest: what the plan is of, read back typed (the format's own keys are checked by
    read_manifest)."""

    strategy: str
    topology: dict  # a Topology's record (shardflow.planner.topology.parse_topology)
    step: dict  # a StepShape's fields
    budget_bytes_per_device: int
    source: PlanSource
    tables: dict  # table -> rows
    checksum: str
    digests: dict = field(default_factory=dict)  # array path -> sha256 of its content (plans before: none)


def read_plan_manifest(path: str | Path) -> PlanManifest:
    """The manifest of a complete plan store (its strategy, topology, step and tables), without its arrays."""
    return parse_record(PlanManifest, read_manifest(Path(path), KIND, FORMAT_VERSION, MADE_BY),
                        f"{path}/manifest.json")


def read_plan_arrays(path: str | Path) -> tuple[dict[str, dict[str, np.ndarray]], PlanManifest]:
    """({table: {"tier": int8, "home": int32, "partial_ids": int64, "partial_nodes": int64}}, manifest) of a
    complete plan store (the partial arrays empty where the table has none), every array checked against the
    digest written with it: a DamagedStore names the first that differs or cannot be read."""
    path = Path(path)
    m = read_plan_manifest(path)
    root = zarr.open_group(str(path), mode="r")
    tables, digests = {}, {}

    def read(name: str) -> np.ndarray:
        try:
            arr = root[name]
        except KeyError:
            raise InputError(f"{path}: array {name!r} is missing; the manifest lists it") from None
        try:
            values = arr[:]
        except (RuntimeError, ValueError, OSError) as e:
            raise DamagedStore(f"{path}/{name}: unreadable ({first_line(e)}); accepted: the plan as {MADE_BY} wrote "
                               "it (plan again)", f"{path}/{name}") from None
        h = ArrayHash(name, arr.dtype, arr.shape)
        h.update(values)
        digests[name] = h.hexdigest()
        if name in m.digests and m.digests[name] != digests[name]:
            raise DamagedStore(f"{path}/{name}: its content does not match the manifest's digest (changed after it "
                               f"was written); accepted: the plan as {MADE_BY} wrote it (plan again)", f"{path}/{name}")
        return values

    for name in m.tables:
        base = f"tables/{name}"
        tier, home = read(f"{base}/tier"), read(f"{base}/home")
        group = root[base]
        partial = {f: read(f"{base}/{f}").astype(np.int64) if f in group else np.zeros(0, np.int64)
                   for f in ("partial_ids", "partial_nodes")}
        tables[name] = {"tier": tier.astype(np.int8), "home": home.astype(np.int32), **partial}
    if combine(digests) != m.checksum:
        raise DamagedStore(f"{path}: its arrays do not match the manifest's checksum (changed after they were "
                           f"written); accepted: the plan as {MADE_BY} wrote it (plan again)", str(path))
    return tables, m


def read_summary(path: str | Path) -> dict:
    """What `shardflow plan --json` printed for the plan stored at `path` (its modeled traffic and time)."""
    return json.loads((Path(path) / "summary.json").read_text())
