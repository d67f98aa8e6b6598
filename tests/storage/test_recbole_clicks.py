"""RecBole's atomic files as a click log: the label from a rating threshold, the examples in time order, and
the .user / .item feature files joined by id."""

from __future__ import annotations

import csv
import functools

import numpy as np
import pytest

from shardflow.errors import InputError
from storage import importers, segments
from storage.dataset import Dataset
from storage.importers import import_dataset
from support import REAL, snapshot

ML = REAL["recbole"]


def raw_column(ds: Dataset, table: str) -> np.ndarray | list[list[str]]:
    """Every example's raw value of `table` read back through the store's raw ids; a table of token sequences:
    every example's tokens."""
    raw, rows = ds.raw_ids(table)
    of_row = np.empty(ds.info.table(table).rows, dtype=object)
    of_row[rows] = raw
    ids = ds.column(f"tables/{table}")
    if ids.ndim == 1:
        return of_row[ids]
    held = ids >= 0
    assert (np.sort(~held, axis=1) == ~held).all() and (ids[~held] == -1).all(), "the padding, -1, comes last"
    return [of_row[r[h]].tolist() for r, h in zip(ids, held, strict=True)]


def read_tsv(path) -> list[dict]:
    with open(path, newline="") as f:
        rows = list(csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE))
    names = [h.partition(":")[0] for h in rows[0]]
    return [dict(zip(names, r, strict=True)) for r in rows[1:]]


def test_movielens_becomes_a_time_ordered_click_log_with_user_and_item_features(tmp_path):
    m = import_dataset("recbole", ML, tmp_path / "ds", label="rating>=4")
    ds = Dataset.open(tmp_path / "ds")
    assert ds.info.sequence_table is None and ds.info.labels and ds.info.dense == ()
    assert ds.info.table_names == ["user", "item", "age", "gender", "occupation", "zip_code", "release_year",
                                   "movie_title", "class"]
    assert ds.info.users == ds.info.interactions == 100_000
    assert m.manifest["source"]["options"] == {"label": "rating>=4"}
    assert [(f["name"], f["skipped"]) for f in m.manifest["source"]["features"]] == [
        ("ml-100k.user", []), ("ml-100k.item", [])]

    inter = read_tsv(ML)
    users = {r["user_id"]: r for r in read_tsv(ML.with_suffix(".user"))}
    items = {r["item_id"]: r for r in read_tsv(ML.with_suffix(".item"))}
    order = sorted(range(len(inter)), key=lambda i: (float(inter[i]["timestamp"]), i))  # time, then line
    expected = [inter[i] for i in order]
    got_users, got_items = raw_column(ds, "user"), raw_column(ds, "item")
    assert got_users.tolist() == [r["user_id"] for r in expected]
    assert got_items.tolist() == [r["item_id"] for r in expected]
    np.testing.assert_array_equal(ds.column("labels"), [float(float(r["rating"]) >= 4) for r in expected])
    for field in ("age", "gender", "occupation", "zip_code"):
        assert raw_column(ds, field).tolist() == [users[u][field] for u in got_users.tolist()], field
    assert raw_column(ds, "release_year").tolist() == [items[i]["release_year"] for i in got_items.tolist()]
    for field in ("class", "movie_title"):  # token sequences: every token of the item's line, in order
        tokens = {i: r[field].split() for i, r in items.items()}
        assert ds.info.widths[field] == max(len(t) for t in tokens.values()), field
        assert raw_column(ds, field) == [tokens[i] for i in got_items.tolist()], field
    assert ds.info.widths == {"movie_title": 15, "class": 6}


def write(root, name: str, text: str):
    path = root / name
    path.write_text(text)
    return path


INTER = "user_id:token\titem_id:token\trating:float\ttimestamp:float\tplatform:token\n"


def test_an_id_a_feature_file_lacks_joins_as_a_token_of_its_own_a_missing_number_and_no_tokens(tmp_path):
    src = write(tmp_path, "log.inter", INTER + "u1\ti1\t5\t30\tweb\nu2\ti2\t1\t10\tapp\nu1\ti3\t4\t20\tweb\n"
                                               "u2\ti9\t4\t40\tweb\n")
    write(tmp_path, "log.user", "user_id:token\theight:float\tcountry:token\nu1\t1.8\tDE\n")
    write(tmp_path, "log.item", "item_id:token\tgenres:token_seq\tbrand:token\ni1\t a  b \tX\ni2\tc\t\ni3\t\tY\n")
    import_dataset("recbole", src, tmp_path / "ds", label="rating>=4")
    ds = Dataset.open(tmp_path / "ds")
    assert ds.info.table_names == ["user", "item", "platform", "country", "brand", "genres"]
    assert ds.info.dense == ("height",) and ds.info.widths == {"genres": 2}
    assert raw_column(ds, "user").tolist() == ["u2", "u1", "u1", "u2"]  # by timestamp 10, 20, 30, 40
    assert raw_column(ds, "country").tolist() == ["", "DE", "DE", ""]  # u2 has no line in log.user
    assert raw_column(ds, "brand").tolist() == ["", "Y", "X", ""]  # i2's brand is empty, i9 has no line
    assert raw_column(ds, "genres") == [["c"], [], ["a", "b"], []]  # i3's are empty, i9 has no line
    assert ds.info.table("genres").rows == 3  # a, b, c: no row for the empty field or the missing line
    np.testing.assert_array_equal(ds.column("dense/height"), np.array([np.nan, 1.8, 1.8, np.nan], dtype=np.float32))
    np.testing.assert_array_equal(ds.column("labels"), [0.0, 1.0, 1.0, 1.0])


def test_token_sequences_of_a_log_without_time_stamps_stay_in_line_order_across_chunks(tmp_path, monkeypatch):
    lines = "".join(f"u{k}\ti{k % 3}\t{k % 5}\n" for k in range(7))
    src = write(tmp_path, "log.inter", "user_id:token\titem_id:token\trating:float\n" + lines)
    write(tmp_path, "log.item", "item_id:token\tgenres:token_seq\ni0\ta b c\ni1\t\ni2\tb\n")
    # Segments written 2 events a chunk: the spill is read back a block of [2, width] at a time.
    monkeypatch.setattr(importers, "write_segment", functools.partial(segments.write_segment, events_per_chunk=2))
    import_dataset("recbole", src, tmp_path / "ds", label="rating>=2")
    ds = Dataset.open(tmp_path / "ds")
    assert ds.info.widths == {"genres": 3}
    assert raw_column(ds, "genres") == [[["a", "b", "c"], [], ["b"]][k % 3] for k in range(7)]


def test_a_directory_of_parts_keeps_its_feature_files_out_of_the_parts_and_appends_by_time(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    write(logs, "ml.user", "user_id:token\tage:token\nu1\t20\nu2\t30\n")
    write(logs, "ml.item", "item_id:token\tyear:token\ni1\t1990\n")
    write(logs, "day1.inter", INTER + "u1\ti1\t5\t2\tweb\nu2\ti1\t2\t1\tweb\n")
    first = import_dataset("recbole", logs, tmp_path / "ds", label="rating>=3")
    assert [p["name"] for p in first.manifest["source"]["parts"]] == ["day1.inter"]
    write(logs, "day2.inter", INTER + "u2\ti2\t3\t4\tapp\nu3\ti1\t1\t3\tweb\n")
    with pytest.raises(InputError, match=r"imported with \{'label': 'rating>=3'\}; accepted: the same options "
                                         r"\(--label 'rating>=3'\)"):
        import_dataset("recbole", logs, tmp_path / "ds", append=True, label="rating>=4")
    import_dataset("recbole", logs, tmp_path / "ds", append=True, label="rating>=3")
    ds = Dataset.open(tmp_path / "ds")
    assert ds.info.users == ds.info.interactions == 4
    assert raw_column(ds, "user").tolist() == ["u2", "u1", "u3", "u2"]  # each part in its own time order
    assert raw_column(ds, "age").tolist() == ["30", "20", "", "30"]
    assert raw_column(ds, "year").tolist() == ["1990", "1990", "1990", ""]
    np.testing.assert_array_equal(ds.column("labels"), [0.0, 1.0, 0.0, 1.0])


def test_an_append_reads_token_sequences_as_wide_as_the_first_import_and_refuses_longer_ones(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    write(logs, "ml.item", "item_id:token\tgenres:token_seq\ni1\ta b\ni2\tc\n")
    write(logs, "day1.inter", INTER + "u1\ti1\t5\t1\tweb\n")
    import_dataset("recbole", logs, tmp_path / "ds", label="rating>=3")
    write(logs, "ml.item", "item_id:token\tgenres:token_seq\ni1\ta b\ni2\tc\ni3\td\n")
    write(logs, "day2.inter", INTER + "u2\ti3\t3\t2\tapp\nu3\ti2\t1\t3\tweb\n")
    import_dataset("recbole", logs, tmp_path / "ds", append=True, label="rating>=3")
    ds = Dataset.open(tmp_path / "ds")
    assert ds.info.widths == {"genres": 2}
    assert raw_column(ds, "genres") == [["a", "b"], ["d"], ["c"]]
    write(logs, "ml.item", "item_id:token\tgenres:token_seq\ni1\ta b\ni2\tc\ni3\td\ni4\ta b c\n")
    write(logs, "day3.inter", INTER + "u4\ti4\t5\t4\tweb\n")
    before = snapshot(tmp_path / "ds")
    with pytest.raises(InputError, match=r"ml\.item: a genres of 3 tokens; accepted: at most 2, the most the store's "
                                         r"first import read \(import into a new store to read more\)"):
        import_dataset("recbole", logs, tmp_path / "ds", append=True, label="rating>=3")
    assert snapshot(tmp_path / "ds") == before
    write(logs, "ml.item", "item_id:token\tgenres:token\ni4\ta\n")
    with pytest.raises(InputError, match=r"token sequence fields \[\]; the store holds \['genres'\]"):
        import_dataset("recbole", logs, tmp_path / "ds", append=True, label="rating>=3")
    assert snapshot(tmp_path / "ds") == before


BAD = [
    ({"label": "rating>4"}, {}, r"click label 'rating>4'; accepted: FIELD>=NUMBER"),
    ({"label": "stars>=4"}, {}, r"click label stars>=4: no 'stars:float' field in the header .*accepted: a float "
                                r"field, one of rating"),
    ({"label": "platform>=1"}, {}, r"no 'platform:float' field"),
    ({"label": "timestamp>=20"}, {}, r"no 'timestamp:float' field in the header .* other than timestamp; accepted: "
                                     r"a float field, one of rating"),
    ({"label": "rating>=4"}, {"log.user": "user_id:token\tage:token\nu1\t1\nu1\t2\n"},
     r"log\.user: a user_id on more than one line; accepted: each user_id once"),
    ({"label": "rating>=4"}, {"log.user": "id:token\tage:token\nu1\t1\n"},
     r"log\.user:1: header \['id', 'age'\]; accepted: one 'user_id:token' field"),
    ({"label": "rating>=4"}, {"log.item": "item_id:token\tplatform:token\ni1\tx\n"},
     r"field 'platform' is in more than one of .*log\.inter and the feature files"),
    ({"label": "rating>=4"}, {"log.item": "item_id:token\tweight:float\ni1\theavy\n"},
     r"log\.item: .*accepted: 2 tab-separated fields per line as in the header, floats as numbers"),
    ({"label": "rating>=4"}, {"log.item": "item_id:token\tweight:float\ni1\tinf\n"},
     r"log\.item: weight holds a NaN or an infinity"),
]


@pytest.mark.parametrize("options, features, message", BAD)
def test_a_bad_label_or_feature_file_is_refused_in_one_line_and_writes_nothing(tmp_path, options, features, message):
    src = write(tmp_path, "log.inter", INTER + "u1\ti1\t5\t30\tweb\n")
    for name, text in features.items():
        write(tmp_path, name, text)
    before = snapshot(tmp_path)
    with pytest.raises(InputError, match=message) as refused:
        import_dataset("recbole", src, tmp_path / "ds", **options)
    assert "\n" not in str(refused.value)
    assert not (tmp_path / "ds").exists()
    assert {k: v for k, v in snapshot(tmp_path).items() if not k.endswith(".lock")} == before


def test_an_empty_rating_names_its_line_and_a_label_needs_recbole(tmp_path):
    src = write(tmp_path, "log.inter", INTER + "u1\ti1\t5\t30\tweb\nu1\ti2\t\t31\tweb\n")
    with pytest.raises(InputError, match=r"log\.inter:3: rating is empty; accepted: a number \(the click label is "
                                         r"rating>=4\)"):
        import_dataset("recbole", src, tmp_path / "ds", label="rating>=4")
    with pytest.raises(InputError, match=r"--label 'rating>=4' for format 'criteo'; accepted: a click label only for "
                                         r"recbole"):
        import_dataset("criteo", REAL["criteo"], tmp_path / "ds", label="rating>=4")
    assert not (tmp_path / "ds").exists()
