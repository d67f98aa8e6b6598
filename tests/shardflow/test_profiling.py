"""Distributed profiling on a real LocalCluster: exact counts, and bad ids refused before writing."""

import csv
import shutil
from collections import Counter

import pytest
import zarr

from support import REAL, siblings, snapshot
from shardflow.errors import InputError
from shardflow.profiling import profile_dataset
from shardflow.synthetic import SynthTable, synth_dataset
from storage.dataset import Dataset
from storage.importers import import_dataset
from storage.profile import Profile


def raw_counters(fmt: str) -> dict[str, Counter]:
    """Per table, how often each raw value occurs in the source file: the naive reference."""
    text = REAL[fmt].read_text().splitlines()
    if fmt == "sasrec":
        return {"item": Counter(line.split()[1] for line in text)}
    if fmt == "s3rec":
        return {"item": Counter(i for line in text for i in line.split()[1:])}
    if fmt == "recbole":
        return {"item": Counter(line.split("\t")[1] for line in text[1:])}
    rows = list(csv.DictReader(text))
    return {c: Counter(r[c] for r in rows) for c in rows[0] if c.startswith("C")}


def as_row_counts(ds: Dataset, table: str, raw: Counter) -> dict[int, int]:
    values, rows = ds.raw_ids(table)
    row_of = dict(zip((str(v) for v in values.tolist()), rows.tolist()))
    out = Counter()
    for value, n in raw.items():
        out[row_of[value]] += n
    return dict(out)


@pytest.mark.parametrize("fmt", ["sasrec", "s3rec", "recbole", "criteo"])
def test_counts_equal_a_counter_over_the_real_file(client, tmp_path, fmt):
    import_dataset(fmt, REAL[fmt], tmp_path / "ds", **({"hash_rows": 4096} if fmt == "criteo" else {}))
    manifest = profile_dataset(tmp_path / "ds", tmp_path / "profile", client=client)
    ds, profile = Dataset.open(tmp_path / "ds"), Profile.open(tmp_path / "profile")
    for table, raw in raw_counters(fmt).items():
        counts = profile.counts(table)
        assert {i: int(c) for i, c in enumerate(counts) if c} == as_row_counts(ds, table, raw)
        assert manifest["tables"][table]["accesses"] == sum(raw.values())
        assert manifest["tables"][table]["distinct"] == len(set(as_row_counts(ds, table, raw)))
    assert manifest["dataset"]["checksum"] == ds.info.checksum


def test_skew_of_amazon_video_matches_the_published_figures(client, tmp_path):
    import_dataset("sasrec", REAL["sasrec"], tmp_path / "ds")
    stats = profile_dataset(tmp_path / "ds", tmp_path / "p", client=client)["tables"]["item"]
    # The figures published with the data (top 1% 0.17, top 10% 0.55, slope 1.12), to their rounding.
    assert stats["top1pct_share"] == pytest.approx(0.17, abs=0.005)
    assert stats["top10pct_share"] == pytest.approx(0.55, abs=0.01)
    assert stats["zipf_slope"] == pytest.approx(1.12, abs=0.005)


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    path = tmp_path_factory.mktemp("synth") / "ds"
    tables = [SynthTable("item", 20_000, 1.2), SynthTable("genre", 50, 0.7)]
    synth_dataset(path, tables, interactions=300_000, seed=3, events_per_chunk=8192)
    return path


@pytest.mark.parametrize("blocks", [1, 2, 5, 100])
def test_counts_equal_a_counter_on_synthetic_data_for_any_split(client, synthetic, tmp_path, blocks):
    profile_dataset(synthetic, tmp_path / "p", client=client, blocks=blocks)
    ds, profile = Dataset.open(synthetic), Profile.open(tmp_path / "p")
    for table in ("item", "genre"):
        expected = Counter(ds.ids(table).tolist())
        counts = profile.counts(table)
        assert {i: int(c) for i, c in enumerate(counts) if c} == dict(expected)


def corrupt(path, table, position, value):
    arr = zarr.open_array(str(path / "segments" / "0000" / "tables" / table), mode="a")
    arr[position] = value


@pytest.mark.parametrize("value", [-1, 20_000, 123_456])
def test_an_out_of_range_id_is_named_and_nothing_is_written(client, synthetic, tmp_path, value):
    ds = tmp_path / "ds"
    shutil.copytree(synthetic, ds)
    corrupt(ds, "item", 250_001, value)
    profile_dataset(synthetic, tmp_path / "p", client=client)
    before = snapshot(tmp_path / "p")
    with pytest.raises(InputError, match=rf"tables/item\[250001\] = {value} is outside the table; accepted: 0 <= id < 20000"):
        profile_dataset(ds, tmp_path / "p", client=client, overwrite=True)
    assert snapshot(tmp_path / "p") == before
    assert siblings(tmp_path / "p") == ["ds"]


def test_an_existing_profile_is_kept_without_overwrite(client, synthetic, tmp_path):
    profile_dataset(synthetic, tmp_path / "p", client=client)
    before = snapshot(tmp_path / "p")
    with pytest.raises(InputError, match="already holds a store; pass --overwrite"):
        profile_dataset(synthetic, tmp_path / "p", client=client)
    assert snapshot(tmp_path / "p") == before


def test_profile_store_validation(client, synthetic, tmp_path):
    profile_dataset(synthetic, tmp_path / "p", client=client)
    (tmp_path / "p" / "manifest.json").unlink()
    with pytest.raises(InputError, match="not a complete profile store"):
        Profile.open(tmp_path / "p")
    with pytest.raises(InputError, match="not a complete dataset store"):
        profile_dataset(tmp_path / "p", tmp_path / "p2", client=client)
    assert not (tmp_path / "p2").exists()
