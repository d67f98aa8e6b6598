"""Evaluation of either workload on its held-out examples.

Sequences: leave-last-out, the held-out item ranked among EVAL_NEGATIVES sampled items its
user never interacted with (the SASRec paper's protocol: HR@10 and NDCG@10), and AUC against
the first of them; on an exported model also among the whole catalog (shardflow.model.ranking:
HR and NDCG at 10 and 20, the items a user had before left out by default). Click logs: AUC
and log-loss on the held-out last rows. Used by the engine (rows pulled from the shards) and
on an exported model (rows read from the export store: those the evaluated examples need, and
the catalog block by block).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
import zarr

from shardflow.data.batches import TrainData, negative_seed
from shardflow.data.clicks import config_from_record, load_training_data
from shardflow.data.examples import EVAL_NEGATIVES
from shardflow.data.workload import Workload
from shardflow.errors import InputError
from shardflow.model.configs import ModelConfig
from shardflow.model.forward import logits, on_device
from shardflow.model.metrics import FULL_RANKING, Metrics
from shardflow.model.ranking import CatalogRanks, UsersToRank, rank_block, users_to_rank
from shardflow.model.tensors import Tensors
from shardflow.training import user_states
from storage.checkpoint import read_export, read_export_dense, verify_export
from storage.dataset import Dataset
from storage.staging import for_workers

if TYPE_CHECKING:
    from distributed import Client

EVAL_CHUNK = 256  # examples scored at a time


SPLITS = ("test", "validation")  # what an evaluation scores


def eval_targets(data: Workload, users: int | None, seed: int, split: str = "test") -> np.ndarray:
    """The held-out targets of `split` of a seeded sample of `users` users (all of them if None)."""
    targets = data.eval_targets if split == "test" else data.validation_targets
    if users is not None and users < targets.size:
        targets = np.sort(np.random.default_rng([seed, 1]).choice(targets, users, replace=False))
    return targets


def evaluate_export(model_dir: str | Path, dataset: str | Path, users: int | None, seed: int,
                    eval_from: int = 0, full: str | None = "exclude-seen", client: Client | None = None) -> Metrics:
    """The metrics of an exported model on the dataset's held-out examples (after verifying every chunk).

    With `eval_from`, only the held-out examples in segments eval_from.. (the newest parts).
    An export made before the dataset grew has no rows for the ids added since: they
    score with zero vectors (the model has never seen them). A sequence model's held-out
    items are also ranked among the whole catalog, with the items each user had before
    left out (`full` "exclude-seen") or not ("include-seen"; "off" or None: not ranked), in blocks of the
    export's rows on the workers of `client` (in this process without one).
    """
    m = verify_export(model_dir)
    config = config_from_record(m.model)
    ds = Dataset.open(dataset)
    check_trained_on(model_dir, m.tables, config.kind, ds)
    data: Workload = load_training_data(ds, config.features, (0, eval_from))
    dense = {k: torch.from_numpy(v) for k, v in read_export_dense(model_dir, config.dense_shapes(), [])[0].items()}
    targets = eval_targets(data, users, seed)
    parts = []
    for s in range(0, targets.size, EVAL_CHUNK):
        ex = data.eval_examples(targets[s : s + EVAL_CHUNK], config, negative_seed(seed, -1), EVAL_NEGATIVES)
        need = data.lookups(ex, config, "device")
        rows = export_rows(model_dir, need.fetch)
        with torch.no_grad():
            index = on_device(need.index, torch.device("cpu"))
            parts.append(data.scored.of(logits(config, dense, rows, index).numpy(), ex))
    metrics = sum(parts, data.scored()).metrics()
    if full is not None and full not in FULL_RANKING:
        raise InputError(f"full-catalog ranking {full!r}; accepted: {', '.join(FULL_RANKING)}")
    if full in (None, "off") or not isinstance(config, ModelConfig) or not isinstance(data, TrainData):
        return metrics
    ranks = catalog_ranks(str(model_dir), data, config, dense, targets, full == "include-seen", client)
    ranked = ranks.metrics()
    return replace(metrics, full_ranking=full, full_hr_at_10=ranked["full_hr_at_10"],
                   full_ndcg_at_10=ranked["full_ndcg_at_10"], full_hr_at_20=ranked["full_hr_at_20"],
                   full_ndcg_at_20=ranked["full_ndcg_at_20"])


def check_trained_on(model_dir: str | Path, tables: dict[str, int], kind: str, dataset: Dataset) -> None:
    """Refuse a dataset the exported model cannot have been trained on, nor one grown from it: another workload
    (as load_training_data tells them: a click log has no item sequence), or a table it lacks or holds fewer rows
    of (a sequence model on a click log was refused as "categorical tables []", and one of 400 items scored on
    another log of 1,623 without a word)."""
    info = dataset.info
    has = "click" if info.sequence_table is None else "sequence"
    if kind != has:
        raise InputError(f"{model_dir}: a {kind} model, {dataset.path}: a {has} log; accepted: the dataset the model "
                         "was trained on, or that dataset grown since")
    for table, rows in tables.items():
        held = info.table(table).rows if table in info.table_names else 0
        if held < rows:
            raise InputError(f"{model_dir}: table '{table}' of {rows:,} rows, {dataset.path} holds {held:,}; "
                             "accepted: the dataset the model was trained on, or that dataset grown since")


def export_rows(model_dir: str | Path, fetch: dict[str, np.ndarray]) -> Tensors:
    """The rows `fetch` names ({table: ids}) read from the export at `model_dir`: zeros for ids added to the dataset
    since it was made (the model has never seen them)."""
    return {t: torch.from_numpy(read_export(model_dir, "tables", t, ids, zeros_past_end=True))
            for t, ids in fetch.items()}


RANK_BLOCK_ROWS = 2048  # catalog rows a task scores at a time (one read of the export, a slice of its chunk)


def catalog_ranks(model_dir: str, data: TrainData, config: ModelConfig, dense: Tensors, targets: np.ndarray,
                  include_seen: bool, client: Client | None = None) -> CatalogRanks:
    """The held-out items of `targets` ranked among every row of the export's item table, block by block (on
    `client`'s workers when given: each reads its own block, the users' states are sent once)."""
    users, missed = held_out_users(data, config, dense, targets, include_seen, partial(export_rows, model_dir),
                                   torch.device("cpu"))
    catalog = int(data.rows[data.item])
    starts = list(range(0, catalog, RANK_BLOCK_ROWS))
    stops = [min(s + RANK_BLOCK_ROWS, catalog) for s in starts]
    if client is None:
        blocks = [rank_export_block(model_dir, data.item, s, e, config, dense, users)
                  for s, e in zip(starts, stops, strict=True)]
    else:
        shared = client.scatter([config, dense, users], broadcast=True)
        blocks = client.gather(client.map(rank_export_block, [for_workers(model_dir)] * len(starts),
                                          [data.item] * len(starts), starts, stops,
                                          *([x] * len(starts) for x in shared), pure=False))
    zeros = np.zeros(users.users, dtype=np.int64)
    return sum(blocks, CatalogRanks(zeros, zeros, missed))


def held_out_users(data: TrainData, config: ModelConfig, dense: Tensors, targets: np.ndarray, include_seen: bool,
                   rows_of: Callable[[dict[str, np.ndarray]], Tensors],
                   device: torch.device) -> tuple[UsersToRank, np.ndarray]:
    """The ranking inputs of the held-out `targets` (on the host), their rows read by `rows_of({table: ids})` (from
    an export, or where a device's shards hold them) and computed on `device`, STATE_USERS users at a time
    (shardflow.training.user_states); and which of them are missed outright (shardflow.model.ranking.users_to_rank)."""
    exs = [data.eval_examples(targets[s], config, 0, 0) for s in user_states.slices(targets.size)]
    parts, target_rows = [], []
    for state, rows, need in user_states.states(config, dense, (data.lookups(ex, config, "device") for ex in exs),
                                                rows_of, device):
        parts.append(state)
        target_rows.append(rows[data.item][need.index.candidates[:, 0]].cpu())
    seen, offsets = data.user_items(np.concatenate([ex.position for ex in exs]))
    host = {k: v.cpu() for k, v in dense.items()}
    return users_to_rank(config, host, user_states.joined(parts), np.concatenate([ex.positive for ex in exs]),
                         torch.cat(target_rows), seen, offsets, include_seen)


def rank_export_block(model_dir: str, table: str, start: int, stop: int, config: ModelConfig, dense: Tensors,
                      users: UsersToRank) -> CatalogRanks:
    """The counts of the catalog's items start .. stop - 1 of `table` (a Dask task): their rows read from the
    export, zeros for items added to the dataset since it was made (as the sampled protocol scores them)."""
    arr = zarr.open_array(str(Path(model_dir) / "tables" / table), mode="r")
    rows = np.zeros((stop - start, config.dim), dtype=np.float32)
    held = max(0, min(stop, arr.shape[0]) - start)
    rows[:held] = arr[start : start + held]
    return rank_block(config, dense, users, np.arange(start, stop), torch.from_numpy(rows))
