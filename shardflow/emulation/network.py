"""The emulated network: one Linux network namespace per node of a topology, joined through a hub.

    hub namespace ── bridge br0 (10.213.0.1) ── port pK ═ veth ═ uplink (10.213.0.1K) ── node K's namespace

A node's uplink is shaped in both directions to the topology's uplink rate divided by the
time scale: its egress on the node's end of the veth, its ingress on the hub's end (what
the bridge sends towards the node). Traffic between two devices of one node stays inside
the node's namespace and goes over its loopback, shaped to the intra-node rate divided by
the same factor. The hub holds the Dask scheduler and the command that drives the run
(its traffic to a node crosses that node's uplink, as a head node's would).

Every namespace this module makes is named `sfe<pid>-…` after the process that made it;
`remove` deletes them (and with them every interface and qdisc inside), and `sweep`
deletes those whose process is gone (one killed with SIGKILL had no chance to clean up).
Addresses live only on interfaces made here, inside these namespaces: nothing on the
host's own interfaces changes.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass

from shardflow.errors import InputError
from shardflow.planner.topology import Topology

PREFIX = "sfe"
SUBNET = "10.213.0"
HUB_ADDRESS = f"{SUBNET}.1"
FIRST_NODE_HOST = 11  # node K is SUBNET.(11+K): two digits, so addresses sort as the nodes do
# Where the emulated cluster listens: the scheduler in the hub, device d's worker at WORKER_PORT + d in its node.
# Reserved in every namespace made here (net.ipv4.ip_local_reserved_ports, one per namespace), so no connection
# takes one as its local port first: a worker then failed to start on a loaded machine, "Address already in use".
SCHEDULER_PORT = 8786
WORKER_PORT = 40000
RESERVED_PORTS = f"{SCHEDULER_PORT},{WORKER_PORT}-{WORKER_PORT + 999}"
MAX_NODES = 99 - FIRST_NODE_HOST + 1
UPLINK = "uplink"  # the node's end of its veth
BURST_S = 0.004  # a shaped link's bucket: this many seconds of its rate (at least two loopback frames)
MIN_BURST_BYTES = 2 * 65536
QUEUE_S = 0.5  # a shaped link's queue holds this many seconds of its rate (in 1514-byte frames) ...
QUEUE_MIN_PACKETS = 100  # ... and at least this many packets
QUANTUM = "70000"  # bytes a class sends per turn: above the loopback's 64 KiB frames
SMALL_PACKET = 128  # IP packets under this many bytes go first: acks, requests of a few ids


def cannot_emulate() -> str | None:
    """Why this machine cannot build an emulated cluster, in one line; None when it can."""
    if os.geteuid() != 0:
        return "the emulated cluster needs root (network namespaces, veth pairs and tc)"
    missing = [tool for tool in ("ip", "tc", "sysctl") if shutil.which(tool) is None]
    if missing:
        return f"the emulated cluster needs {', '.join(missing)} (iproute2, procps), not found on PATH"
    return None


# The slowest rate a link is shaped to: 8,000 bit/s, the floor `shape` gives its small-packet class (tc rounds a
# rate under 1 bit/s to 0 and refuses it: a time scale of 1e30 ended in an OSError traceback).
MIN_RATE_BYTES_PER_S = 1000


def check_time_scale(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 1 <= value < math.inf:
        raise InputError(f"time scale {value!r}; accepted: a finite number >= 1 (link rates are divided by it)")
    return float(value)


def check_shaped_rates(topology: Topology, time_scale: float) -> None:
    """Refuse a time scale that would shape a link of `topology` under MIN_RATE_BYTES_PER_S, naming the largest."""
    slowest = min(topology.intra_node_gbytes_per_s, *(n.uplink_gbytes_per_s for n in topology.nodes)) * 1e9
    if slowest / time_scale < MIN_RATE_BYTES_PER_S:
        raise InputError(f"time scale {time_scale:g}: the slowest link would be shaped to {slowest / time_scale:.3g} "
                         f"bytes/s; accepted: a time scale up to {slowest / MIN_RATE_BYTES_PER_S:,.0f} for this "
                         f"topology (links are shaped to {MIN_RATE_BYTES_PER_S:,} bytes/s at the least)")


def _run(*argv: str) -> str:
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise OSError(f"{' '.join(argv)}: {done.stderr.strip() or f'exit {done.returncode}'}")
    return done.stdout


def namespaces() -> list[str]:
    out = _run("ip", "-j", "netns", "list")
    return [entry["name"] for entry in json.loads(out or "[]")]


def _owner(namespace: str) -> int | None:
    m = re.fullmatch(rf"{PREFIX}(\d+)-.+", namespace)
    return int(m.group(1)) if m else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_on_stop_signals() -> None:
    """Make Ctrl-C and SIGTERM end this process through its `with` blocks, so a harness removes what it made
    (SIGTERM's default kills at once: namespaces left to the next `sweep`, temporary folders for good). SIGTERM
    exits with 128 + its number; Ctrl-C raises KeyboardInterrupt even where the parent ignored it (a shell's
    background job, a supervisor: Python keeps an inherited SIG_IGN)."""
    signal.signal(signal.SIGTERM, lambda signum, _: sys.exit(128 + signum))
    signal.signal(signal.SIGINT, signal.default_int_handler)


def sweep() -> list[str]:
    """Delete the namespaces left by emulated clusters whose process is gone; their names."""
    stale = [ns for ns in namespaces() if (pid := _owner(ns)) is not None and not _alive(pid)]
    for ns in stale:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    return stale


def shape(namespace: str, device: str, bytes_per_s: float, first: bool = True) -> None:
    """Shape what `device` sends to `bytes_per_s`: an HTB class at that rate with two queues, small packets
    (under SMALL_PACKET bytes: TCP's acks, a request of a few ids) ahead of bulk. One FIFO would hold the
    acks of the other direction's data behind up to a queue's worth of this direction's, and a link
    carrying rows both ways (a reply round) would run far below its rate while a real NIC, whose queue
    is a few packets deep, does not. With `first` False the classes of an earlier call change rate in
    place (a link slowed mid-run loses no queued packet)."""
    rate = f"{int(bytes_per_s * 8)}bit"
    burst = str(max(MIN_BURST_BYTES, int(bytes_per_s * BURST_S)))
    tc = ("tc", "-n", namespace)
    verb = "add" if first else "change"
    if first:
        _run(*tc, "qdisc", "add", "dev", device, "root", "handle", "1:", "htb", "default", "20")
    _run(*tc, "class", verb, "dev", device, "parent", "1:", "classid", "1:1", "htb", "rate", rate, "ceil", rate,
         "burst", burst, "cburst", burst, "quantum", QUANTUM)
    for classid, share, prio in (("1:10", 0.1, "0"), ("1:20", 0.9, "1")):
        _run(*tc, "class", verb, "dev", device, "parent", "1:1", "classid", classid, "htb",
             "rate", f"{max(int(bytes_per_s * 8 * share), 8000)}bit", "ceil", rate, "burst", burst, "cburst", burst,
             "prio", prio, "quantum", QUANTUM)
        if first:
            queue = str(max(QUEUE_MIN_PACKETS, int(bytes_per_s * QUEUE_S / 1514)))
            _run(*tc, "qdisc", "add", "dev", device, "parent", classid, "pfifo", "limit", queue)
    if first:
        _run(*tc, "filter", "add", "dev", device, "parent", "1:", "protocol", "ip", "prio", "1", "u32",
             "match", "u16", "0x0000", f"0x{0x10000 - SMALL_PACKET:04x}", "at", "2", "flowid", "1:10")


@dataclass(frozen=True)
class Endpoint:
    namespace: str
    address: str


@dataclass(frozen=True)
class EmulatedNode:
    name: str
    namespace: str
    address: str
    devices: int
    uplink_bytes_per_s: float  # as shaped: the topology's rate over the time scale


class Network:
    """The namespaces, links and shaping of one topology; `build`, then `remove` (idempotent)."""

    def __init__(self, topology: Topology, time_scale: float):
        check_time_scale(time_scale)
        if len(topology.nodes) > MAX_NODES:
            raise InputError(f"topology of {len(topology.nodes)} nodes; accepted: at most {MAX_NODES} emulated nodes")
        self.topology = topology
        self.time_scale = float(time_scale)
        tag = f"{PREFIX}{os.getpid()}"
        self.hub = f"{tag}-hub"
        self.nodes = tuple(
            EmulatedNode(node.name, f"{tag}-n{k}", f"{SUBNET}.{FIRST_NODE_HOST + k}", node.devices,
                         node.uplink_gbytes_per_s * 1e9 / self.time_scale)
            for k, node in enumerate(topology.nodes)
        )
        self.intra_bytes_per_s = topology.intra_node_gbytes_per_s * 1e9 / self.time_scale
        check_shaped_rates(topology, self.time_scale)
        self._made: list[str] = []

    def endpoint(self, k: int | None) -> Endpoint:
        """Where node k's processes listen; the hub's for None."""
        if k is None:
            return Endpoint(self.hub, HUB_ADDRESS)
        return Endpoint(self.nodes[k].namespace, self.nodes[k].address)

    def build(self) -> None:
        reason = cannot_emulate()
        if reason:
            raise InputError(reason)
        sweep()
        try:
            self._add(self.hub)
            _run("ip", "-n", self.hub, "link", "add", "br0", "type", "bridge")
            _run("ip", "-n", self.hub, "addr", "add", f"{HUB_ADDRESS}/24", "dev", "br0")
            _run("ip", "-n", self.hub, "link", "set", "br0", "up")
            for k, node in enumerate(self.nodes):
                port = self.port(k)
                self._add(node.namespace)
                _run("ip", "-n", self.hub, "link", "add", port, "type", "veth",
                     "peer", "name", UPLINK, "netns", node.namespace)
                _run("ip", "-n", self.hub, "link", "set", port, "master", "br0")
                _run("ip", "-n", self.hub, "link", "set", port, "up")
                _run("ip", "-n", node.namespace, "addr", "add", f"{node.address}/24", "dev", UPLINK)
                _run("ip", "-n", node.namespace, "link", "set", UPLINK, "up")
                self.shape_uplink(k, node.uplink_bytes_per_s, first=True)
                shape(node.namespace, "lo", self.intra_bytes_per_s)
        except BaseException:
            self.remove()
            raise

    def _add(self, namespace: str) -> None:
        _run("ip", "netns", "add", namespace)
        self._made.append(namespace)
        _run("ip", "-n", namespace, "link", "set", "lo", "up")
        _run("ip", "netns", "exec", namespace, "sysctl", "-qw", f"net.ipv4.ip_local_reserved_ports={RESERVED_PORTS}")

    @staticmethod
    def port(k: int) -> str:
        """The hub's end of node k's veth, on the bridge: it sends what node k receives."""
        return f"p{k}"

    def shape_uplink(self, k: int, bytes_per_s: float, first: bool = False) -> None:
        """Node k's uplink, both ways, at `bytes_per_s` (already scaled): to slow a link mid-run, or to restore it."""
        shape(self.nodes[k].namespace, UPLINK, bytes_per_s, first)
        shape(self.hub, self.port(k), bytes_per_s, first)

    def cut(self, k: int, cut: bool = True) -> None:
        """Take node k's uplink down (every connection through it stalls), or bring it back up."""
        _run("ip", "-n", self.hub, "link", "set", self.port(k), "down" if cut else "up")

    def uplink_bytes(self) -> dict[str, tuple[int, int]]:
        """Per node: bytes its uplink has sent and received so far (the node's end of the veth)."""
        out = {}
        for node in self.nodes:
            (link,) = json.loads(_run("ip", "-n", node.namespace, "-j", "-s", "link", "show", UPLINK))
            stats = link["stats64"]
            out[node.name] = (int(stats["tx"]["bytes"]), int(stats["rx"]["bytes"]))
        return out

    def remove(self) -> None:
        for namespace in reversed(self._made):
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True)
        self._made.clear()
