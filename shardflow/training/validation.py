"""Choosing epochs on the validation split: its score, the best epoch, and when to stop.

Pure logic shared by Engine.fit and the retraining flow. The flow reads the scores back
from its checkpoints' manifests, so a resumed run chooses exactly as an uninterrupted one.
The test split is never scored here.
"""

from __future__ import annotations

from shardflow.errors import InputError
from shardflow.model.metrics import FULL_FIGURES, METRICS, Metrics

PREFIX = "val_"  # a validation metric's key: val_auc, val_hr_at_10, val_ndcg_at_10, val_logloss, val_full_hr_at_10
# The first every scored epoch has is the score: NDCG@10 among the whole catalog where it was ranked (sequences,
# train.full_ranking not off: sampled metrics can rank models wrongly, Krichene & Rendle, KDD 2020), else among
# sampled items, AUC for click logs.
SCORE_KEYS = ("val_full_ndcg_at_10", "val_ndcg_at_10", "val_auc")


Values = dict[str, float | None]  # metric key -> its value, None where it was not measured
VALIDATION_KEYS = tuple(PREFIX + k for k in (*METRICS, *FULL_FIGURES))


def validation_values(metrics: Metrics) -> Values:
    """The validation metrics under their val_ keys, every key of METRICS present (None where none)."""
    return metrics.values(PREFIX)


def validation_of(values: Values) -> Values:
    """The val_ metrics a summary, checkpoint manifest or epoch's stats holds, every key present."""
    return {k: values.get(k) for k in VALIDATION_KEYS}


def score(values: Values) -> float:
    """The number epochs are chosen on, higher better: the first of SCORE_KEYS `values` has (NDCG@10 for
    sequences, as the SASRec paper chooses its epoch; AUC for click logs)."""
    return next(v for v in (values.get(k) for k in SCORE_KEYS) if v is not None)


def epoch_scores(scored: dict[int, Values]) -> dict[int, float]:
    """Epoch -> its score, on the first of SCORE_KEYS that every epoch has: epochs scored before the whole catalog
    was ranked (a checkpoint resumed from an older run) are compared on the sampled figures with the others."""
    for key in SCORE_KEYS:
        found = {e: v.get(key) for e, v in scored.items()}
        if all(x is not None for x in found.values()):
            return {e: x for e, x in found.items() if x is not None}
    return {e: score(v) for e, v in scored.items()}


def best_epoch(scores: dict[int, float]) -> int | None:
    """The epoch with the highest score, the earliest of equals; None before any."""
    if not scores:
        return None
    return max(sorted(scores), key=lambda e: (scores[e], -e))


def stop_now(scores: dict[int, float], patience: int | None, min_epochs: int | None = None) -> bool:
    """Whether `patience` epochs have passed since the best one without a better score, once at least
    `min_epochs` are scored (a warm-up in which no better score is expected: Keras' `start_from_epoch`).
    The best epoch is chosen among all of them, the warm-up's included. Never without a patience."""
    best = best_epoch(scores)
    if patience is None or best is None:
        return False
    return max(scores) >= (min_epochs or 0) and max(scores) - best >= patience


def check_min_epochs(min_epochs: int | None, patience: int | None, epochs: int) -> None:
    """min_epochs only with a patience, and at most the epochs trained; InputError otherwise."""
    if min_epochs is None:
        return
    if patience is None:
        raise InputError(f"min_epochs = {min_epochs} without patience; accepted: min_epochs only with patience "
                         "(the epochs trained before early stopping may end training)")
    if min_epochs > epochs:
        raise InputError(f"min_epochs = {min_epochs} above epochs = {epochs}; accepted: at most epochs")
