"""When each uplink of the emulated network is busy, and the rate it carries its bytes at then.

A thread inside the hub's namespace reads the byte counters of every node's port (the hub's end
of the node's veth: what it transmits is the node's ingress, what it receives the node's egress,
both already through their shapers) every few milliseconds. Each link is read at its own
resolution: intervals of at least PACKETS_PER_INTERVAL of the largest packets (MAX_PACKET_BYTES:
the veth segments late) at its shaped rate (5 ms at 208 Mbit/s, 26 ms at 40 Mbit/s); a shorter
interval would see a busy link as bursts of one packet between empty intervals, a longer one
counts the idle gaps between a step's rounds as busy. An interval in which a direction carried
at least BUSY_SHARE of what its shaped rate moves in that interval counts as busy: the bytes of
an idle link's acks and keep-alives stay below it.

A direction's rate while busy is taken over the inner intervals of its busy runs (those whose
neighbours are busy too): a transfer starts and ends inside the first and last interval of its
run, so those are partly idle and would count idle time as busy. Sample times are read, not
assumed: a sample taken late on a loaded machine makes a longer interval, not a wrong rate.
They are time.monotonic's (CLOCK_MONOTONIC, the host's one clock for every process), so `use` can
count only a window another process stamped, such as a command's training steps (an interval the
window cuts counts with its share of the time and, as if evenly spread, of the bytes).
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from dataclasses import dataclass
from itertools import pairwise

from shardflow.emulation.network import Network

MAX_PACKET_BYTES = 64 << 10
PACKETS_PER_INTERVAL = 2
MIN_SAMPLE_S = 0.002  # the monitor's thread samples no faster, however fast a link
BUSY_SHARE = 0.1
CLONE_NEWNET = 0x40000000


@dataclass(frozen=True)
class LinkUse:
    """One direction of one uplink over a watch: every byte; the busy intervals' seconds; the inner busy
    intervals' bytes and seconds, from which its rate while busy."""

    bytes: int
    busy_s: float
    inner_bytes: int
    inner_s: float

    @property
    def busy_bytes_per_s(self) -> float:
        return self.inner_bytes / self.inner_s if self.inner_s > 0 else float("nan")


def resolution_s(shaped_bytes_per_s: float) -> float:
    """The shortest interval a link of this shaped rate is read over."""
    return PACKETS_PER_INTERVAL * MAX_PACKET_BYTES / shaped_bytes_per_s


def _enter_namespace(namespace: str) -> None:
    """Move the calling thread (only it) into `namespace`'s network."""
    fd = os.open(f"/run/netns/{namespace}", os.O_RDONLY)
    try:
        if ctypes.CDLL(None, use_errno=True).setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {namespace}")
    finally:
        os.close(fd)


def _counters(ports: frozenset[str]) -> dict[str, tuple[int, int]]:
    """Port -> (received, transmitted) bytes, from the calling thread's namespace."""
    out = {}
    with open("/proc/thread-self/net/dev") as f:
        for line in f.readlines()[2:]:
            name, _, fields = line.partition(":")
            name = name.strip()
            if name in ports:
                values = fields.split()
                out[name] = (int(values[0]), int(values[8]))
    return out


class UplinkMonitor:
    """`with UplinkMonitor(network) as watch: ...`, then `watch.use()`: per node, (egress, ingress) LinkUse."""

    def __init__(self, network: Network):
        self.network = network
        self.interval_s = max(MIN_SAMPLE_S, min(resolution_s(n.uplink_bytes_per_s) for n in network.nodes))
        self._ports = frozenset(network.port(k) for k in range(len(network.nodes)))
        self._samples: list[tuple[float, dict[str, tuple[int, int]]]] = []
        self._stop = threading.Event()
        self._failed: BaseException | None = None
        self._thread = threading.Thread(target=self._watch, name="uplink-monitor", daemon=True)

    def __enter__(self) -> UplinkMonitor:
        self._thread.start()
        while not self._samples and self._thread.is_alive():
            time.sleep(self.interval_s)
        self._raise_if_failed()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._raise_if_failed()

    def _raise_if_failed(self) -> None:
        if self._failed is not None:
            raise OSError(f"the uplink monitor stopped: {self._failed}") from self._failed

    def _watch(self) -> None:
        try:
            _enter_namespace(self.network.hub)
            while True:
                self._samples.append((time.monotonic(), _counters(self._ports)))
                if self._stop.wait(self.interval_s):
                    self._samples.append((time.monotonic(), _counters(self._ports)))
                    return
        except BaseException as e:  # reported to the watcher's thread on exit
            self._failed = e

    def use(self, window: tuple[float, float] | None = None,
            interval_s: float | None = None) -> dict[str, tuple[LinkUse, LinkUse]]:
        """Per node name: its uplink's (egress, ingress) over the watch, or over `window` (time.monotonic
        seconds: from, to) only; in intervals of `interval_s` if given (else each link's resolution_s)."""
        out = {}
        for k, node in enumerate(self.network.nodes):
            port = self.network.port(k)
            # the port receives what the node sends (egress) and transmits what it gets (ingress)
            out[node.name] = tuple(
                link_use([(t, counters[port][side]) for t, counters in self._samples], node.uplink_bytes_per_s,
                         window, interval_s)
                for side in (0, 1))
        return out


def link_use(samples: list[tuple[float, int]], shaped_bytes_per_s: float,
             window: tuple[float, float] | None = None, interval_s: float | None = None) -> LinkUse:
    """One direction's use from its (time, byte counter) samples, over `window` (from, to) if given, in
    intervals of at least `interval_s` (the link's resolution_s unless given)."""
    samples = _coarsened(samples, resolution_s(shaped_bytes_per_s) if interval_s is None else interval_s)
    spans = []  # (seconds, bytes) of each interval, the share of it inside the window
    for (t0, before), (t1, after) in pairwise(samples):
        start, end = (t0, t1) if window is None else (max(t0, window[0]), min(t1, window[1]))
        if end > start:
            spans.append((end - start, (after - before) * (end - start) / (t1 - t0)))
    busy = [moved >= BUSY_SHARE * shaped_bytes_per_s * s for s, moved in spans]
    inner = [i for i in range(1, len(spans) - 1) if busy[i - 1] and busy[i] and busy[i + 1]]
    return LinkUse(bytes=round(sum(moved for _, moved in spans)),
                   busy_s=sum(s for (s, _), b in zip(spans, busy, strict=True) if b),
                   inner_bytes=round(sum(spans[i][1] for i in inner)), inner_s=sum(spans[i][0] for i in inner))


def _coarsened(samples: list[tuple[float, int]], interval_s: float) -> list[tuple[float, int]]:
    """The samples that make intervals of at least `interval_s`, and the last one (no byte is left out)."""
    if not samples:
        return samples
    kept = [samples[0]]
    for sample in samples[1:]:
        if sample[0] - kept[-1][0] >= interval_s:
            kept.append(sample)
    if kept[-1] is not samples[-1]:
        kept.append(samples[-1])
    return kept
