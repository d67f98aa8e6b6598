"""The emulation's time scale measured from this host (shardflow.emulation.calibration), without building a cluster."""

from __future__ import annotations

import math
import os

import pytest

from shardflow.emulation.calibration import REFERENCE_SCALE, REFERENCE_STEP_S, auto_time_scale, reference_step_s
from shardflow.emulation.cluster import worker_environment
from shardflow.errors import InputError


def test_the_factor_is_500_at_the_reference_step_and_grows_with_a_slower_host():
    assert auto_time_scale(REFERENCE_STEP_S) == REFERENCE_SCALE == 500
    assert auto_time_scale(3 * REFERENCE_STEP_S) == 1500
    assert auto_time_scale(REFERENCE_STEP_S / 2) == 250
    assert auto_time_scale(1e-9) == 1  # never below 1: links are never made faster than the topology's


def test_the_reference_step_is_timed_in_every_process_and_none_is_left():
    before = _children()  # a session's own (a forkserver, a test server) stay
    step_s = reference_step_s(2, worker_environment())
    assert math.isfinite(step_s) and 0 < step_s < 60
    assert _children() - before == set()


def test_a_copy_that_cannot_start_is_named_in_one_error():
    env = {**worker_environment(), "PYTHONHOME": "/nonexistent"}  # this interpreter cannot find its library
    said = (r"^the time scale's reference step failed: ModuleNotFoundError: No module named 'encodings'; "
            r"accepted: a number as --time-scale instead of auto$")
    before = _children()
    with pytest.raises(InputError, match=said):
        reference_step_s(2, env)
    assert _children() - before == set()  # none left, not even unreaped


def _children() -> set[int]:
    """This process's child processes, zombies (exited, not yet waited for) included."""
    found = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            parent = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
        except OSError:  # gone meanwhile
            continue
        if parent == os.getpid():
            found.add(int(pid))
    return found
