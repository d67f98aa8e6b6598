"""The time scale from this host's measured speed, so that compute and links keep one proportion on every host.

The emulation divides the links' rates by the time scale and leaves the host's own work —
forward and backward, merging ids, serialising rows, a proxy splitting what it relays — as
fast as this host does it. At one fixed factor a slower host therefore weighs that work
more against the links: on hosts that computed the bench's step in 0.12-0.15 s, scope
`node` on equal uplinks measured 1.35-1.71 of the modeled communication at /500, where a
host three times as fast measured 0.97-1.00 at /481 (docs/emulation.md). With `auto` the
factor follows the host: REFERENCE_SCALE where the reference step takes REFERENCE_STEP_S,
and in proportion to the step's time elsewhere.

The reference step is the engine's kind of work in one thread: a batch's ids made unique,
their rows gathered and averaged, a small MLP's forward and backward, the rows' gradients
pickled. It runs in one process per device of the topology at once (they share this
host's cores as the devices' workers will), each timing REPS steps after a barrier; the
median of their medians is the host's step.
"""

from __future__ import annotations

import re
import statistics
import subprocess
import sys

from shardflow.emulation.network import check_time_scale
from shardflow.errors import InputError

REFERENCE_SCALE = 500.0
# The reference step on the 2-core host of 2026-11-28 in 4 processes (2 x 2): 92-104 ms (1 process: 40 ms). There,
# at the factors it measured (/481-/1,044), every cell of bench/emulated_cluster.py was 0.85-1.06 of the model.
REFERENCE_STEP_S = 0.096
REPS = 15
ROWS, DIM, HISTORY, BATCH = 24_000, 64, 20, 4096

_CHILD = f"""
from shardflow.emulation.calibration import _time_steps
print(_time_steps({REPS}), flush=True)
"""


def _reference_step(rng, table, w1, w2) -> None:
    import pickle

    import numpy as np
    import torch

    ids = rng.integers(0, ROWS, (BATCH, HISTORY))
    unique, inverse = np.unique(ids, return_inverse=True)
    rows = torch.from_numpy(table[unique]).requires_grad_()
    pooled = rows[torch.from_numpy(inverse.reshape(ids.shape))].mean(1)
    loss = (torch.relu(pooled @ w1) @ w2).square().mean()
    loss.backward()
    pickle.dumps(rows.grad.numpy())


def _time_steps(reps: int) -> float:
    """In a child: warm up, say "ready", wait for the parent's line, then the median of `reps` steps' seconds."""
    import time

    import numpy as np
    import torch

    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    table = rng.standard_normal((ROWS, DIM), dtype=np.float32)
    w1 = torch.randn(DIM, DIM) / DIM**0.5
    w2 = torch.randn(DIM, 1) / DIM**0.5
    for _ in range(2):
        _reference_step(rng, table, w1, w2)
    print("ready", flush=True)
    sys.stdin.readline()
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        _reference_step(rng, table, w1, w2)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def reference_step_s(processes: int, env: dict[str, str]) -> float:
    """This host's reference step, seconds: `processes` copies at once, the median of their medians."""
    from shardflow.emulation.cluster import die_with_parent

    children = [subprocess.Popen([sys.executable, "-c", _CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True, env=env, preexec_fn=die_with_parent)
                for _ in range(processes)]
    try:
        for child in children:
            if child.stdout.readline().strip() != "ready":
                raise InputError(f"the time scale's reference step failed: {_last_error(child.stderr.read())}; "
                                 "accepted: a number as --time-scale instead of auto")
        for child in children:  # the barrier: every copy is warm before any is timed
            child.stdin.write("go\n")
            child.stdin.flush()
        return statistics.median(float(child.communicate()[0]) for child in children)
    finally:
        for child in children:
            child.kill()
            child.wait()


def _last_error(stderr: str) -> str:
    """The line that names an error (`XError: ...`), else the last line, of a child's stderr."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()] or ["(no output)"]
    return next((line for line in reversed(lines) if re.match(r"\w+(Error|Exception)\b", line)), lines[-1])


def auto_time_scale(step_s: float) -> float:
    """The factor, a whole number, that keeps this host's work and the links in the reference host's proportion
    at /500."""
    return float(max(1, round(REFERENCE_SCALE * step_s / REFERENCE_STEP_S)))


def measured_time_scale(devices: int) -> tuple[float, float]:
    """(time scale, reference step seconds) for a topology of `devices` devices on this host, as it is now: the
    copies run in the environment the cluster's workers get (one thread each)."""
    from shardflow.emulation.cluster import worker_environment

    step_s = reference_step_s(devices, worker_environment())
    return auto_time_scale(step_s), step_s


def parse_time_scale(text: str) -> float | str:
    """`auto`, or the number a --time-scale names; InputError naming the text otherwise."""
    if text == "auto":
        return text
    try:
        return check_time_scale(float(text))
    except ValueError:  # InputError is one too
        raise InputError(f"{text!r}; accepted: auto, or a finite number >= 1 (link rates are divided by it)") from None


def resolve_time_scale(chosen: float | str, devices: int) -> tuple[float, str | None]:
    """(the factor, the line that says how `auto` chose it, None for a number given) for `devices` devices."""
    if chosen != "auto":
        return chosen, None
    scale, step_s = measured_time_scale(devices)
    return scale, (f"time scale {scale:.0f} (auto: the reference step took {step_s * 1e3:.0f} ms in {devices} "
                   f"processes here; {REFERENCE_SCALE:.0f} at {REFERENCE_STEP_S * 1e3:.0f} ms)")
