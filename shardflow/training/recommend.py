"""The night's product: every chosen user's top-K items from an exported sequence model, as a recommendations
store (storage.recommendations) any Parquet reader opens.

A user's list is what the model would show after the user's last event: the history is
the user's last `history` items, that event included; the whole catalog is scored
(shardflow.model.topk), the items the user already had left out. The users are split into
blocks; each block is one Dask task that reads the export's item rows a chunk at a time
(never the table whole), keeps its users' best K, maps rows to raw ids and writes its own
Parquet file into the staging directory. Only file names, row counts and digests come back.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from functools import partial
from logging import Logger, LoggerAdapter
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import zarr

from shardflow.data.batches import Lookups, TrainData
from shardflow.data.clicks import config_from_record
from shardflow.errors import InputError
from shardflow.model.configs import ModelConfig
from shardflow.model.sizes import MAX_TOP_K
from shardflow.model.tensors import Tensors
from shardflow.model.topk import TopK, top_block
from shardflow.training import user_states
from shardflow.training.evaluate import export_rows
from storage import recommendations, versions
from storage.checkpoint import read_export_dense, read_export_manifest, verify_export
from storage.lock import writer_lock
from storage.staging import for_workers, staged

if TYPE_CHECKING:
    from distributed import Client

USERS_FROM = ("window", "all")  # whose lists a night writes (config nightly.recommend_users)
USERS_PER_PART = 4096  # users one task scores and one Parquet file holds


def check_request(k: int, users_from: str) -> None:
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_TOP_K:
        raise InputError(f"k = {k!r}; accepted: an integer from 1 to {MAX_TOP_K:,}")
    if users_from not in USERS_FROM:
        raise InputError(f"users {users_from!r}; accepted: {', '.join(USERS_FROM)}")


def recommend_export(model_dir: str | Path, dataset: str | Path, out: str | Path, *, k: int, first_part: int = 0,
                     users_from: str = "window", version: int | None = None, client: Client | None = None,
                     overwrite: bool = False) -> dict[str, Any]:
    """Write the top-`k` lists of the users seen in parts `first_part`.. (`users_from` "window") or of every user
    ("all") from the model exported at `model_dir` into a recommendations store at `out`; its manifest."""
    check_request(k, users_from)
    m = verify_export(model_dir)
    config = config_from_record(m.model)
    why = recommendations.why_none(m.model)
    if why is not None or not isinstance(config, ModelConfig):
        raise InputError(f"{model_dir}: {why}; accepted: a sequence model without event features")
    data = TrainData.load(str(dataset), ())
    ds = data.dataset
    chosen = ds.users_in(first_part if users_from == "window" else 0)
    last = data.offsets[chosen + 1] - 1  # each chosen user's last event
    raw_users = ds.user_ids().astype(str)
    values, rows = ds.raw_ids(data.item)
    raw_items = np.empty(data.rows[data.item], dtype=values.astype(str).dtype)
    raw_items[rows] = values.astype(str)
    dense = {k_: torch.from_numpy(v) for k_, v in read_export_dense(model_dir, config.dense_shapes(), [])[0].items()}
    record: dict[str, Any] = {
        "version": version, "model": str(Path(model_dir).resolve()), "dataset": str(Path(dataset).resolve()),
        "k": k, "users_from": users_from, "first_part": first_part, "users": int(last.size),
        "items": int(data.rows[data.item]), "seen": "excluded"}
    with writer_lock(out), staged(Path(out), overwrite=overwrite) as stage:
        args = (str(model_dir), data.item, config, dense, raw_items, k, str(stage))
        blocks = [slice(s, s + USERS_PER_PART) for s in range(0, last.size, USERS_PER_PART)]
        parts = ((i, raw_users[chosen[b]], *_block_inputs(data, config, last[b]))
                 for i, b in enumerate(blocks))  # one block's inputs at a time
        if client is None:
            written = [recommend_part(*args, *part) for part in parts]
        else:
            written = _on_cluster(client, args, parts)
        files = {name: v for w in written for name, v in w.items()}
        return recommendations.finish(stage, record, files)


def lists_of_night(run: str | Path, number: int, dataset: str | Path, *, k: int, first_part: int, users_from: str,
                   client: Client | None, log: Logger | LoggerAdapter[Logger]) -> Path | None:
    """After the gate: the top-`k` lists of the users seen in version `number`'s training window (parts
    `first_part`..; or every user) from the current model, into that version's recommendations store; its
    path, or None where none are written (k 0, no current version, a click log, a model with event features:
    logged)."""
    current = versions.current(run)
    if k == 0 or current is None:
        return None
    model = versions.version_dir(run, current) / "model"
    why = recommendations.why_none(read_export_manifest(model).model)  # recommend_export verifies
    if why is not None:
        log.info("no top-K lists: %s", why)
        return None
    out = versions.lists_dir(run, number)
    made = recommend_export(model, dataset, out, k=k, first_part=first_part, users_from=users_from,
                            version=current, client=client, overwrite=out.exists())
    log.info("top-%d lists of %d users from version %d: %s", made["k"], made["users"], current, out)
    return out


def _on_cluster(client: Client, args: tuple[str, str, ModelConfig, Tensors, np.ndarray, int, str],
                parts: Iterable[tuple[Any, ...]]) -> list[dict[str, Any]]:
    """recommend_part of every block on the cluster's workers, at most two blocks per worker in flight: a block's
    inputs are made while the workers rank the ones before, and 10^6 users' inputs are never held at once."""
    from distributed import as_completed

    model_dir, table, config, dense, raw_items, k, stage = args
    model_dir, stage = for_workers(model_dir), for_workers(stage)
    shared = client.scatter([config, dense, raw_items], broadcast=True)
    window = 2 * max(1, len(client.scheduler_info().get("workers", {})))
    running, written = as_completed(), []

    def submit(part: tuple[Any, ...]) -> None:
        running.add(client.submit(recommend_part, model_dir, table, *shared, k, stage, *part, pure=False))

    for part in parts:
        submit(part)
        if running.count() >= window:
            written.append(next(running).result())
    written.extend(f.result() for f in running)
    return written


def _block_inputs(data: TrainData, config: ModelConfig,
                  last: np.ndarray) -> tuple[list[Lookups], np.ndarray, np.ndarray]:
    """(per slice of users encoded at once (shardflow.training.user_states), the rows their histories read and
    where, each history ending with its user's last event; the items each user had, as flat ids and offsets)."""
    needs = []
    for s in user_states.slices(last.size):
        ex = data.examples(last[s], config, 0, negatives=0)
        after = replace(ex, history=np.concatenate([ex.history[:, 1:], ex.positive[:, None]], axis=1), key=None)
        needs.append(data.lookups(after, config, "device"))
    seen, offsets = data.user_items(last)
    return needs, seen, offsets


def recommend_part(model_dir: str, table: str, config: ModelConfig, dense: Tensors, raw_items: np.ndarray, k: int,
                   stage: str, index: int, raw_users: np.ndarray, needs: list[Lookups], seen: np.ndarray,
                   offsets: np.ndarray) -> dict[str, Any]:
    """One block of users' lists, written as part `index` of the store staged at `stage` (a Dask task)."""
    state = user_states.joined(s for s, _, _ in user_states.states(config, dense, needs,
                                                                   partial(export_rows, model_dir),
                                                                   torch.device("cpu")))
    users = raw_users.size
    seen_user = np.repeat(np.arange(users, dtype=np.int64), np.diff(offsets))
    arr = zarr.open_array(str(Path(model_dir) / "tables" / table), mode="r")
    best = TopK.empty(users, k)
    step = int(arr.chunks[0])
    for s in range(0, arr.shape[0], step):  # a chunk of the export at a time: read once, never the table whole
        block = torch.from_numpy(np.ascontiguousarray(arr[s : min(s + step, arr.shape[0])]))
        best = best.merge(*top_block(config, dense, state, seen_user, seen, s, block, k))
    items = np.where(best.items >= 0, raw_items[np.maximum(best.items, 0)], "")
    return recommendations.write_part(stage, index, raw_users, items, best.scores)

