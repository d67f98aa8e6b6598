"""A checkpoint restored onto another plan: after a topology lost (or gained) devices, each shard takes the rows
it now stores from whichever of the checkpoint's shards stored them.

Every shard of a checkpoint records the global ids of its rows (`<table>/ids`, in its
local-row order), so moving rows needs no plan but the new one. A row copied onto
several shards (tiers global and node) is equal on all of them after every step, so the
first shard that holds it gives it. Each row keeps its weights, its Adagrad sum and its
version; the dense layers and their optimiser come from shard 0, as they were saved.
Rows move a block at a time, so a shard never holds a second copy of its rows (each old
shard's ids, 8 bytes a row, are read whole to find them).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch
import zarr

from shardflow.errors import InputError
from shardflow.training.shard import ParameterShard

READ_ROWS = 1 << 19  # rows moved at a time


def shard_names(digests: dict[str, str], shard: int) -> list[str]:
    """The arrays the checkpoint's shard `shard` holds (its manifest's names, without the shard's prefix)."""
    prefix = f"shards/{shard}/"
    return sorted(k[len(prefix):] for k in digests if k.startswith(prefix))


def positions(stored: np.ndarray, wanted: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(indices into `wanted` of the ids `stored` holds, their positions in `stored`)."""
    if not stored.size or not wanted.size:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    order = np.argsort(stored, kind="stable")
    ranked = stored[order]
    at = np.minimum(np.searchsorted(ranked, wanted), ranked.size - 1)
    hit = np.flatnonzero(ranked[at] == wanted)
    return hit, order[at[hit]]


def rehome(shard: ParameterShard, path: str | Path, digests: dict[str, str], shards_before: int, clock: int,
           dense_steps: int) -> None:
    """Fill `shard` (a fresh one) from the checkpoint at `path` (verified first, on every shard) written by
    `shards_before` shards under another plan."""
    path = Path(path)
    for table, layout in shard.layouts.items():
        wanted = layout.init_ids
        missing = np.ones(wanted.size, dtype=bool)
        for k in range(shards_before):
            if not missing.any():
                break
            if f"shards/{k}/{table}/ids" not in digests:
                raise InputError(f"{path}: shard {k} has no ids of table '{table}' (a checkpoint written before "
                                 "checkpoints carried them); accepted: a resume on the devices it was written on")
            root = path / "shards" / str(k) / table
            local = np.flatnonzero(missing)
            hit, source = positions(np.asarray(zarr.open_array(str(root / "ids"), mode="r")[...]), wanted[local])
            _move(shard, table, root, local[hit], source)
            missing[local[hit]] = False
        if missing.any():
            raise InputError(f"{path}: row {int(wanted[missing][0])} of table '{table}' is on none of its "
                             f"{shards_before} shards; accepted: a checkpoint of this dataset's tables")
    if shard.dense is not None:
        _dense(shard, path / "shards" / "0", dense_steps)
    shard.clock = clock


def _move(shard: ParameterShard, table: str, root: Path, local: np.ndarray, source: np.ndarray) -> None:
    """Rows at positions `source` of the checkpoint's arrays under `root` into this shard's local rows `local`,
    in ascending source order (each chunk read once)."""
    order = np.argsort(source, kind="stable")
    arrays = {f: zarr.open_array(str(root / f), mode="r") for f in ("weights", "state", "version")}
    for a in range(0, order.size, READ_ROWS):
        pick = order[a : a + READ_ROWS]
        src, dst = source[pick], local[pick]
        into = torch.from_numpy(dst).to(shard.device)
        shard.weights[table][into] = torch.from_numpy(
            arrays["weights"].get_orthogonal_selection((src, slice(None)))).to(shard.device)
        state = arrays["state"]
        shard.state[table][into] = torch.from_numpy(
            state.get_orthogonal_selection((src,) + (slice(None),) * (state.ndim - 1))).to(shard.device)
        shard.version[table][dst] = arrays["version"].get_orthogonal_selection((src,))


def _dense(shard: ParameterShard, root: Path, dense_steps: int) -> None:
    def read(group: str, names: Iterable[str]) -> dict[str, np.ndarray]:
        return {k: np.asarray(zarr.open_array(str(root / group / k), mode="r")[...]) for k in names}

    dense, state = read("dense", shard.dense or {}), read("dense_opt", shard.dense_optimizer.state)
    shard.load_dense(dense, state, dense_steps, str(root))
