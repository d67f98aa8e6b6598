"""A dataset store is validated when opened: every damaged store names what is wrong."""

import json
import shutil
from itertools import pairwise

import numpy as np
import pytest
import zarr

from shardflow.errors import InputError
from storage import dataset as dataset_module
from storage.dataset import Dataset
from storage.dataset_writer import SegmentWriter
from storage.importers import import_dataset
from support import REAL


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    path = tmp_path_factory.mktemp("ds") / "video"
    import_dataset("sasrec", REAL["sasrec"], path)
    return path


@pytest.fixture
def copy(store, tmp_path):
    dest = tmp_path / "copy"
    shutil.copytree(store, dest)
    return dest


def edit_manifest(path, **changes):
    m = json.loads((path / "manifest.json").read_text())
    m.update(changes)
    (path / "manifest.json").write_text(json.dumps(m))


def test_open_reads_what_the_manifest_says(store):
    ds = Dataset.open(store)
    assert ds.info.users == 31013 and ds.info.interactions == 287107
    assert ds.info.table("item").rows == 23715
    assert ds.info.source["format"] == "sasrec"
    with pytest.raises(InputError, match="no table 'user' in this dataset; accepted: item"):
        ds.info.table("user")


def test_a_store_is_hashed_on_open_only_when_its_record_is_missing_and_by_a_run_always(copy):
    record = copy / "verified.json"
    first = record.read_text()
    record.unlink()
    Dataset.open(copy)  # hashes every array, finds them as written, records that again
    assert record.read_text() == first
    (copy / "segments" / "0000" / "tables" / "item" / "c" / "0").write_bytes(b"garbage")
    Dataset.open(copy)  # recorded: not hashed on open (the profiler and trainer read ids in range-checked chunks)
    damaged = r"segments/0000/tables/item: unreadable \(RuntimeError: error during blosc decompression"
    with pytest.raises(InputError, match=damaged):
        Dataset.open(copy, hashed=False).verify()  # what a run checks before it trains, record or not
    record.unlink()
    with pytest.raises(InputError, match=damaged):
        Dataset.open(copy)


def test_a_store_without_manifest_is_not_a_dataset(copy):
    (copy / "manifest.json").unlink()
    with pytest.raises(InputError, match="is not a complete dataset store: it has no manifest.json"):
        Dataset.open(copy)


def test_missing_directory_and_a_source_file_given_for_a_store(tmp_path):
    with pytest.raises(InputError, match="nothing: no such directory; accepted: a dataset store written by"):
        Dataset.open(tmp_path / "nothing")
    (tmp_path / "log.txt").write_text("1 2\n")
    with pytest.raises(InputError, match=r"log\.txt: a file, not a directory; accepted: a dataset store written by "
                                         r"'shardflow import'"):
        Dataset.open(tmp_path / "log.txt")


SEG = "segments/0000"


def test_missing_array(copy):
    shutil.rmtree(copy / SEG / "tables" / "item")
    with pytest.raises(InputError, match="array 'segments/0000/tables/item' is missing"):
        Dataset.open(copy)


def test_wrong_dtype(copy):
    n = Dataset.open(copy).info.interactions
    shutil.rmtree(copy / SEG / "tables" / "item")
    zarr.open_group(str(copy / SEG), mode="a").create_array("tables/item", shape=(n,), dtype=np.float32, chunks=(n,))
    with pytest.raises(InputError, match=r"tables/item: dtype float32; accepted: an integer dtype"):
        Dataset.open(copy)


@pytest.mark.parametrize("chunk", [1 << 20, 4096])  # checked a chunk at a time: across two chunks too
def test_non_monotone_offsets(copy, monkeypatch, chunk):
    monkeypatch.setattr(dataset_module, "OFFSETS_PER_CHUNK", chunk)
    offsets = zarr.open_array(str(copy / SEG / "offsets"), mode="a")
    offsets[4097] = int(offsets[4096]) - 1
    with pytest.raises(InputError, match=r"offsets\[4097\] = \d+ is below offsets\[4096\]"):
        Dataset.open(copy)
    offsets[4097] = int(offsets[4096])  # an empty run is fine; a user id out of range in a later chunk is not
    users = zarr.open_array(str(copy / SEG / "users"), mode="a")
    users[4099] = Dataset.open(copy).info.users
    with pytest.raises(InputError, match=r"users\[4099\] = \d+; accepted: 0 <= user <"):
        Dataset.open(copy)


def test_offsets_that_do_not_cover_the_events(copy):
    offsets = zarr.open_array(str(copy / SEG / "offsets"), mode="a")
    offsets[-1] = 5
    with pytest.raises(InputError, match="offsets: runs from 0 to 5; accepted: from 0 to 287107"):
        Dataset.open(copy)


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"format": "shardflow.profile"}, "format is 'shardflow.profile'; accepted: 'shardflow.dataset'"),
        ({"format_version": 99}, "format_version is 99; accepted: 2"),
        ({"interactions": 287108}, r"the segments hold 287107 events; the manifest says 287108"),
        ({"interactions": 0, "users": 0}, "empty dataset"),
        ({"users": -1}, r"users = -1; accepted: an integer >= 0"),
        ({"tables": {}}, "the dataset has no tables"),
        ({"tables": {"item": {"rows": 0}}}, r"rows = 0; accepted: an integer >= 1"),
        ({"tables": {"genre": {"rows": 5}}}, "array 'segments/0000/tables/genre' is missing"),
        ({"tables": {"item": {"rows": 23715, "width": 3}}},
         r"tables/item: not an array of shape \[287107, 3\]; accepted: that shape, as the manifest declares"),
        ({"tables": {"item": {"rows": 23715, "width": 0}}}, r"table widths \{'item': 0\}; accepted: widths >= 1"),
        ({"tables": {"item": {"rows": 23715, "width": "3"}}}, r"tables\.item\.width = '3'; accepted: an integer"),
        ({"users": 30000}, r"users\[\d+\] = 30000; accepted: 0 <= user < 30000"),
    ],
)
def test_manifest_that_does_not_match_the_arrays(copy, changes, message):
    edit_manifest(copy, **changes)
    with pytest.raises(InputError, match=message):
        Dataset.open(copy)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"events": "287107"}, r"manifest.json segments\[0\]: events = '287107'; accepted: int"),
        ({"arrays": None}, r"manifest.json segments\[0\]: arrays = None; accepted: dict"),
        ({"runs": -2}, r"runs = -2; accepted: an integer >= 0"),
    ],
)
def test_a_malformed_segment_is_refused_naming_its_key(copy, change, message):
    m = json.loads((copy / "manifest.json").read_text())
    edit_manifest(copy, segments=[{**m["segments"][0], **change}])
    with pytest.raises(InputError, match=message):
        Dataset.open(copy)
    del m["segments"][0]["new_users"]
    edit_manifest(copy, segments=m["segments"])
    with pytest.raises(InputError, match=r"segments\[0\]: new_users = missing; accepted: int"):
        Dataset.open(copy)


def test_garbage_manifest(copy):
    (copy / "manifest.json").write_text("{not json")
    with pytest.raises(InputError, match="not valid JSON"):
        Dataset.open(copy)


def test_blocks_are_chunk_aligned_and_cover_every_event(store):
    ds = Dataset.open(store)
    for parts in (1, 2, 7):
        blocks = ds.blocks("item", parts)
        assert {array for array, _, _ in blocks} == {"segments/0000/tables/item"}
        assert blocks[0][1] == 0 and blocks[-1][2] == ds.info.interactions
        assert all(a < b for _, a, b in blocks)
        assert all(b0[2] == b1[1] for b0, b1 in pairwise(blocks))
        chunk = zarr.open_array(str(store / "segments/0000/tables/item")).chunks[0]
        assert all(a % chunk == 0 for _, a, _ in blocks)


@pytest.mark.parametrize("events", [0, 1, 5, dataset_module.OFFSETS_PER_CHUNK + 3])
def test_a_click_part_writes_its_own_users_as_the_whole_arrays_would(tmp_path, events):
    """Every event its own user: the numbers written a chunk at a time are the arrays, chunks and digests
    that writing them whole gives."""
    first = 7
    streamed = SegmentWriter(tmp_path / "streamed", events=events, runs=events, tables={})
    streamed.write_own_users(first)
    whole = SegmentWriter(tmp_path / "whole", events=events, runs=events, tables={})
    numbers = np.arange(first, first + events, dtype=np.int64)
    whole.write_runs(numbers, np.arange(events + 1))
    whole.write_user_ids(numbers)
    a, b = streamed.finish("s", 1), whole.finish("s", 1)
    assert a == b and a["new_users"] == events and set(a["arrays"]) == {"users", "offsets", "user_ids"}
    for path in ("users", "offsets", "user_ids"):
        x, y = zarr.open_array(str(tmp_path / "streamed" / path)), zarr.open_array(str(tmp_path / "whole" / path))
        assert x.chunks == y.chunks and np.array_equal(x[:], y[:])


def test_short_blocks_from_one_refilled_buffer_are_stored_as_written(tmp_path):
    """The writer gathers short blocks before it stores them (dataset_writer.WRITE_VALUES): a caller that refills
    one buffer for every block must find each block's values stored, not the buffer's last."""
    events = 3 * (1 << 14) + 5
    writer = SegmentWriter(tmp_path / "seg", events=events, runs=1, tables={"item": np.int64}, events_per_chunk=4096)
    buffer = np.empty(1000, np.int64)
    for a in range(0, events, buffer.size):
        block = buffer[: min(buffer.size, events - a)]
        block[:] = np.arange(a, a + block.size)
        writer.write("tables/item", block)
    writer.write_runs(np.zeros(1, np.int64), np.array([0, events]))
    writer.write_user_ids(np.zeros(1, np.int64))
    writer.finish("s", 1)
    assert np.array_equal(zarr.open_array(str(tmp_path / "seg" / "tables" / "item"))[:], np.arange(events))
