"""The manifests of checkpoints and exports: typed records, written last, read back as they were written, and a bad
field named with what is accepted; retired checkpoints, whose manifests outlive their shards as the epochs' records."""

from __future__ import annotations

import json
import os
from dataclasses import replace

import numpy as np
import pytest
import zarr

from shardflow.errors import InputError
from shardflow.model.metrics import METRICS
from shardflow.training.epochs import checkpoint_losses, retire_checkpoints, validation_scores
from shardflow.training.validation import VALIDATION_KEYS
from storage.checkpoint import (
    RETIRED,
    CheckpointManifest,
    ExportManifest,
    checkpoint_dir,
    chunk_rows_for,
    complete_checkpoints,
    digest,
    epoch_records,
    finish,
    read_checkpoint,
    read_export_manifest,
    retire_checkpoint,
    sealed,
    sweep_retired,
    unreadable_checkpoints,
    verify_export,
    write_arrays,
)

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


def epoch_checkpoint(version, epoch: int, **figures):
    """A complete checkpoint of `epoch` with one real shard array, as the engine lays one out."""
    path = checkpoint_dir(version, epoch)
    digests = write_arrays(path / "shards" / "0" / "item", {"weights": np.full((4, 8), epoch, np.float32)},
                           "0/item")
    finish(path, replace(checkpoint_manifest(**figures), epochs_done=epoch, **sealed(digests)))
    return path


def test_a_retired_checkpoint_keeps_its_epochs_record_and_is_never_taken_for_complete(tmp_path):
    paths = [epoch_checkpoint(tmp_path, e, loss=1.0 / e, val_ndcg_at_10=0.1 * e) for e in (1, 2, 3)]
    retire_checkpoint(paths[0])
    assert [e for e, _ in complete_checkpoints(tmp_path)] == [2, 3] and unreadable_checkpoints(tmp_path) == []
    assert not (paths[0] / "shards").exists() and (paths[0] / RETIRED).is_file()
    records = epoch_records(tmp_path)
    assert [(e, m.loss, m.val_ndcg_at_10) for e, m in records] == [(1, 1.0, 0.1), (2, 0.5, 0.2), (3, 1 / 3, 0.1 * 3)]
    with pytest.raises(InputError, match="no manifest.json"):
        read_checkpoint(paths[0])  # a restore of it is refused: its shards are gone


def test_a_retirement_cut_off_part_way_is_finished_by_the_sweep_and_a_garbled_record_is_left_out(tmp_path):
    path = epoch_checkpoint(tmp_path, 1, loss=0.5)
    os.replace(path / "manifest.json", path / RETIRED)  # cut off after the rename, before the shards went
    assert complete_checkpoints(tmp_path) == [] and [e for e, _ in epoch_records(tmp_path)] == [1]
    assert sweep_retired(tmp_path) == ["epoch-000001/shards"] and not (path / "shards").exists()
    assert sweep_retired(tmp_path) == []
    (path / RETIRED).write_text('{"format": "shardflow.checkpoint", "format_ver')
    assert epoch_records(tmp_path) == []


def test_a_run_retires_all_but_its_newest_checkpoints_and_its_best_scoring_one(tmp_path):
    for e, score in enumerate([0.1, 0.5, 0.3, 0.2, 0.4], start=1):
        epoch_checkpoint(tmp_path, e, loss=1.0, val_ndcg_at_10=score)
    assert retire_checkpoints(tmp_path, None, scored=True) == []  # keep_checkpoints none: every one kept
    assert retire_checkpoints(tmp_path, 2, scored=True) == [1, 3]  # epoch 2 scored best
    assert [e for e, _ in complete_checkpoints(tmp_path)] == [2, 4, 5] and len(epoch_records(tmp_path)) == 5
    assert validation_scores(tmp_path) == {1: 0.1, 2: 0.5, 3: 0.3, 4: 0.2, 5: 0.4}
    assert retire_checkpoints(tmp_path, 1, scored=False) == [2, 4]  # without a validation split, the newest only
    assert [e for e, _ in complete_checkpoints(tmp_path)] == [5] and checkpoint_losses(tmp_path) == dict.fromkeys(
        range(1, 6), 1.0)


def test_a_tables_chunks_are_equal_and_as_few_as_the_largest_chunk_allows():
    assert [chunk_rows_for(n) for n in (0, 1, 4000, 65_536, 65_537, 131_073, 1 << 20)] == [
        1, 1, 4000, 65_536, 32_769, 43_691, 65_536]


def test_an_export_made_before_its_tables_had_chunks_of_their_own_still_verifies(tmp_path):
    """Before table_chunk_rows, every table was chunked by chunk_rows (2^16; 64 here)."""
    rows = np.arange(100 * 8, dtype=np.float32).reshape(100, 8)
    state = np.ones(100, dtype=np.float32)
    root = zarr.open_group(str(tmp_path), mode="w")
    digests = {}
    for kind, values in (("tables", rows), ("state", state)):
        root.create_array(f"{kind}/item", shape=values.shape, dtype=np.float32, chunks=(64, *values.shape[1:]))
        root[f"{kind}/item"][...] = values
        digests.update({f"{kind}/item/{s}": digest(f"{kind}/item/{s}", values[s : s + 64]) for s in (0, 64)})
    finish(tmp_path, ExportManifest(tables={"item": 100}, dim=8, model=MODEL, chunk_rows=64, dense_steps=0,
                                    **sealed(digests)))
    stored = json.loads((tmp_path / "manifest.json").read_text())
    del stored["table_chunk_rows"]
    (tmp_path / "manifest.json").write_text(json.dumps(stored))
    assert verify_export(tmp_path).rows_per_chunk("item") == 64
    root["tables/item"][70] = 0.5
    with pytest.raises(InputError, match=r"tables/item/64: rows 64\.\. do not match their checksum"):
        verify_export(tmp_path)
    (tmp_path / "manifest.json").write_text(json.dumps({**stored, "table_chunk_rows": {"item": 0}}))
    with pytest.raises(InputError, match=r"manifest.json: rows per chunk of table 'item' = 0; accepted: an integer"):
        verify_export(tmp_path)
