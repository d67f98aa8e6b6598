"""An exported model is evaluated only on a dataset it can have been trained on: real stores, no cluster."""

from __future__ import annotations

import pytest

from shardflow.data.synthetic import SynthTable, synth_dataset
from shardflow.errors import InputError
from shardflow.training.evaluate import check_trained_on
from storage.dataset import Dataset
from storage.importers import import_dataset
from support import REAL


def test_a_dataset_of_another_workload_or_with_fewer_rows_is_refused_a_grown_one_is_not(tmp_path):
    """A sequence model on a click log was refused as "categorical tables []"; one of 400 items on a log of 2 failed
    later, and on a larger unrelated log it scored without a word (which no check of sizes can tell)."""
    synth_dataset(tmp_path / "log", [SynthTable("item", 300, 1.1)], interactions=3000, seed=1)
    import_dataset("criteo", REAL["criteo"], tmp_path / "clicks")
    check_trained_on("model", {"item": 300}, "sequence", Dataset.open(tmp_path / "log"))
    check_trained_on("model", {"item": 250}, "sequence", Dataset.open(tmp_path / "log"))  # grown since the export
    for tables, kind, dataset, refusal in [
        ({"item": 301}, "sequence", "log", "model: table 'item' of 301 rows, {root}/log holds 300; accepted: the "
                                           "dataset the model was trained on, or that dataset grown since"),
        ({"genre": 5}, "sequence", "log", "model: table 'genre' of 5 rows, {root}/log holds 0; accepted"),
        ({"item": 300}, "sequence", "clicks", "model: a sequence model, {root}/clicks: a click log; accepted: the "
                                              "dataset the model was trained on"),
        ({"C1": 10}, "click", "log", "model: a click model, {root}/log: a sequence log; accepted"),
    ]:
        with pytest.raises(InputError) as refused:
            check_trained_on("model", tables, kind, Dataset.open(tmp_path / dataset))
        assert str(refused.value).startswith(refusal.format(root=tmp_path)), str(refused.value)
