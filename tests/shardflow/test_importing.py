"""A night's import, without Prefect: the first night imports the finished parts, a later one appends only its
new ones, a night with none reuses the store, and what the source holds besides its parts is named."""

from __future__ import annotations

import logging
import pickle

import numpy as np
import pytest

from shardflow.config import RetrainConfig
from shardflow.errors import InputError, OtherFormat
from shardflow.importing import bring_in, dataset_store
from storage.dataset import Dataset
from storage.importers import import_dataset
from support import settled

TOPOLOGY = "intra_node_gbytes_per_s: 100\nnodes:\n  - {name: a, devices: 1, uplink_gbytes_per_s: 10}\n"


def write_part(path, day: int) -> None:
    rng = np.random.default_rng(day)
    users = np.repeat(np.arange(40) + 10 * day, 6)
    np.savetxt(path, np.stack([users, rng.integers(1, 60, users.size)], axis=1), fmt="%d")


@pytest.fixture
def night(tmp_path):
    (tmp_path / "topo.yaml").write_text(TOPOLOGY)
    parts = tmp_path / "parts"
    parts.mkdir()
    config = RetrainConfig.build({"dataset": str(parts), "run_dir": str(tmp_path / "run"),
                                  "topology": str(tmp_path / "topo.yaml")})
    return config, parts


def test_nights_import_then_append_only_new_finished_parts(night, caplog):
    config, parts = night
    log = logging.getLogger("night")
    for day in (1, 2):
        write_part(parts / f"day-{day}.txt", day)
    settled(parts / "day-1.txt", parts / "day-2.txt")
    assert dataset_store(config) is None
    first = bring_in(config, log)
    assert (first.path, first.parts_added, first.warnings) == (str(config.layout.dataset), ("day-1.txt", "day-2.txt"),
                                                               ())
    assert dataset_store(config) == config.layout.dataset
    imported = [s.checksum for s in Dataset.open(first.path).segments]

    write_part(parts / "day-3.txt", 3)
    settled(parts / "day-3.txt")
    write_part(parts / "day-4.txt", 4)  # written just now: may still be being written
    (parts / "notes").mkdir()
    with caplog.at_level(logging.INFO, "night"):
        second = bring_in(config, log)
    assert second.parts_added == ("day-3.txt",)
    assert [w.split(":")[0] for w in second.warnings] == [f"skipped 1 entries of {parts} that are not parts",
                                                          f"left 1 parts of {parts} for a later night (not finished)"]
    assert "day-4.txt" in second.warnings[1] and "notes (a directory)" in second.warnings[0]
    assert [s.checksum for s in Dataset.open(second.path).segments][:2] == imported  # appended, not re-imported
    assert f"appended 1 parts to {config.layout.dataset}" in caplog.text

    settled(parts / "day-4.txt")
    (parts / "notes").rmdir()
    assert bring_in(config, log).parts_added == ("day-4.txt",)
    again = bring_in(config, log)
    assert (again.parts_added, again.warnings) == ((), ())
    assert len(Dataset.open(again.path).segments) == 4


def test_a_store_given_as_the_dataset_is_trained_on_as_it_is_and_a_changed_chunk_stops_the_night(night, tmp_path):
    config, parts = night
    write_part(parts / "day-1.txt", 1)
    settled(parts / "day-1.txt")
    store = bring_in(config, logging.getLogger("night")).path
    as_store = RetrainConfig.build({**config.flat(), "dataset": store, "run_dir": str(tmp_path / "run2")})
    assert bring_in(as_store, logging.getLogger("night")).path == store
    item = config.layout.dataset / "segments" / "0000" / "tables" / "item"
    chunk = next(p for p in sorted(item.rglob("*")) if p.is_file() and p.name != "zarr.json")
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0xFF  # a compressed chunk that no longer decodes
    chunk.write_bytes(bytes(data))
    with pytest.raises(InputError, match=r"segments/0000/tables/item: .*To rebuild it from its part: shardflow "
                                         r"import .*--replace-from day-1.txt"):
        bring_in(as_store, logging.getLogger("night"))


def test_a_source_in_another_format_is_refused_naming_the_run_s_key_and_nothing_is_imported(night):
    """A Criteo log given to a run left at the default `dataset_format`: the line is named with the format it reads
    as and the key that picks it (`shardflow import` has --format; a run has this key); the error survives a
    pickle as a Dask worker's would."""
    config, parts = night
    (parts / "clicks.txt").write_text("label,I1,C1\n1,2,a\n")
    settled(parts / "clicks.txt")
    with pytest.raises(InputError) as refused:
        bring_in(config, logging.getLogger("night"))
    assert str(refused.value).endswith("(the line reads as the criteo format); this run's dataset_format is "
                                       "'sasrec': set dataset_format=criteo"), refused.value
    assert dataset_store(config) is None and not config.layout.dataset.exists()

    with pytest.raises(OtherFormat) as raw:
        import_dataset("sasrec", parts / "clicks.txt", config.run_dir + "/elsewhere")
    again = pickle.loads(pickle.dumps(raw.value))
    assert (type(again), str(again), again.other) == (OtherFormat, str(raw.value), "criteo")
