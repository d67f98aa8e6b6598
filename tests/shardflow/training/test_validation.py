"""Choosing epochs on the validation split: pure rules, shared by Engine.fit and the retraining flow."""

from __future__ import annotations

import pytest

from shardflow.errors import InputError
from shardflow.model.metrics import Metrics
from shardflow.training.config import TrainConfig
from shardflow.training.validation import (
    VALIDATION_KEYS,
    best_epoch,
    check_min_epochs,
    epoch_scores,
    score,
    stop_now,
    validation_of,
    validation_values,
)


def test_sequences_are_chosen_on_ndcg_and_click_logs_on_auc():
    assert score(validation_values(Metrics(0.9, 100, hr_at_10=0.6, ndcg_at_10=0.4))) == 0.4
    assert score(validation_values(Metrics(0.7, 100, logloss=0.5))) == 0.7
    assert set(validation_values(Metrics(None))) == {"val_auc", "val_hr_at_10", "val_ndcg_at_10", "val_logloss"}


def test_epochs_are_chosen_on_the_whole_catalog_where_every_epoch_ranked_it_else_on_the_sampled_figures():
    ranked = {1: {"val_ndcg_at_10": 0.5, "val_full_ndcg_at_10": 0.02}, 2: {"val_ndcg_at_10": 0.4,
                                                                           "val_full_ndcg_at_10": 0.03}}
    assert epoch_scores(ranked) == {1: 0.02, 2: 0.03}  # the sampled NDCG would have kept epoch 1
    # a checkpoint of a run that did not rank the catalog, resumed by one that does: one yardstick for all
    assert epoch_scores({**ranked, 0: {"val_ndcg_at_10": 0.45}}) == {0: 0.45, 1: 0.5, 2: 0.4}
    assert epoch_scores({1: {"val_auc": 0.7, "val_ndcg_at_10": None}}) == {1: 0.7}
    assert epoch_scores({}) == {}


def test_the_best_epoch_is_the_earliest_of_the_highest_scores():
    assert best_epoch({}) is None
    assert best_epoch({1: 0.3, 2: 0.5, 3: 0.5, 4: 0.4}) == 2
    assert best_epoch({3: 0.1, 1: 0.2, 2: 0.2}) == 1


def test_training_stops_once_patience_epochs_pass_without_a_better_score():
    assert not stop_now({}, 1)
    assert not stop_now({1: 0.3, 2: 0.5, 3: 0.4}, 2)
    assert stop_now({1: 0.3, 2: 0.5, 3: 0.4, 4: 0.5}, 2)  # an equal score is no better
    assert stop_now({1: 0.5, 2: 0.4}, 1) and not stop_now({1: 0.4, 2: 0.5}, 1)


def test_min_epochs_holds_training_through_a_warm_up_and_needs_a_patience():
    plateau = {1: 0.30, 2: 0.29, 3: 0.30, 4: 0.30}  # no better score after epoch 1, as Adam's rows start
    assert stop_now(plateau, 2) and not stop_now(plateau, 2, min_epochs=5)
    assert stop_now(plateau | {5: 0.29}, 2, min_epochs=5)  # the best is still epoch 1, chosen among them all
    assert not stop_now(plateau | {5: 0.45}, 2, min_epochs=5)
    check_min_epochs(None, None, 3)
    check_min_epochs(3, 2, 3)
    with pytest.raises(InputError, match=r"min_epochs = 3 without patience; accepted: min_epochs only with patience"):
        check_min_epochs(3, None, 10)
    with pytest.raises(InputError, match=r"min_epochs = 11 above epochs = 10; accepted: at most epochs"):
        check_min_epochs(11, 2, 10)
    with pytest.raises(InputError, match=r"min_epochs = 0; accepted: an integer >= 1, or none"):
        TrainConfig(epochs=4, patience=1, min_epochs=0)


def test_a_summarys_validation_metrics_are_read_back_under_either_name():
    summary = {"auc": 0.5, "val_auc": 0.8, "val_ndcg_at_10": 0.3, "loss": 0.2}
    assert validation_of(summary) == {"val_auc": 0.8, "val_hr_at_10": None, "val_ndcg_at_10": 0.3,
                                      "val_logloss": None, "val_full_hr_at_10": None, "val_full_ndcg_at_10": None,
                                      "val_full_hr_at_20": None, "val_full_ndcg_at_20": None}
    assert tuple(validation_of(summary)) == VALIDATION_KEYS
    assert Metrics.read(summary, "val_") == Metrics(0.8, ndcg_at_10=0.3)
    assert validation_values(Metrics(0.7, 10, logloss=0.4)) == {"val_auc": 0.7, "val_hr_at_10": None,
                                                                "val_ndcg_at_10": None, "val_logloss": 0.4}
