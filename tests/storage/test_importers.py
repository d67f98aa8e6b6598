"""Importers on the bundled real files, and every kind of bad source they must refuse."""

import gzip
import zlib
from collections import defaultdict
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given
from hypothesis import strategies as st

from shardflow.errors import InputError
from storage.checksum import combine, file_sha256
from storage.dataset import Dataset
from storage.idmap import crc32_text
from storage.importers import import_dataset
from support import AVAZU, REAL, siblings, snapshot

# The content checksums the line-by-line parser this importer replaced (commit 6f2827c)
# gave the bundled files: the streamed, columnar import must store exactly the same arrays.
LINE_BY_LINE = {
    "sasrec": "sha256:1caf1ff6a744056cd3318623b757a1890ba1ab2c9128929fcedf919fccb10b2f",
    "s3rec": "sha256:8bdd7fa1948507b82d6d918c1b2e6ec2460320140715a7a27cd9f545bc6d68f2",
    "recbole": "sha256:f0cd8ec36c8fb7f13155712fd25988ec1ba24099a1081dc274be5157e57fe97c",
    "criteo": "sha256:e3343ca7ba1d163ae43e6369b9265f7320f1f3d0cb99bb4be409767adf756711",
}
# The arrays it wrote; a segment also holds its runs' users and the raw user ids.
LINE_BY_LINE_ARRAYS = ("offsets", "tables/", "raw_ids/", "raw_rows/", "dense/", "labels")


def content_checksum(segment: dict) -> str:
    return combine({p: d for p, d in segment["arrays"].items() if p.startswith(LINE_BY_LINE_ARRAYS)})


def sequences(ds: Dataset, table: str = "item") -> dict:
    """raw user index -> list of raw item ids, read back from the store."""
    off = ds.offsets()
    raw, rows = ds.raw_ids(table)
    raw_of_row = dict(zip(rows.tolist(), raw.tolist(), strict=True))
    ids = ds.ids(table)
    return {u: [raw_of_row[i] for i in ids[off[u] : off[u + 1]].tolist()] for u in range(ds.info.users)}


@pytest.mark.parametrize("fmt", sorted(LINE_BY_LINE))
@pytest.mark.parametrize("block_bytes", [1 << 24, 1 << 12])
def test_every_bundled_file_stores_what_the_line_by_line_parser_stored(tmp_path, fmt, block_bytes):
    options = {"hash_rows": 1000, "table_rows": {"C1": 7}} if fmt == "criteo" else {}
    m = import_dataset(fmt, REAL[fmt], tmp_path / "ds", block_bytes=block_bytes, **options)
    assert content_checksum(m.manifest["segments"][0]) == LINE_BY_LINE[fmt]


@given(st.lists(st.text(max_size=12), max_size=40))
def test_vectorised_crc32_equals_zlib(values):
    expected = [zlib.crc32(v.encode()) for v in values]
    assert crc32_text(pa.array(values, pa.string())).tolist() == expected


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


def test_a_tab_separated_sasrec_file_imports_as_the_space_separated_one(tmp_path):
    """sasrec's user and item may be separated by a tab (the first line says which); the id checks that came after
    that support refused every tab, and the refusal named no line ("lines arrow's CSV reader cannot parse")."""
    tabs = write(tmp_path, "tabs.txt", REAL["sasrec"].read_text().replace(" ", "\t"))
    import_dataset("sasrec", REAL["sasrec"], tmp_path / "spaces")
    import_dataset("sasrec", tabs, tmp_path / "tabs")
    spaces, tabbed = Dataset.open(tmp_path / "spaces"), Dataset.open(tmp_path / "tabs")
    assert tabbed.info.interactions == 287107 and sequences(tabbed) == sequences(spaces)
    with pytest.raises(InputError, match=r"bad\.txt:2: item '06' is not accepted; accepted: an integer >= 0 \(ASCII "
                                         r"digits, at most 18, no leading zero\)$"):
        import_dataset("sasrec", write(tmp_path, "bad.txt", "1\t2\n5\t06\n"), tmp_path / "bad")


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
        row_of = dict(zip(raw.tolist(), rows.tolist(), strict=True))
        assert ds.ids(name).tolist() == [row_of[line[col]] for line in body]
    np.testing.assert_array_equal(ds.column("labels"), [float(line[0]) for line in body])
    i2 = ds.column("dense/I2")
    assert i2[0] == 3 and i2[1] == -1
    assert np.isnan(ds.column("dense/I1")[0])


def test_criteo_tables_sized_exact_get_a_row_per_distinct_value_that_appends_extend(tmp_path):
    lines = REAL["criteo"].read_text().splitlines()
    header, body = lines[0], lines[1:]
    parts = tmp_path / "parts"
    parts.mkdir()
    (parts / "day1.csv").write_text("\n".join([header, *body[:120]]) + "\n")
    import_dataset("criteo", parts, tmp_path / "ds", table_rows={"C1": 7}, hash_rows="exact")
    first = {t.name: t.rows for t in Dataset.open(tmp_path / "ds").info.tables}
    (parts / "day2.csv").write_text("\n".join([header, *body[120:]]) + "\n")
    import_dataset("criteo", parts, tmp_path / "ds", append=True, table_rows={"C1": 7}, hash_rows="exact")
    ds = Dataset.open(tmp_path / "ds")
    names = header.split(",")
    for name in ("C2", "C10", "C26"):
        col = names.index(name)
        values = [line.split(",")[col] for line in body]
        assert first[name] == len(set(values[:120])) and ds.info.table(name).rows == len(set(values))
        raw, rows = ds.raw_ids(name)
        row_of = dict(zip(raw.tolist(), rows.tolist(), strict=True))
        assert sorted(rows.tolist()) == list(range(len(set(values))))
        assert ds.ids(name).tolist() == [row_of[v] for v in values]
    assert ds.info.table("C1").rows == 7
    with pytest.raises(InputError, match="'many' rows; accepted: an integer from 1 to 2,147,483,647 .* or 'exact'"):
        import_dataset("criteo", parts, tmp_path / "other", hash_rows="many")


def test_criteo_takes_avazus_layout_with_the_hour_of_day_as_a_table(tmp_path):
    src = AVAZU
    import_dataset("criteo", src, tmp_path / "ds", table_rows={"hour": 24}, hash_rows=1000)
    ds = Dataset.open(tmp_path / "ds")
    lines = [line.split(",") for line in src.read_text().splitlines()]
    header, body = lines[0], lines[1:]
    assert ds.info.users == ds.info.interactions == len(body) and ds.info.sequence_table is None
    assert sorted(t.name for t in ds.info.tables) == sorted(n for n in header if n not in ("id", "click"))
    assert ds.info.dense == () and ds.info.table("hour").rows == 24 and ds.info.table("site_id").rows == 1000
    np.testing.assert_array_equal(ds.column("labels"), [float(line[1]) for line in body])
    for name, value in (("hour", lambda line: line[2][6:]), ("site_id", lambda line: line[5]),
                        ("C21", lambda line: line[-1])):
        raw, rows = ds.raw_ids(name)
        row_of = dict(zip(raw.tolist(), rows.tolist(), strict=True))
        assert ds.ids(name).tolist() == [row_of[value(line)] for line in body]


def test_import_is_deterministic(tmp_path):
    a = import_dataset("sasrec", REAL["sasrec"], tmp_path / "a")
    b = import_dataset("sasrec", REAL["sasrec"], tmp_path / "b")
    assert a.manifest["checksum"] == b.manifest["checksum"]
    assert a.manifest["source"]["parts"] == b.manifest["source"]["parts"]
    assert a.manifest["source"]["parts"][0]["sha256"] == file_sha256(REAL["sasrec"])


def write(tmp_path: Path, name: str, text: str | bytes) -> Path:
    p = tmp_path / name
    p.write_bytes(text if isinstance(text, bytes) else text.encode())
    return p


BAD_SOURCES = [
    ("sasrec", "1 5\n1 6\n2 x7\n", r"bad\.txt:3: item 'x7' is not accepted; accepted: an integer >= 0"),
    ("sasrec", "1 5\n1 6\n2\n", r"bad\.txt:3: '2' has 1 fields; accepted: 'user item'"),
    ("sasrec", "1 5\n1 6 9\n", r"bad\.txt:2: '1 6 9' has 3 fields; accepted: 'user item' \(the line reads as the "
                              r"s3rec format\)$"),
    ("sasrec", "label,I1,C1\n1,2,a\n", r"bad\.txt:1: .* has 1 fields; accepted: 'user item' \(the line reads as the "
                                      r"criteo format\)$"),
    ("s3rec", "user_id:token\titem_id:token\n1\t2\n", r"bad\.txt:1: .*\(the line reads as the recbole format\)$"),
    ("recbole", "user_id:token\titem_id:token\n1\t2\t3\n", r"bad\.txt:2: 3 tab-separated fields; accepted: 2 as in the "
                                                            r"header$"),
    ("sasrec", "1 5\n-3 6\n", r"bad\.txt:2: user '-3' is not accepted"),
    ("sasrec", "\n\n", r"empty file; accepted: at least one interaction"),
    ("sasrec", b"1 5\n\xff\xfe 6\n", r"bad\.txt:2: not UTF-8 text \(byte 0 of the line\)"),
    ("sasrec", "1 5\n2 +5\n", r"bad\.txt:2: item '\+5' is not accepted; accepted: an integer >= 0 \(ASCII digits"),
    ("sasrec", "1 5\n2 \u0663\n", r"bad\.txt:2: item '\u0663' is not accepted"),
    ("sasrec", "1 5\n2 \uff17\n", r"bad\.txt:2: item '\uff17' is not accepted"),
    ("sasrec", "1 5\n2 1_000\n", r"bad\.txt:2: item '1_000' is not accepted"),
    ("sasrec", "1 5\n2 " + "9" * 5000 + "\n", r"bad\.txt:2: item '9{60}…' \(5,000 characters\) is not accepted"),
    ("sasrec", "1 5\n1 6 \n", r"bad\.txt:2: '1 6 ' has 3 fields; accepted: 'user item'"),
    # One spelling per id: '007' would read as the row of '7', and '01' as user 1.
    ("sasrec", "1 7\n1 007\n", r"bad\.txt:2: item '007' is not accepted; accepted: .*no leading zero"),
    ("sasrec", "1 7\n01 8\n", r"bad\.txt:2: user '01' is not accepted"),
    ("sasrec", "1 7\n1 " + "1" * 19 + "\n", r"bad\.txt:2: item '1{19}' is not accepted; accepted: .*at most 18"),
    ("s3rec", "1 2 3\n2 4 05\n", r"bad\.txt:2: item '05' is not accepted"),
    ("sasrec", "1 5\n   \n1 6\n\t\n", None),
    (
        "s3rec",
        "1 2 3\n2 4  5\n",
        r"bad\.txt:2: '2 4  5': an empty field; accepted: 'user item1 item2 \.\.\.' separated",
    ),
    ("s3rec", "1 2 3\n2 4 x5\n", r"bad\.txt:2: item 'x5' is not accepted"),
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
    ("criteo", "id,click,hour,site_id\n1,0,14102100,a\n2,2,14102100,b\n", r"bad\.txt:3: click '2'; accepted: 0 or 1"),
    ("criteo", "id,click,hour,site_id\n1,0,1410210,a\n", r"bad\.txt:2: hour '1410210'; accepted: YYMMDDHH"),
    ("criteo", "id,click,site_id\n1,0,a\n", r"Avazu columns \['id', 'click', 'site_id'\]; accepted: id, click, hour"),
]


@pytest.mark.parametrize("fmt, text, message", BAD_SOURCES)
def test_bad_source_is_refused_with_its_line_and_writes_nothing(tmp_path, fmt, text, message):
    src = write(tmp_path, "bad.txt", text)
    dest = tmp_path / "out" / "ds"
    if message is None:  # whitespace-only lines are skipped, as blank ones are
        assert import_dataset(fmt, src, dest).manifest["interactions"] == 2
        return
    with pytest.raises(InputError, match=message) as refused:
        import_dataset(fmt, src, dest)
    assert len(str(refused.value)) < 400
    assert not dest.exists()
    assert not (tmp_path / "out").exists() or siblings(dest) == []


def test_bad_options_are_refused_before_reading(tmp_path):
    src = write(tmp_path, "ok.txt", "1 2\n")
    with pytest.raises(InputError, match="format 'csv' is not known; accepted: sasrec, s3rec, recbole, criteo"):
        import_dataset("csv", src, tmp_path / "ds")
    with pytest.raises(InputError, match="no such file or directory; accepted: a file, a .gz file or a directory"):
        import_dataset("sasrec", tmp_path / "missing.txt", tmp_path / "ds")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / ".hidden").write_text("1 2\n")
    with pytest.raises(InputError, match="a directory with no parts; accepted: a directory holding one file per part"):
        import_dataset("sasrec", tmp_path / "empty", tmp_path / "ds")
    with pytest.raises(InputError, match=r"--table-rows C1=5 for format .sasrec.; accepted: table sizes only for"):
        import_dataset("sasrec", src, tmp_path / "ds", table_rows={"C1": 5})
    with pytest.raises(InputError, match=r"--table-rows C99: no such categorical column"):
        import_dataset("criteo", REAL["criteo"], tmp_path / "ds", table_rows={"C99": 5})
    with pytest.raises(InputError, match=r"C1: 0 rows; accepted: an integer from 1 to 2,147,483,647"):
        import_dataset("criteo", REAL["criteo"], tmp_path / "ds", table_rows={"C1": 0})
    assert not (tmp_path / "ds").exists()


def test_line_numbers_stay_right_across_blocks_and_parts(tmp_path):
    lines = REAL["sasrec"].read_text().splitlines(keepends=True)
    src = tmp_path / "src"
    src.mkdir()
    (src / "1.txt").write_text("".join(lines[:50_000]))
    bad = lines[50_000:120_000]
    bad[40_000] = bad[40_000].split()[0] + " +5\n"
    (src / "2.txt").write_text("".join(bad))
    with pytest.raises(InputError, match=r"2\.txt:40001: item '\+5' is not accepted"):
        import_dataset("sasrec", src, tmp_path / "ds", block_bytes=1 << 12)
    bad[40_000] = lines[50_000 + 40_000]
    (src / "2.txt").write_bytes("".join(bad[:60_000]).encode() + b"9 \xff\n" + "".join(bad[60_000:]).encode())
    with pytest.raises(InputError, match=r"2\.txt:60001: not UTF-8 text \(byte 2 of the line\)"):
        import_dataset("sasrec", src, tmp_path / "ds", block_bytes=1 << 16)
    assert not (tmp_path / "ds").exists() and siblings(tmp_path / "ds") == ["src"]


def test_ids_past_2_to_the_31_after_small_ones_keep_their_values(tmp_path):
    # Tiny blocks: the first spills as int32, a later one widens it; ids past 2^26 leave the bitmap.
    src = write(tmp_path, "big.txt", "1 5\n1 7\n2 3000000000\n2 5\n3 9000000000000000\n3 7\n")
    import_dataset("sasrec", src, tmp_path / "ds", block_bytes=8)
    ds = Dataset.open(tmp_path / "ds")
    raw, rows = ds.raw_ids("item")
    raw_of_row = dict(zip(rows.tolist(), raw.tolist(), strict=True))
    assert [raw_of_row[i] for i in ds.ids("item").tolist()] == [5, 7, 3000000000, 5, 9000000000000000, 7]
    assert sorted(raw.tolist()) == raw.tolist()  # one part: rows in sorted order of the raw id


def test_a_huge_line_is_quoted_in_a_short_excerpt(tmp_path):
    src = write(tmp_path, "bad.txt", "1 5\n" + " ".join(["7"] * 3_000_000) + "\n")
    with pytest.raises(InputError, match=r"bad\.txt:2: '7 7 7 .*…' \(5,999,999 characters\) has 3000000 fields") as e:
        import_dataset("sasrec", src, tmp_path / "ds")
    assert len(str(e.value)) < 300


@pytest.mark.parametrize("damage, message", [
    (lambda b: b[: len(b) // 2], "the gzip stream ends early \\(a truncated file\\); accepted: a complete gzip file"),
    (lambda b: b[:10] + b"garbage" * 100, "not a valid gzip file"),
])
def test_a_damaged_gzip_is_refused(tmp_path, damage, message):
    src = write(tmp_path, "Video.txt.gz", damage(gzip.compress(REAL["sasrec"].read_bytes())))
    with pytest.raises(InputError, match=message):
        import_dataset("sasrec", src, tmp_path / "ds", block_bytes=1 << 16)
    assert not (tmp_path / "ds").exists()


def test_a_bad_part_is_named_when_parts_are_scanned_on_dask(client, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("1 2\n1 3\n")
    (src / "b.txt").write_text("2 2\n2 x\n")
    with pytest.raises(InputError, match=r"b\.txt:2: item 'x' is not accepted"):
        import_dataset("sasrec", src, tmp_path / "ds", client=client)
    assert not (tmp_path / "ds").exists() and siblings(tmp_path / "ds") == ["src"]


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


def test_ids_of_zero_and_with_zeros_inside_are_one_spelling_each_and_import(tmp_path):
    """Not vacuous: the leading-zero refusal takes no id that is spelled once ('0', '10', '100' and '0' as a user)."""
    src = write(tmp_path, "ok.txt", "0 0\n0 10\n100 100\n100 1000000000000000\n")
    assert import_dataset("sasrec", src, tmp_path / "ds").manifest["interactions"] == 4
    s3 = write(tmp_path, "ok3.txt", "0 10 0 200\n30 0\n")
    assert import_dataset("s3rec", s3, tmp_path / "ds3").manifest["interactions"] == 4
