"""Leave-last-out evaluation: AUC against one sampled negative, HR@10 among sampled candidates.

Used by the engine (rows pulled from the shards) and on an exported model (rows read
from the export store, only those the evaluated examples need).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from shardflow.model import ModelConfig, scores
from shardflow.training.batches import TrainData, lookups, negative_seed
from storage.checkpoint import read_export, read_export_dense, verify_export

EVAL_CHUNK = 256  # examples scored at a time
CANDIDATES = 100


def eval_targets(data: TrainData, users: int | None, seed: int) -> np.ndarray:
    """The held-out targets of a seeded sample of `users` users (all of them if None)."""
    targets = data.eval_targets
    if users is not None and users < targets.size:
        targets = np.sort(np.random.default_rng([seed, 1]).choice(targets, users, replace=False))
    return targets


def hits(logit: np.ndarray) -> tuple[float, float]:
    """(AUC count, HR@10 count) of logits [E, C] whose column 0 is the positive."""
    pos, neg = logit[:, :1], logit[:, 1:]
    auc = float((pos[:, 0] > neg[:, 0]).sum() + 0.5 * (pos[:, 0] == neg[:, 0]).sum())
    return auc, float(((neg > pos).sum(axis=1) < 10).sum())


def evaluate_export(model_dir: str | Path, dataset: str | Path, users: int | None, seed: int,
                    eval_from: int = 0) -> dict:
    """AUC and HR@10 of an exported model on the dataset's held-out items (after verifying every chunk).

    With `eval_from`, only the held-out items in segments eval_from.. (the newest parts).
    An export made before the dataset grew has no rows for the items added since: they
    score with zero vectors (the model has never seen them).
    """
    m = verify_export(model_dir)
    config = ModelConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in m["model"].items()})
    data = TrainData.load(dataset, config.features, (0, eval_from))
    dense = {k: torch.from_numpy(v) for k, v in read_export_dense(model_dir, config.dense_shapes(), [])[0].items()}
    targets = eval_targets(data, users, seed)
    auc = hit = 0.0
    for s in range(0, targets.size, EVAL_CHUNK):
        ex = data.examples(targets[s : s + EVAL_CHUNK], config, negative_seed(seed, -1), negatives=CANDIDATES - 1)
        need = lookups(ex, data, config, "device")
        rows = {t: torch.from_numpy(read_export(model_dir, "tables", t, ids, zeros_past_end=True))
                for t, ids in need.fetch.items()}
        with torch.no_grad():
            a, h = hits(scores(config, dense, rows, need.index.on(torch.device("cpu")), data.item).numpy())
        auc, hit = auc + a, hit + h
    n = max(int(targets.size), 1)
    return {"auc": auc / n, "hr_at_10": hit / n, "users": int(targets.size)}
