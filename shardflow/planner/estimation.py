"""Caffe2-style estimation: a plan that puts every table on one parameter server, scaled to fit it."""

from __future__ import annotations

import math

import numpy as np

from shardflow.errors import InputError
from shardflow.planner.sharding_plan import SINGLE, ShardingPlan, TablePlan, row_bytes


def estimation_plan(
    rows: dict[str, int], dim: int, server_bytes: int | None, rows_optimizer: str = "adagrad"
) -> tuple[ShardingPlan, dict[str, int], float]:
    """Caffe2-style estimation: every table on one parameter server (device 0).

    If the tables exceed `server_bytes`, every table's row count is scaled by one common
    factor so they fit; the server maps id -> id mod scaled rows. Returns (plan with every
    row single on device 0, scaled rows per table, the factor).
    """
    need = sum(rows.values()) * row_bytes(dim, rows_optimizer)
    factor = 1.0 if server_bytes is None else min(1.0, server_bytes / need)
    scaled = {t: max(1, math.floor(r * factor)) for t, r in rows.items()}
    if server_bytes is not None and sum(scaled.values()) * row_bytes(dim, rows_optimizer) > server_bytes:
        raise InputError(
            f"estimation server memory {server_bytes:,} bytes cannot hold one row of each of {len(rows)} tables; "
            f"accepted: at least {len(rows) * row_bytes(dim, rows_optimizer):,} bytes"
        )
    tables = tuple(TablePlan(t, np.full(r, SINGLE, np.int8), np.zeros(r, np.int32)) for t, r in rows.items())
    return ShardingPlan("estimation", tables), scaled, factor
