"""Directories of parts and `--append`: a store grown night by night equals one imported at once."""

import gzip
import os
import shutil
import signal
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest

from shardflow import errors
from shardflow.errors import InputError, Terminated
from storage.checksum import file_sha256
from storage.dataset import Dataset
from storage.importers import import_dataset
from storage.lock import writer_lock
from storage.staging import staged
from support import REAL, sequences_by_raw_user, siblings, snapshot, split_into_days


@pytest.fixture(scope="module")
def days(tmp_path_factory) -> list[Path]:
    return split_into_days(REAL["sasrec"], tmp_path_factory.mktemp("days"))


def source_with(tmp_path: Path, parts: list[Path]) -> Path:
    """A source directory holding `parts` (hard links: same files, same mtimes)."""
    src = tmp_path / "src"
    src.mkdir(exist_ok=True)
    for p in parts:
        if not (src / p.name).exists():
            os.link(p, src / p.name)
    return src


def original_sequences() -> dict[int, list[int]]:
    expected = defaultdict(list)
    for line in REAL["sasrec"].read_text().splitlines():
        user, item = map(int, line.split())
        expected[user].append(item)
    return dict(expected)


def test_days_are_a_real_split(days):
    users = [{line.split()[0] for line in p.read_text().splitlines()} for p in days]
    assert users[2] - users[0] - users[1], "some users arrive only on the last day"
    assert users[0] & users[2], "some users come back"


def test_append_of_a_day_equals_a_fresh_import_of_all_days(tmp_path, days):
    src = source_with(tmp_path, days[:2])
    first = import_dataset("sasrec", src, tmp_path / "grown")
    before = Dataset.open(tmp_path / "grown")
    rows_before = dict(zip(*(a.tolist() for a in before.raw_ids("item")), strict=True))
    users_before = before.user_ids().tolist()

    source_with(tmp_path, days)
    grown = import_dataset("sasrec", src, tmp_path / "grown", append=True)
    assert grown.parts_added == (str(src / "day-3.txt"),)
    assert grown.parts_skipped == (str(src / "day-1.txt"), str(src / "day-2.txt"))
    assert (first.manifest["version"], grown.manifest["version"]) == (1, 2)
    assert len(grown.manifest["segments"]) == 3 and grown.manifest["segments"][2]["version"] == 2

    fresh = import_dataset("sasrec", src, tmp_path / "fresh")
    assert grown.manifest["checksum"] == fresh.manifest["checksum"]
    assert [p["sha256"] for p in grown.manifest["source"]["parts"]] == [file_sha256(p) for p in days]

    ds = Dataset.open(tmp_path / "grown")
    assert sequences_by_raw_user(ds) == original_sequences()
    rows_after = dict(zip(*(a.tolist() for a in ds.raw_ids("item")), strict=True))
    assert all(rows_after[raw] == row for raw, row in rows_before.items())
    assert sorted(rows_after.values()) == list(range(ds.info.table("item").rows))
    assert ds.user_ids().tolist()[: len(users_before)] == users_before
    assert (ds.info.users, ds.info.interactions) == (31013, 287107)


def test_a_repeated_append_adds_nothing_and_changes_no_byte(tmp_path, days):
    src = source_with(tmp_path, days)
    import_dataset("sasrec", src, tmp_path / "ds")
    before = snapshot(tmp_path / "ds")
    again = import_dataset("sasrec", src, tmp_path / "ds", append=True)
    assert again.parts_added == () and len(again.parts_skipped) == 3 and again.manifest["version"] == 1
    assert snapshot(tmp_path / "ds") == before


def test_parts_are_scanned_in_parallel_on_dask_with_the_same_result(client, tmp_path, days):
    src = source_with(tmp_path, days)
    alone = import_dataset("sasrec", src, tmp_path / "alone")
    on_dask = import_dataset("sasrec", src, tmp_path / "dask", client=client)
    assert on_dask.manifest["checksum"] == alone.manifest["checksum"]
    assert siblings(tmp_path / "dask") == ["alone", "src"]


def test_append_to_a_missing_store_is_a_fresh_import(tmp_path, days):
    src = source_with(tmp_path, days[:1])
    m = import_dataset("sasrec", src, tmp_path / "ds", append=True)
    assert m.manifest["version"] == 1 and m.parts_added == (str(src / "day-1.txt"),)


@pytest.mark.parametrize("damage, message", [
    ("rewrite", r"part 'day-1.txt' changed since version 1 imported it"),
    ("remove", r"part 'day-1.txt' of .* \(version 1\) is gone"),
    ("early", r"new part 'day-0.txt' sorts before 'day-2.txt', already imported"),
])
def test_a_source_that_is_not_a_continuation_is_refused_and_the_store_kept(tmp_path, days, damage, message):
    src = source_with(tmp_path, days[:2])
    import_dataset("sasrec", src, tmp_path / "ds")
    before = snapshot(tmp_path / "ds")
    source_with(tmp_path, days)
    first = src / "day-1.txt"
    if damage == "rewrite":
        text = first.read_bytes()
        first.unlink()
        first.write_bytes(text.replace(b"1 ", b"7 ", 1))
    elif damage == "remove":
        first.unlink()
    else:
        shutil.copy(days[2], src / "day-0.txt")
    with pytest.raises(InputError, match=message):
        import_dataset("sasrec", src, tmp_path / "ds", append=True)
    assert snapshot(tmp_path / "ds") == before


def test_a_part_rewritten_with_the_same_bytes_is_still_the_same_part(tmp_path, days):
    src = source_with(tmp_path, days[:2])
    import_dataset("sasrec", src, tmp_path / "ds")
    text = (src / "day-1.txt").read_bytes()
    (src / "day-1.txt").unlink()
    (src / "day-1.txt").write_bytes(text)  # a new mtime, the same content: hashed, then accepted
    assert import_dataset("sasrec", src, tmp_path / "ds", append=True).parts_added == ()


def test_two_writers_exclude_each_other(tmp_path, days):
    src = source_with(tmp_path, days[:2])
    import_dataset("sasrec", src, tmp_path / "ds")
    source_with(tmp_path, days)
    before = snapshot(tmp_path / "ds")
    with writer_lock(tmp_path / "ds"):  # another writer, as far as flock is concerned (its own open file)
        with pytest.raises(InputError, match=r"ds is held by another process \(host .*, pid \d+, since .*\); "
                                             "accepted: one writer of a store at a time"):
            import_dataset("sasrec", src, tmp_path / "ds", append=True)
        with pytest.raises(InputError, match="is held by another process"):
            import_dataset("sasrec", src, tmp_path / "ds", overwrite=True)
    assert snapshot(tmp_path / "ds") == before
    assert not (tmp_path / ".ds.lock").exists()  # released, and removed
    assert import_dataset("sasrec", src, tmp_path / "ds", append=True).parts_added == (str(src / "day-3.txt"),)


def test_an_append_cut_off_before_its_manifest_leaves_the_store_as_it_was(tmp_path, days):
    src = source_with(tmp_path, days[:2])
    import_dataset("sasrec", src, tmp_path / "ds")
    # What a killed append leaves: a segment renamed into place, the manifest not yet replaced.
    shutil.copytree(tmp_path / "ds" / "segments" / "0001", tmp_path / "ds" / "segments" / "0002")
    (tmp_path / "ds" / "segments" / ".append.staging-0123456789ab").mkdir()
    ds = Dataset.open(tmp_path / "ds")
    assert ds.info.version == 1 and len(ds.segments) == 2
    source_with(tmp_path, days)
    import_dataset("sasrec", src, tmp_path / "ds", append=True)
    assert sorted(p.name for p in (tmp_path / "ds" / "segments").iterdir()) == ["0000", "0001", "0002", "zarr.json"]
    assert sequences_by_raw_user(Dataset.open(tmp_path / "ds")) == original_sequences()


def test_recbole_parts_are_regrouped_by_user_and_time_across_parts(tmp_path):
    lines = REAL["recbole"].read_text().splitlines()
    header, body = lines[0], lines[1:]
    cut = np.median([float(line.split("\t")[3]) for line in body])
    src = tmp_path / "src"
    src.mkdir()
    for name, keep in (("a.inter", lambda ts: ts < cut), ("b.inter", lambda ts: ts >= cut)):
        kept = [line for line in body if keep(float(line.split("\t")[3]))]
        (src / name).write_text("\n".join([header] + kept) + "\n")
    import_dataset("recbole", REAL["recbole"], tmp_path / "whole")
    whole = Dataset.open(tmp_path / "whole")
    (src / "b.inter").rename(tmp_path / "b.inter")
    import_dataset("recbole", src, tmp_path / "grown")
    (tmp_path / "b.inter").rename(src / "b.inter")
    import_dataset("recbole", src, tmp_path / "grown", append=True)
    grown = Dataset.open(tmp_path / "grown")
    assert sequences_by_raw_user(grown) == sequences_by_raw_user(whole)
    assert all(np.array_equal(a, ratings(whole)[u]) for u, a in ratings(grown).items())


def ratings(ds: Dataset) -> dict:
    return dict(zip(ds.user_ids().tolist(), np.split(ds.column("dense/rating"), ds.offsets()[1:-1]), strict=True))


def test_criteo_parts_hash_the_same_rows_as_one_file(tmp_path):
    lines = REAL["criteo"].read_text().splitlines()
    src = tmp_path / "src"
    src.mkdir()
    (src / "1.csv").write_text("\n".join(lines[:121]) + "\n")
    (src / "2.csv").write_text("\n".join(lines[:1] + lines[121:]) + "\n")
    import_dataset("criteo", REAL["criteo"], tmp_path / "whole", hash_rows=1000)
    import_dataset("criteo", src, tmp_path / "parts", hash_rows=1000)
    whole, parts = Dataset.open(tmp_path / "whole"), Dataset.open(tmp_path / "parts")
    assert parts.info.users == parts.info.interactions == 200
    for t in whole.info.table_names:
        np.testing.assert_array_equal(parts.ids(t), whole.ids(t))
        assert (dict(zip(*(a.tolist() for a in parts.raw_ids(t)), strict=True))
                == dict(zip(*(a.tolist() for a in whole.raw_ids(t)), strict=True)))
    np.testing.assert_array_equal(parts.column("labels"), whole.column("labels"))
    np.testing.assert_array_equal(parts.column("dense/I5"), whole.column("dense/I5"))
    with pytest.raises(InputError, match=r"was imported with .*; accepted: the same options \(--hash-rows 1000\)"):
        import_dataset("criteo", src, tmp_path / "parts", hash_rows=999, append=True)


def test_a_gzip_source_imports_like_the_plain_file(tmp_path):
    gz = tmp_path / "Video.txt.gz"
    gz.write_bytes(gzip.compress(REAL["sasrec"].read_bytes()))
    plain = import_dataset("sasrec", REAL["sasrec"], tmp_path / "plain")
    packed = import_dataset("sasrec", gz, tmp_path / "packed", block_bytes=1 << 16)
    assert packed.manifest["checksum"] == plain.manifest["checksum"]
    assert packed.manifest["source"]["parts"][0]["sha256"] == file_sha256(gz)


def test_a_fresh_import_never_replaces_a_store_another_writer_published_meanwhile(tmp_path):
    dest = tmp_path / "ds"
    with pytest.raises(InputError, match="another writer published a store there meanwhile; it is kept"):
        with staged(dest, overwrite=False) as stage:
            (stage / "manifest.json").write_text("{}")
            import_dataset("sasrec", REAL["sasrec"], dest)  # the other writer, finishing first
    assert Dataset.open(dest).info.users == 31013
    assert siblings(dest) == []


def test_a_stop_whose_exception_was_lost_publishes_no_store_and_changes_none(tmp_path, days, monkeypatch):
    """SIGTERM noted while a store is written, its exception lost in a finalizer (an import once went on and
    published its store, exit 0): neither a staged store nor an append is published, and the store is kept."""
    monkeypatch.setattr(errors, "_asked", [])
    with pytest.raises(Terminated):
        with staged(tmp_path / "new", overwrite=False) as stage:
            (stage / "manifest.json").write_text("{}")
            errors.note_stop(signal.SIGTERM)  # as the command's signal watcher does, whatever the handler did
    assert not (tmp_path / "new").exists() and siblings(tmp_path / "new") == []
    errors._asked.clear()
    src = source_with(tmp_path, days[:2])
    import_dataset("sasrec", src, tmp_path / "ds")
    before = snapshot(tmp_path / "ds")
    source_with(tmp_path, days)
    errors.note_stop(signal.SIGTERM)
    with pytest.raises(Terminated):
        import_dataset("sasrec", src, tmp_path / "ds", append=True)
    with pytest.raises(Terminated):
        import_dataset("sasrec", src, tmp_path / "other")
    assert snapshot(tmp_path / "ds") == before and not (tmp_path / "other").exists()
    assert sorted(p.name for p in (tmp_path / "ds" / "segments").iterdir()) == ["0000", "0001", "zarr.json"]


def test_what_a_parts_directory_holds_besides_parts_is_named_not_read(tmp_path):
    import os

    from storage.sources import not_parts, resolve_parts

    src = tmp_path / "logs"
    src.mkdir()
    (src / "day-1.txt").write_text("1 2\n1 3\n")
    (src / ".day-2.txt.swp").write_text("")
    (src / "old").mkdir()
    os.mkfifo(src / "pipe")
    (src / "gone").symlink_to(src / "nowhere")
    (src / "loop").symlink_to(src / "loop")
    assert [p.name for p in resolve_parts(src)] == ["day-1.txt"]
    assert not_parts(src) == [".day-2.txt.swp (hidden)", "gone (a broken or looping link)",
                              "loop (a broken or looping link)", "old (a directory)", "pipe (not a regular file)"]
    assert not_parts(src / "day-1.txt") == []


def test_a_refused_write_leaves_no_lock_file_and_a_lock_on_a_removed_file_is_not_taken(tmp_path, days):
    import fcntl
    import os

    from storage.lock import _still_at, writer_lock_path

    src = source_with(tmp_path, days[:1])
    import_dataset("sasrec", src, tmp_path / "ds")
    with pytest.raises(InputError, match="already"):
        import_dataset("sasrec", src, tmp_path / "ds")  # refused inside the lock: the store exists
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds", "src"]
    # A writer that opened the lock file just before its holder removed it locks a file nobody else will see.
    with writer_lock(tmp_path / "ds"):
        late = os.open(writer_lock_path(tmp_path / "ds"), os.O_RDWR)
    fcntl.flock(late, fcntl.LOCK_EX | fcntl.LOCK_NB)  # succeeds: the removed file is no one's now
    assert not _still_at(late, writer_lock_path(tmp_path / "ds"))
    os.close(late)
