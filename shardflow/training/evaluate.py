"""Evaluation of either workload on its held-out examples.

Sequences: leave-last-out, the held-out item ranked among EVAL_NEGATIVES sampled items its
user never interacted with (the SASRec paper's protocol: HR@10 and NDCG@10), and AUC against
the first of them. Click logs: AUC and log-loss on the held-out last rows. Used by the engine
(rows pulled from the shards) and on an exported model (rows read from the export
store, only those the evaluated examples need).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from shardflow.data.batches import TrainData, negative_seed
from shardflow.data.examples import EVAL_NEGATIVES
from shardflow.data.clicks import ClickData, config_from_record, load_training_data
from shardflow.model.metrics import Metrics
from storage.checkpoint import read_export, read_export_dense, verify_export

EVAL_CHUNK = 256  # examples scored at a time


SPLITS = ("test", "validation")  # what an evaluation scores


def eval_targets(data: TrainData | ClickData, users: int | None, seed: int, split: str = "test") -> np.ndarray:
    """The held-out targets of `split` of a seeded sample of `users` users (all of them if None)."""
    targets = data.eval_targets if split == "test" else data.validation_targets
    if users is not None and users < targets.size:
        targets = np.sort(np.random.default_rng([seed, 1]).choice(targets, users, replace=False))
    return targets


def evaluate_export(model_dir: str | Path, dataset: str | Path, users: int | None, seed: int,
                    eval_from: int = 0) -> Metrics:
    """The metrics of an exported model on the dataset's held-out examples (after verifying every chunk).

    With `eval_from`, only the held-out examples in segments eval_from.. (the newest parts).
    An export made before the dataset grew has no rows for the ids added since: they
    score with zero vectors (the model has never seen them).
    """
    m = verify_export(model_dir)
    config = config_from_record(m.model)
    data = load_training_data(dataset, config.features, (0, eval_from))
    dense = {k: torch.from_numpy(v) for k, v in read_export_dense(model_dir, config.dense_shapes(), [])[0].items()}
    targets = eval_targets(data, users, seed)
    parts = []
    for s in range(0, targets.size, EVAL_CHUNK):
        ex = data.eval_examples(targets[s : s + EVAL_CHUNK], config, negative_seed(seed, -1), EVAL_NEGATIVES)
        need = data.lookups(ex, config, "device")
        rows = {t: torch.from_numpy(read_export(model_dir, "tables", t, ids, zeros_past_end=True))
                for t, ids in need.fetch.items()}
        with torch.no_grad():
            parts.append(data.scored.of(config.logits(dense, rows, need.index.on(torch.device("cpu"))).numpy(), ex))
    return sum(parts, data.scored()).metrics()
