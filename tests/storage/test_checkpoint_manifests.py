"""The manifests of checkpoints and exports: typed records, written last, read back as they were written, and a bad
field named with what is accepted."""

from __future__ import annotations

import json

import pytest

from shardflow.errors import InputError
from shardflow.model.metrics import METRICS
from shardflow.training.validation import VALIDATION_KEYS
from storage.checkpoint import CheckpointManifest, ExportManifest, finish, read_checkpoint, read_export_manifest, sealed

MODEL = {"kind": "sequence", "dim": 8, "mlp": [16], "history": 5}


def checkpoint_manifest(**figures) -> CheckpointManifest:
    return CheckpointManifest(epochs_done=2, step=40, dense_steps=40, devices=4, model=MODEL, batch_size=512, seed=0,
                              **sealed({"0/item/weights": "ab" * 32}), **figures)


def test_a_checkpoint_manifest_reads_back_as_written_with_every_figure_an_epoch_measures(tmp_path):
    m = checkpoint_manifest(loss=0.41, auc=0.87, hr_at_10=0.7, ndcg_at_10=0.5, val_ndcg_at_10=0.52,
                            bytes_per_step=1.25e7, examples_per_s=31000.0, seconds=12.5)
    finish(tmp_path, m)
    back = read_checkpoint(tmp_path)
    assert back == m and back.figures["val_ndcg_at_10"] == 0.52 and back.figures["logloss"] is None
    # every figure the flow and the engine measure has its field, and nothing else is a figure
    assert {"loss", *METRICS, *VALIDATION_KEYS, "bytes_per_step", "examples_per_s", "seconds"} == set(back.figures)
    with pytest.raises(TypeError):
        checkpoint_manifest(round=1)  # a figure the manifest has no field for is refused before anything is written


def test_an_export_manifest_from_before_the_dense_optimizer_was_named_reads_as_adam(tmp_path):
    m = ExportManifest(tables={"item": 100}, dim=8, model=MODEL, chunk_rows=64, dense_steps=3, epochs=2,
                       best_epoch=1, strategy="flexshard", **sealed({}))
    finish(tmp_path, m)
    assert read_export_manifest(tmp_path) == m
    stored = json.loads((tmp_path / "manifest.json").read_text())
    assert stored["format"] == "shardflow.model" and stored["dense_optimizer"] == "adam"
    del stored["dense_optimizer"], stored["epochs"], stored["best_epoch"], stored["strategy"]
    (tmp_path / "manifest.json").write_text(json.dumps(stored))
    older = read_export_manifest(tmp_path)
    assert older.dense_optimizer == "adam" and older.epochs is None and older.tables == {"item": 100}


@pytest.mark.parametrize("key, value, message", [
    ("step", "40", r"step = '40'; accepted: int"),
    ("loss", "low", r"loss = 'low'; accepted: int or float or none"),
    ("arrays", None, r"arrays = None; accepted: dict"),
])
def test_a_bad_checkpoint_manifest_field_is_named(tmp_path, key, value, message):
    finish(tmp_path, checkpoint_manifest())
    stored = json.loads((tmp_path / "manifest.json").read_text())
    (tmp_path / "manifest.json").write_text(json.dumps({**stored, key: value}))
    with pytest.raises(InputError, match=rf"{tmp_path}/manifest.json: {message}"):
        read_checkpoint(tmp_path)
    del stored["epochs_done"]
    (tmp_path / "manifest.json").write_text(json.dumps(stored))
    with pytest.raises(InputError, match=r"epochs_done = missing; accepted: int"):
        read_checkpoint(tmp_path)
