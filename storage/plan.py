"""The plan store: every row's tier and home, the inputs that made them, and the summary.

Layout:
    tables/<name>/tier   int8  [rows]   0 single, 1 node, 2 global
    tables/<name>/home   int32 [rows]   device of the (primary) copy
    summary.json                        what `shardflow plan --json` prints
    manifest.json                       written last: strategy, topology, step shape,
                                        budget, the profile it came from, checksum
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import zarr

from shardflow.errors import InputError
from shardflow.planner.costmodel import StepShape
from shardflow.planner.plan import ShardingPlan, TablePlan, check_plan
from shardflow.planner.topology import Topology, parse_topology
from storage.checksum import ArrayHash, combine
from storage.dataset import COMPRESSORS
from storage.manifest import read_manifest, write_manifest

KIND = "plan"
FORMAT_VERSION = 1
MADE_BY = "'shardflow plan'"
ROWS_PER_CHUNK = 1 << 22


def topology_dict(topology: Topology) -> dict:
    return {
        "intra_node_gbytes_per_s": topology.intra_node_gbytes_per_s,
        "nodes": [dataclasses.asdict(n) for n in topology.nodes],
        **({"device_memory_bytes": topology.device_memory_bytes} if topology.device_memory_bytes else {}),
    }


def write_plan(
    stage: Path, plan: ShardingPlan, topology: Topology, shape: StepShape, budget_bytes: int, source: dict, summary: dict
) -> dict:
    root = zarr.open_group(str(stage), mode="w")
    digests = {}
    for t in plan.tables:
        for field, values in (("tier", t.tier), ("home", t.home)):
            path = f"tables/{t.name}/{field}"
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
        "strategy": plan.strategy,
        "topology": topology_dict(topology),
        "step": dataclasses.asdict(shape),
        "budget_bytes_per_device": int(budget_bytes),
        "tables": {t.name: t.rows for t in plan.tables},
        "source": source,
        "checksum": combine(digests),
    }
    write_manifest(stage, manifest)
    return manifest


def read_plan(path: str | Path) -> tuple[ShardingPlan, Topology, StepShape, dict]:
    """(plan, topology, step shape, manifest) of a complete plan store."""
    path = Path(path)
    m = read_manifest(path, KIND, FORMAT_VERSION, MADE_BY)
    topology = parse_topology(m["topology"], f"{path}/manifest.json topology")
    shape = StepShape(**m["step"])
    root = zarr.open_group(str(path), mode="r")
    tables = []
    for name in m["tables"]:
        try:
            tier, home = root[f"tables/{name}/tier"][:], root[f"tables/{name}/home"][:]
        except KeyError:
            raise InputError(f"{path}: arrays of table '{name}' are missing; the manifest lists them") from None
        tables.append(TablePlan(name, tier.astype(np.int8), home.astype(np.int32)))
    plan = ShardingPlan(m["strategy"], tuple(tables))
    check_plan(plan, m["tables"], topology)
    return plan, topology, shape, m
