"""Fixtures of the emulated cluster: `emulated(topology)` builds one for a test and removes it after."""

from __future__ import annotations

import contextlib

import pytest

from shardflow.emulation.cluster import EmulatedCluster
from shardflow.emulation.network import cannot_emulate

DEFAULT_SCALE = 500.0


@pytest.fixture
def emulated(tmp_path):
    """A factory: `emulated(topology, time_scale=500)` -> a running EmulatedCluster, removed at the test's end
    (skips the test, naming why, where this machine cannot build one)."""
    reason = cannot_emulate()
    if reason:
        pytest.skip(reason)
    with contextlib.ExitStack() as stack:
        def build(topology, time_scale: float = DEFAULT_SCALE) -> EmulatedCluster:
            logs = tmp_path / f"emulated-{len(stack._exit_callbacks)}"
            return stack.enter_context(EmulatedCluster(topology, time_scale, logs))
        yield build
