"""Choosing epochs on the validation split: its score, the best epoch, and when to stop.

Pure logic shared by Engine.fit and the retraining flow. The flow reads the scores back
from its checkpoints' manifests, so a resumed run chooses exactly as an uninterrupted one.
The test split is never scored here.
"""

from __future__ import annotations

from shardflow.model.metrics import METRICS, Metrics

PREFIX = "val_"  # a validation metric's key: val_auc, val_hr_at_10, val_ndcg_at_10, val_logloss
SCORE_KEYS = ("val_ndcg_at_10", "val_auc")  # the first a workload has is its score


VALIDATION_KEYS = tuple(PREFIX + k for k in METRICS)


def validation_values(metrics: Metrics) -> dict:
    """The validation metrics under their val_ keys, every key of METRICS present (None where none)."""
    return metrics.values(PREFIX)


def validation_of(values: dict) -> dict:
    """The val_ metrics a summary, checkpoint manifest or epoch's stats holds, every key present."""
    return {k: values.get(k) for k in VALIDATION_KEYS}


def score(values: dict) -> float:
    """The number epochs are chosen on, higher better: NDCG@10 for sequences (as the SASRec paper chooses
    its epoch), AUC for click logs."""
    return next(values[k] for k in SCORE_KEYS if values.get(k) is not None)


def best_epoch(scores: dict[int, float]) -> int | None:
    """The epoch with the highest score, the earliest of equals; None before any."""
    if not scores:
        return None
    return max(sorted(scores), key=lambda e: (scores[e], -e))


def stop_now(scores: dict[int, float], patience: int) -> bool:
    """Whether `patience` epochs have passed since the best one without a better score."""
    best = best_epoch(scores)
    return best is not None and max(scores) - best >= patience
