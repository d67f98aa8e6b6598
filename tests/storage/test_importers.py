"""Importers on the bundled real files, and every kind of bad source they must refuse."""

from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest

from support import REAL, siblings, snapshot
from shardflow.errors import InputError
from storage.dataset import Dataset
from storage.importers import import_dataset


def sequences(ds: Dataset, table: str = "item") -> dict:
    """raw user index -> list of raw item ids, read back from the store."""
    off = ds.offsets()
    raw, rows = ds.raw_ids(table)
    raw_of_row = dict(zip(rows.tolist(), raw.tolist()))
    ids = ds.ids(table)
    return {u: [raw_of_row[i] for i in ids[off[u] : off[u + 1]].tolist()] for u in range(ds.info.users)}


def test_sasrec_keeps_every_users_items_in_file_order(tmp_path):
    import_dataset("sasrec", REAL["sasrec"], tmp_path / "ds")
    ds = Dataset.open(tmp_path / "ds")
    expected = defaultdict(list)
    for line in REAL["sasrec"].read_text().splitlines():
        user, item = map(int, line.split())
        expected[user].append(item)
    assert (ds.info.users, ds.info.interactions, ds.info.table("item").rows) == (31013, 287107, 23715)
    got = sequences(ds)
    assert [got[u] for u in range(ds.info.users)] == [expected[u] for u in sorted(expected)]
    assert ds.info.sequence_table == "item"
    assert ds.ids("item").dtype == np.int32


def test_s3rec_one_user_per_line(tmp_path):
    import_dataset("s3rec", REAL["s3rec"], tmp_path / "ds")
    ds = Dataset.open(tmp_path / "ds")
    lines = [list(map(int, line.split())) for line in REAL["s3rec"].read_text().splitlines()]
    expected = {f[0]: f[1:] for f in lines}
    got = sequences(ds)
    assert [got[u] for u in range(ds.info.users)] == [expected[u] for u in sorted(expected)]
    assert (ds.info.users, ds.info.interactions, ds.info.table("item").rows) == (22363, 198502, 12101)


def test_recbole_orders_each_users_events_by_timestamp(tmp_path):
    import_dataset("recbole", REAL["recbole"], tmp_path / "ds")
    ds = Dataset.open(tmp_path / "ds")
    rows = [line.split("\t") for line in REAL["recbole"].read_text().splitlines()[1:]]
    by_user = defaultdict(list)
    for i, (user, item, rating, ts) in enumerate(rows):
        by_user[user].append((float(ts), i, item, float(rating)))
    expected = [[item for _, _, item, _ in sorted(by_user[u])] for u in sorted(by_user)]
    got = sequences(ds)
    assert [got[u] for u in range(ds.info.users)] == expected
    ratings = [r for u in sorted(by_user) for _, _, _, r in sorted(by_user[u])]
    np.testing.assert_array_equal(ds.column("dense/rating"), np.array(ratings, dtype=np.float32))
    assert (ds.info.users, ds.info.interactions, ds.info.table("item").rows) == (943, 100000, 1682)


def test_criteo_hashes_each_categorical_column_into_its_own_table(tmp_path):
    import_dataset("criteo", REAL["criteo"], tmp_path / "ds", table_rows={"C1": 7}, hash_rows=1000)
    ds = Dataset.open(tmp_path / "ds")
    lines = [line.split(",") for line in REAL["criteo"].read_text().splitlines()]
    header, body = lines[0], lines[1:]
    assert ds.info.users == ds.info.interactions == 200
    assert ds.info.sequence_table is None
    assert [t.name for t in ds.info.tables] == [f"C{i}" for i in range(1, 27)]
    assert ds.info.table("C1").rows == 7 and ds.info.table("C2").rows == 1000
    for name in ("C1", "C14", "C26"):
        col = header.index(name)
        raw, rows = ds.raw_ids(name)
        row_of = dict(zip(raw.tolist(), rows.tolist()))
        assert ds.ids(name).tolist() == [row_of[line[col]] for line in body]
    np.testing.assert_array_equal(ds.column("labels"), [float(line[0]) for line in body])
    i2 = ds.column("dense/I2")
    assert i2[0] == 3 and i2[1] == -1
    assert np.isnan(ds.column("dense/I1")[0])


def test_import_is_deterministic(tmp_path):
    a = import_dataset("sasrec", REAL["sasrec"], tmp_path / "a")
    b = import_dataset("sasrec", REAL["sasrec"], tmp_path / "b")
    assert a["checksum"] == b["checksum"]
    assert a["source"]["sha256"].startswith("sha256:")


def write(tmp_path: Path, name: str, text: str | bytes) -> Path:
    p = tmp_path / name
    p.write_bytes(text if isinstance(text, bytes) else text.encode())
    return p


BAD_SOURCES = [
    ("sasrec", "1 5\n1 6\n2 x7\n", r"bad\.txt:3: item 'x7' is not accepted; accepted: an integer >= 0"),
    ("sasrec", "1 5\n1 6\n2\n", r"bad\.txt:3: '2' has 1 fields; accepted: 'user item'"),
    ("sasrec", "1 5\n1 6 9\n", r"bad\.txt:2: '1 6 9' has 3 fields"),
    ("sasrec", "1 5\n-3 6\n", r"bad\.txt:2: user '-3' is not accepted"),
    ("sasrec", "\n\n", r"empty file; accepted: at least one interaction"),
    ("sasrec", b"1 5\n\xff\xfe 6\n", r"not UTF-8 text"),
    ("s3rec", "1 2 3\n2\n", r"bad\.txt:2: '2' has no items"),
    ("recbole", "user_id:token\titem_id:token\n1\t2\n3\n", r"bad\.txt:3: 1 tab-separated fields; accepted: 2"),
    ("recbole", "user_id:token\tstamp:float\n1\t2\n", r"no 'item_id:token' field"),
    ("recbole", "user_id:token\titem_id:token\tclass:token_seq\n1\t2\ta b\n", r"header field 'class:token_seq'"),
    ("recbole", "user_id:token\titem_id:token\ttimestamp:float\n1\t2\tsoon\n", r"bad\.txt:2: timestamp = 'soon'"),
    ("recbole", "user_id:token\titem_id:token\ttimestamp:float\n1\t2\tinf\n", r"timestamp = 'inf'; accepted: a finite"),
    ("recbole", "user_id:token\titem_id:token\n", r"a header but no interactions"),
    ("criteo", "label,I1,C1\n0,1,aa\n1,2\n", r"bad\.txt:3: 2 fields separated by ','; accepted: 3"),
    ("criteo", "label,I1,C1\n0,1,aa\n2,2,bb\n", r"bad\.txt:3: label '2'; accepted: 0 or 1"),
    ("criteo", "label,I1,C1\n0,nan,aa\n", r"bad\.txt:2: I1 = 'nan'"),
    ("criteo", "label,X1,C1\n0,1,aa\n", r"header columns \['X1'\]"),
]


@pytest.mark.parametrize("fmt, text, message", BAD_SOURCES)
def test_bad_source_is_refused_with_its_line_and_writes_nothing(tmp_path, fmt, text, message):
    src = write(tmp_path, "bad.txt", text)
    dest = tmp_path / "out" / "ds"
    with pytest.raises(InputError, match=message):
        import_dataset(fmt, src, dest)
    assert not dest.exists()
    assert not (tmp_path / "out").exists() or siblings(dest) == []


def test_bad_options_are_refused_before_reading(tmp_path):
    src = write(tmp_path, "ok.txt", "1 2\n")
    with pytest.raises(InputError, match="format 'csv' is not known; accepted: sasrec, s3rec, recbole, criteo"):
        import_dataset("csv", src, tmp_path / "ds")
    with pytest.raises(InputError, match="no such file"):
        import_dataset("sasrec", tmp_path / "missing.txt", tmp_path / "ds")
    with pytest.raises(InputError, match="only for hashed criteo columns"):
        import_dataset("sasrec", src, tmp_path / "ds", table_rows={"C1": 5})
    with pytest.raises(InputError, match=r"--table-rows C99: no such categorical column"):
        import_dataset("criteo", REAL["criteo"], tmp_path / "ds", table_rows={"C99": 5})
    with pytest.raises(InputError, match=r"C1: 0 rows; accepted: an integer >= 1"):
        import_dataset("criteo", REAL["criteo"], tmp_path / "ds", table_rows={"C1": 0})
    assert not (tmp_path / "ds").exists()


def test_existing_store_is_refused_without_overwrite_and_kept_byte_for_byte(tmp_path):
    dest = tmp_path / "ds"
    import_dataset("s3rec", REAL["s3rec"], dest)
    before = snapshot(dest)
    with pytest.raises(InputError, match="already holds a store; pass --overwrite"):
        import_dataset("sasrec", REAL["sasrec"], dest)
    assert snapshot(dest) == before


def test_failed_overwrite_leaves_the_existing_store_intact(tmp_path):
    dest = tmp_path / "ds"
    import_dataset("s3rec", REAL["s3rec"], dest)
    before = snapshot(dest)
    src = write(tmp_path, "bad.txt", "1 2\n" * 1000 + "1 two\n")
    with pytest.raises(InputError, match=r"bad\.txt:1001"):
        import_dataset("sasrec", src, dest, overwrite=True)
    assert snapshot(dest) == before
    assert siblings(dest) == ["bad.txt"]


def test_overwrite_replaces_a_store_completely(tmp_path):
    dest = tmp_path / "ds"
    import_dataset("criteo", REAL["criteo"], dest, hash_rows=100)
    import_dataset("sasrec", REAL["sasrec"], dest, overwrite=True)
    ds = Dataset.open(dest)
    assert ds.info.table_names == ["item"]
    assert not (dest / "tables" / "C1").exists()
    assert siblings(dest) == []


def test_a_directory_that_is_not_a_store_is_never_replaced(tmp_path):
    dest = tmp_path / "mine"
    dest.mkdir()
    (dest / "notes.txt").write_text("keep me")
    with pytest.raises(InputError, match="is not empty and is not a shardflow store; refusing to replace it"):
        import_dataset("sasrec", REAL["sasrec"], dest, overwrite=True)
    assert (dest / "notes.txt").read_text() == "keep me"
