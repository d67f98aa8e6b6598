"""glibc's heap thresholds in the Dask workers of a run that shardflow did not start itself.

A Dask nanny starts its worker with MALLOC_TRIM_THRESHOLD_=65536 (distributed's
`distributed.nanny.pre-spawn-environ`: freed memory goes back to the system at once).
Setting any of glibc's thresholds also turns off its dynamic mmap threshold, which then
stays at 128 KiB: every larger buffer (a step's activations and gradients, a chunk of
counted ids) is a fresh mmap whose pages fault in on first touch and are unmapped on
free. The engine's step on such workers ran 2.4× slower on 1 device, 2.1× on 2
(bench/heap_thresholds.py, docs/benchmarks.md).

Local clusters start their workers without the variable (shardflow.cluster.LOCAL_CLUSTER_CONFIG).
The workers of a scheduler_address or a non-local cluster class get HeapThresholds while
the run's cluster is open: the thresholds glibc's own dynamic rule climbs to, the trim
threshold twice the mmap threshold as that rule keeps it, so a worker holds up to
TRIM_THRESHOLD_BYTES of freed heap. The last teardown (the runs' end, or the worker's)
puts back what the environment said and returns that heap. A worker whose environment sets
MALLOC_MMAP_THRESHOLD_ keeps its own choice; one without glibc is left alone.
"""

from __future__ import annotations

import ctypes
import os
import platform
import threading
from collections.abc import Mapping
from typing import Any

from distributed import WorkerPlugin

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters (malloc.h)
MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit: where its dynamic rule stops
TRIM_THRESHOLD_BYTES = 2 * MMAP_THRESHOLD_BYTES
GLIBC_DEFAULT_BYTES = 128 << 10  # DEFAULT_MMAP_THRESHOLD_MIN and DEFAULT_TRIM_THRESHOLD
NAME = "shardflow-heap-thresholds"  # and the client's id: one registration per client
_holders = 0  # HeapThresholds set up in this process and not torn down
_lock = threading.Lock()


def pinned(env: Mapping[str, str] = os.environ) -> bool:
    """Whether `env` turned glibc's dynamic mmap threshold off without choosing one (Dask's nanny does)."""
    return "MALLOC_TRIM_THRESHOLD_" in env and "MALLOC_MMAP_THRESHOLD_" not in env


def _glibc() -> Any | None:
    return ctypes.CDLL(None) if platform.libc_ver()[0] == "glibc" else None


def set_thresholds(mmap_bytes: int, trim_bytes: int) -> bool:
    """Set this process's mmap and trim thresholds; whether glibc took both."""
    libc = _glibc()
    return libc is not None and libc.mallopt(M_MMAP_THRESHOLD, mmap_bytes) == 1 and libc.mallopt(
        M_TRIM_THRESHOLD, trim_bytes) == 1


class HeapThresholds(WorkerPlugin):
    """On a worker whose thresholds are pinned (`pinned`): large buffers stay on the heap while any client has
    one registered. Each client registers its own (several runs may share a cluster); the last one torn down
    puts the environment's thresholds back."""

    def __init__(self) -> None:
        self.applied = False

    def setup(self, worker: Any) -> None:
        global _holders
        if not pinned():
            return
        with _lock:
            if _holders == 0 and not set_thresholds(MMAP_THRESHOLD_BYTES, TRIM_THRESHOLD_BYTES):
                return
            _holders += 1
            self.applied = True

    def teardown(self, worker: Any) -> None:
        global _holders
        if not self.applied:
            return
        with _lock:
            _holders -= 1
            if _holders == 0:
                trim = os.environ.get("MALLOC_TRIM_THRESHOLD_", "")
                set_thresholds(GLIBC_DEFAULT_BYTES, int(trim) if trim.isdigit() else GLIBC_DEFAULT_BYTES)
                libc = _glibc()
                if libc is not None:
                    libc.malloc_trim(0)  # the freed heap it kept goes back now, as that setting would have
        self.applied = False

