"""The training tests' small synthetic dataset: 300 items, 12 genres, 6,000 events."""

from __future__ import annotations

import pytest

from shardflow.data.batches import TrainData
from shardflow.data.synthetic import SynthTable, synth_dataset
from support import MODEL


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    path = tmp_path_factory.mktemp("train") / "ds"
    synth_dataset(
        path, [SynthTable("item", 300, 1.1), SynthTable("genre", 12, 0.7)], interactions=6000, seed=4, mean_length=10
    )
    return str(path)


@pytest.fixture(scope="module")
def data(dataset):
    return TrainData.load(dataset, MODEL.features)
