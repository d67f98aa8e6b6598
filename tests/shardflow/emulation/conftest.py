"""Fixtures of the emulated cluster: `emulated(topology)` builds one for a test and removes it after."""

from __future__ import annotations

import contextlib

import pytest

from shardflow.emulation.cluster import EmulatedCluster
from shardflow.emulation.network import cannot_emulate

DEFAULT_SCALE = 500.0
# A connection whose peer was cut off is found dead after distributed's `comm.timeouts.tcp` (TCP keepalive and
# user timeout; 30 s by default). The cut-off tests wait that long for the lost devices to be named. 15 s still
# rides through the 5-s cut (its retransmissions back off to about 6 s), and a shaped link's queue holds 0.5 s
# of its rate (shardflow.emulation.network.QUEUE_S), slowed or not.
TCP_TIMEOUT = "15s"


@pytest.fixture
def emulated(tmp_path, monkeypatch):
    """A factory: `emulated(topology, time_scale=500)` -> a running EmulatedCluster, removed at the test's end
    (skips the test, naming why, where this machine cannot build one)."""
    reason = cannot_emulate()
    if reason:
        pytest.skip(reason)
    monkeypatch.setenv("DASK_DISTRIBUTED__COMM__TIMEOUTS__TCP", TCP_TIMEOUT)  # the cluster's processes and commands
    with contextlib.ExitStack() as stack:
        def build(topology, time_scale: float = DEFAULT_SCALE) -> EmulatedCluster:
            logs = tmp_path / f"emulated-{len(stack._exit_callbacks)}"
            return stack.enter_context(EmulatedCluster(topology, time_scale, logs))
        yield build
