"""The one memory model: what a device may hold (its budget), whether the tables fit the devices at all, and
what the worker holding a device's shard reaches (its peak).

The planner places rows under `budget_bytes_per_device`; the run's preflight and the
planner refuse tables that no placement fits (`check_capacity`); the engine refuses,
before any shard starts, a device whose worker would outgrow its memory limit
(`check_worker_memory`). A row costs `row_bytes(dim, rows)`: its values and its optimizer's state (one float
for row-wise Adagrad, 2·dim + 1 for Adam).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from shardflow.errors import InputError
from shardflow.planner.access import TableAccess
from shardflow.planner.sharding_plan import ShardingPlan, row_bytes
from shardflow.planner.topology import Topology


def budget_bytes_per_device(accesses: list[TableAccess], topology: Topology, dim: int, slack: float,
                            rows_optimizer: str = "adagrad") -> int:
    """device_memory_bytes if the topology gives it, else row-wise-mod's per-device bytes × (1 + slack)."""
    if not (isinstance(slack, (int, float)) and math.isfinite(slack) and slack >= 0):
        raise InputError(f"memory slack = {slack!r}; accepted: a number >= 0 (0.1 = 10% over row-wise-mod)")
    if topology.device_memory_bytes is not None:
        return topology.device_memory_bytes
    return slack_budget_bytes(accesses, topology, dim, slack, rows_optimizer)


def slack_budget_bytes(accesses: list[TableAccess], topology: Topology, dim: int, slack: float,
                       rows_optimizer: str = "adagrad") -> int:
    """Row-wise-mod's bytes on its fullest device × (1 + slack)."""
    rows = sum(math.ceil(a.rows / topology.devices) for a in accesses)
    return int(rows * row_bytes(dim, rows_optimizer) * (1 + slack))


def check_capacity(rows: int, dim: int, topology: Topology, budget_bytes: int, what: str = "the tables",
                   where: str = "", rows_optimizer: str = "adagrad") -> None:
    """Refuse `rows` rows at `dim` that `topology.devices` devices of `budget_bytes` each cannot hold
    (`what` names the tables, `where` the topology's file)."""
    need = rows * row_bytes(dim, rows_optimizer)
    have = budget_bytes * topology.devices
    if need > have:
        adam = rows_optimizer == "adam"
        state = " with row_optimizer adam's moments" if adam else ""
        smaller = " or row_optimizer adagrad (one float of state a row)" if adam else ""
        raise InputError(
            f"{what} need {need:,} bytes at dim {dim} ({rows:,} rows{state}), but {topology.devices} devices × "
            f"{budget_bytes:,} bytes{' of ' + where if where else ''} hold {have:,}: short by {need - have:,} bytes; "
            f"accepted: a larger device_memory_bytes, more devices, or a smaller dim{smaller}"
        )


STATE = {"adagrad": "Adagrad sums", "adam": "Adam moments"}  # a row optimizer's state, as a message names it

# What a worker holds beside its shard's rows and their optimizer state, as measured by bench/scale.py on tables of
# 10^5 to 5*10^7 rows and logs of up to 10^9 events (docs/benchmarks.md): its peak stayed within 1.3 x the
# plan's bytes + 1.1 GB, of which 0.56 GB is what importing torch's CUDA build and the engine costs any
# process, + 16 bytes a user of the log (the users' offsets, 8 bytes each, and what loading them takes).
# The examples a trainer holds (its parts of the blocks it reads: up to 150 MB of a sequence log's ids when
# that was measured, GBs for a click log's 40 columns) are counted on top, from the data (held_bytes), and so is
# a sequence model's step (shardflow.model.sizes.step_bytes: 2.5 GB for 2,048 examples of self-attention at
# history 50, 50 MB for the mean encoder's defaults).
WORKER_SCALE, WORKER_EXTRA_BYTES, WORKER_BYTES_PER_USER = 1.3, 1.1e9, 16


def worker_peak_bytes(shard_bytes: ArrayLike, users: int = 0, held: int = 0, step: int = 0) -> np.ndarray:
    """The resident memory a worker whose shard holds `shard_bytes` reaches, training a log of `users` users,
    holding `held` bytes of examples and `step` bytes of a step's working set (the bound bench/scale.py
    measures)."""
    extra = WORKER_EXTRA_BYTES + WORKER_BYTES_PER_USER * users + held + step
    return np.ceil(WORKER_SCALE * np.asarray(shard_bytes, dtype=np.float64) + extra).astype(np.int64)


def check_worker_memory(plan: ShardingPlan, topology: Topology, dim: int, scaled_rows: dict[str, int] | None,
                        workers: dict[str, dict[str, Any]], users: int = 0, held: int = 0,
                        rows_optimizer: str = "adagrad", step: int = 0) -> np.ndarray:
    """Refuse, before any shard starts, a plan whose device would outgrow the memory limit of the worker that
    would hold it (the scheduler's figure; a worker without a limit takes any): its rows and optimiser state,
    and what a worker holds beside them (worker_peak_bytes). Returns the shard bytes per device."""
    need = plan.memory_bytes_per_device(topology, dim, rows_optimizer)
    if scaled_rows is not None:  # estimation: device 0 holds the scaled tables, the others nothing
        need = np.zeros(topology.devices, dtype=np.int64)
        need[0] = sum(scaled_rows.values()) * row_bytes(dim, rows_optimizer)
    peak = worker_peak_bytes(need, users, held, step)
    for d, (address, info) in enumerate(workers.items()):
        limit = info.get("memory_limit") or 0
        if limit and peak[d] > limit:
            raise InputError(
                f"device {d}'s shard needs {need[d] / 2**30:.2f} GiB for its rows and their {STATE[rows_optimizer]} at "
                f"dim {dim}, "
                f"and its worker about {peak[d] / 2**30:.2f} GiB in all ({WORKER_SCALE} x that + "
                f"{WORKER_EXTRA_BYTES / 1e9:.1f} GB for torch, batches and buffers + {WORKER_BYTES_PER_USER} bytes "
                f"for each of the log's {users:,} users + {held / 2**30:.2f} GiB for the examples a trainer holds "
                f"+ {step / 2**30:.2f} GiB for a step's working set, as measured by bench/scale.py), "
                f"but its worker {address} may use {limit / 2**30:.2f} GiB; accepted: workers with more memory, a plan "
                f"over more devices, less memory_slack (fewer replicas) or a smaller dim"
                + (" or row_optimizer adagrad" if rows_optimizer == "adam" else "")
            )
    return need
