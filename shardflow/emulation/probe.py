"""What a link of the emulated network really carries: one TCP stream from one node to another, timed.

The receiver times from its first byte to its last, so the figure is the stream's rate
while it flows (the connection's set-up is left out).
"""

from __future__ import annotations

import subprocess
import sys

from shardflow.emulation.network import Network

PROBE_PORT = 39000

_RECEIVE = """
import socket, sys, time
with socket.create_server((sys.argv[1], int(sys.argv[2]))) as s:
    print("ready", flush=True)
    conn, _ = s.accept()
    with conn:
        first = conn.recv(1 << 20)
        start, got = time.perf_counter(), 0
        while chunk := conn.recv(1 << 20):
            got += len(chunk)
        print(got / (time.perf_counter() - start), flush=True)
"""

_SEND = """
import socket, sys
block = bytes(1 << 20)
with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=120) as c:
    for _ in range(int(sys.argv[3]) >> 20):
        c.sendall(block)
"""


def _in(namespace: str, script: str, *args: str, **popen) -> subprocess.Popen:
    return subprocess.Popen(["ip", "netns", "exec", namespace, sys.executable, "-c", script, *args], **popen)


def stream_bytes_per_s(network: Network, src: int | None, dst: int | None, nbytes: int) -> float:
    """Node src sends `nbytes` (whole MiB, at least 2) to node dst, either of them None for the hub: the rate
    it flowed at. Between a node and the hub the stream crosses that node's uplink only."""
    source, dest = network.endpoint(src), network.endpoint(dst)
    receiver = _in(dest.namespace, _RECEIVE, dest.address, str(PROBE_PORT), stdout=subprocess.PIPE, text=True)
    try:
        if receiver.stdout.readline().strip() != "ready":
            raise OSError(f"the probe's receiver in {dest.namespace} did not start")
        sender = _in(source.namespace, _SEND, dest.address, str(PROBE_PORT), str(max(nbytes, 2 << 20)))
        if sender.wait(timeout=600) != 0:
            raise OSError(f"the probe's sender from {source.namespace} to {dest.namespace} failed")
        out, _ = receiver.communicate(timeout=60)
        return float(out.strip())
    finally:
        if receiver.poll() is None:
            receiver.kill()
            receiver.wait()
