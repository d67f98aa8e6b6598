"""The DLRM on a real click log: MovieLens-100k's ratings (4 or 5 stars a click) with its users' and movies'
features, time-ordered, the last 10% held out; it beats logistic regression on the same features and split."""

from __future__ import annotations

import pytest

from shardflow.config import RetrainConfig
from shardflow.data.clicks import load_training_data, model_config
from shardflow.model.configs import OptimizerConfig
from shardflow.training.logistic import choose_l2
from shardflow.training.reference import ReferenceTrainer
from shardflow.training.validation import best_epoch
from storage.dataset import Dataset
from storage.importers import import_dataset
from support import REAL

SEEDS = range(5)
BATCH, EPOCHS, PATIENCE = 1024, 4, 1  # the DLRM's epochs and the regression's L2 are chosen on validation rows


@pytest.fixture(scope="module")
def movielens(tmp_path_factory):
    dest = tmp_path_factory.mktemp("ml") / "ds"
    import_dataset("recbole", REAL["recbole"], dest, label="rating>=4")
    return Dataset.open(dest)


@pytest.fixture(scope="module")
def tuned(movielens):
    """The click data, with its validation rows, and the regression whose L2 they chose."""
    model = config_of(movielens, seed=0)
    data = load_training_data(movielens, model.features, validation=True)
    assert (data.targets, data.eval_targets.size, data.validation_targets.size) == (81_000, 10_000, 9_000)
    return data, choose_l2(data, model)[1].evaluate(data, data.eval_targets, model)


def config_of(movielens, seed):
    run = RetrainConfig().model  # the run's default model
    return model_config(movielens, dim=run.dim, mlp=run.mlp, bottom=run.bottom_mlp, history=1, negatives=1, seed=seed)


@pytest.mark.parametrize("seed", SEEDS)
def test_the_dlrm_beats_logistic_regression_on_auc_and_log_loss_for_every_seed(movielens, tuned, seed):
    data, regression = tuned
    model = config_of(movielens, seed)
    trainer = ReferenceTrainer(data, model, OptimizerConfig(), BATCH, seed=model.seed)
    scores = trainer.fit(EPOCHS, PATIENCE)
    epoch = best_epoch(scores)
    assert len(scores) == min(EPOCHS, epoch + PATIENCE)
    assert trainer.evaluate(data.validation_targets).auc == scores[epoch], "the best epoch's parameters kept"
    dlrm = trainer.evaluate(data.eval_targets)
    assert dlrm.auc > regression.auc, (epoch, dlrm, regression)
    assert dlrm.logloss < regression.logloss, (epoch, dlrm, regression)
