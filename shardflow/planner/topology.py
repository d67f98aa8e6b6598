"""The cluster as the planner sees it: nodes of devices, fast links inside, uneven uplinks between."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from shardflow.errors import InputError
from shardflow.safe_yaml import load_file

MAX_DEVICES = 4096


@dataclass(frozen=True)
class Node:
    name: str
    devices: int
    uplink_gbytes_per_s: float


@dataclass(frozen=True)
class Topology:
    """Devices are numbered node by node: node 0 holds devices 0..n0-1, and so on."""

    nodes: tuple[Node, ...]
    intra_node_gbytes_per_s: float
    device_memory_bytes: int | None = None

    def __post_init__(self) -> None:
        if not self.nodes:
            raise InputError("topology: no nodes; accepted: a list of at least one node")
        names = [n.name for n in self.nodes]
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})
            raise InputError(f"topology: node names repeat: {dup}; accepted: unique names")
        for n in self.nodes:
            if isinstance(n.devices, bool) or not isinstance(n.devices, int) or n.devices < 1:
                raise InputError(f"topology: node '{n.name}' has devices = {n.devices!r}; accepted: an integer >= 1")
            _positive(n.uplink_gbytes_per_s, f"node '{n.name}' uplink_gbytes_per_s")
        _positive(self.intra_node_gbytes_per_s, "intra_node_gbytes_per_s")
        if self.device_memory_bytes is not None and (
            isinstance(self.device_memory_bytes, bool)
            or not isinstance(self.device_memory_bytes, int)
            or self.device_memory_bytes < 1
        ):
            raise InputError(
                f"topology: device_memory_bytes = {self.device_memory_bytes!r}; accepted: an integer >= 1 or absent"
            )

    @property
    def devices(self) -> int:
        return sum(n.devices for n in self.nodes)

    def to_dict(self) -> dict[str, Any]:
        """The topology as its YAML file holds it (parse_topology reads it back)."""
        return {
            "intra_node_gbytes_per_s": self.intra_node_gbytes_per_s,
            "nodes": [dataclasses.asdict(n) for n in self.nodes],
            **({"device_memory_bytes": self.device_memory_bytes} if self.device_memory_bytes else {}),
        }

    # The arrays below are computed once per topology (the planner's inner loops read them per table pass) and
    # read-only, as the topology is.
    @functools.cached_property
    def node_of_device(self) -> np.ndarray:
        return _read_only(np.repeat(np.arange(len(self.nodes)), [n.devices for n in self.nodes]))

    @functools.cached_property
    def node_start(self) -> np.ndarray:
        """First device of every node."""
        return _read_only(np.concatenate([[0], np.cumsum([n.devices for n in self.nodes])[:-1]]).astype(np.int64))

    @functools.cached_property
    def node_devices(self) -> np.ndarray:
        return _read_only(np.array([n.devices for n in self.nodes], dtype=np.int64))

    @functools.cached_property
    def uplink_bytes_per_s(self) -> np.ndarray:
        return _read_only(np.array([n.uplink_gbytes_per_s for n in self.nodes], dtype=np.float64) * 1e9)

    @property
    def intra_bytes_per_s(self) -> float:
        return self.intra_node_gbytes_per_s * 1e9


def _read_only(array: np.ndarray) -> np.ndarray:
    array.flags.writeable = False
    return array


def _positive(value: object, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not np.isfinite(value) or value <= 0:
        raise InputError(f"topology: {what} = {value!r}; accepted: a number > 0 (GB/s)")


def uniform(nodes: int, devices_per_node: int, uplink: float, intra: float = 600.0) -> Topology:
    """`nodes` equal nodes (the benchmark's shapes)."""
    return Topology(
        tuple(Node(f"n{i}", devices_per_node, float(uplink)) for i in range(nodes)), float(intra)
    )


def parse_topology(data: object, where: str = "topology") -> Topology:
    if not isinstance(data, dict):
        raise InputError(
            f"{where}: a {type(data).__name__}; accepted: a mapping with 'nodes' and 'intra_node_gbytes_per_s'"
        )
    known = {"nodes", "intra_node_gbytes_per_s", "device_memory_bytes"}
    unknown = sorted(set(data) - known)
    if unknown:
        raise InputError(f"{where}: unknown keys {unknown}; accepted: {sorted(known)}")
    for key in ("nodes", "intra_node_gbytes_per_s"):
        if key not in data:
            raise InputError(f"{where}: '{key}' is missing")
    if not isinstance(data["nodes"], list):
        raise InputError(f"{where}: nodes is a {type(data['nodes']).__name__}; accepted: a list of nodes")
    nodes = []
    for i, n in enumerate(data["nodes"]):
        if not isinstance(n, dict) or set(n) != {"name", "devices", "uplink_gbytes_per_s"}:
            raise InputError(
                f"{where}: nodes[{i}] = {n!r}; accepted: {{name: str, devices: int, uplink_gbytes_per_s: number}}"
            )
        if not str(n["name"]).strip():
            raise InputError(f"{where}: nodes[{i}] name {n['name']!r}; accepted: a name that is not empty")
        nodes.append(Node(str(n["name"]), n["devices"], n["uplink_gbytes_per_s"]))
    devices = sum(n.devices if isinstance(n.devices, int) else 0 for n in nodes)
    if devices > MAX_DEVICES:
        raise InputError(
            f"{where}: {devices:,} devices; accepted: at most {MAX_DEVICES:,} (the planner holds device × device "
            "traffic matrices)"
        )
    return Topology(tuple(nodes), data["intra_node_gbytes_per_s"], data.get("device_memory_bytes"))


def load_topology(path: str | Path) -> Topology:
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{path}: no such topology file; accepted: a YAML file (see docs/sharding.md, Topology)")
    return parse_topology(load_file(path, "topology"), str(path))
