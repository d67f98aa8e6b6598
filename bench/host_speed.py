"""This host's speed now, in the emulation's unit: the reference step of shardflow.emulation.calibration in 4
processes at once (what `--time-scale auto` measures for a 2 × 2 topology; 96 ms on the 2-core reference host).

    python bench/host_speed.py

`make test` prints it after the suite, so that a run's minutes are read beside how fast the host was: the same
2-core machine measured 89-136 ms in one night (2026-11-29), and the suite's time follows it.
"""

from __future__ import annotations

import os
import sys

from shardflow.emulation.calibration import REFERENCE_STEP_S, measured_time_scale

PROCESSES = 4


def main() -> int:
    load = os.getloadavg()[0]  # before the measure's own processes
    _, step_s = measured_time_scale(PROCESSES)
    print(f"host speed: the emulation's reference step took {step_s * 1e3:.0f} ms in {PROCESSES} processes "
          f"({REFERENCE_STEP_S * 1e3:.0f} ms on the reference host: {step_s / REFERENCE_STEP_S:.2f}x its time); "
          f"load {load:.1f} before it on {os.cpu_count()} cores")
    return 0


if __name__ == "__main__":
    sys.exit(main())
