"""Distributed profiling on a real LocalCluster: exact counts, and bad ids refused before writing."""

import csv
import shutil
from collections import Counter

import pytest
import zarr

from shardflow.data.synthetic import SynthTable, synth_dataset
from shardflow.errors import InputError
from shardflow.profiling.profiles import profile_dataset
from storage.dataset import Dataset
from storage.importers import import_dataset
from storage.profile import Profile, Window
from support import REAL, siblings, snapshot


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
    row_of = dict(zip((str(v) for v in values.tolist()), rows.tolist(), strict=True))
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
        assert manifest.tables[table].accesses == sum(raw.values())
        assert manifest.tables[table].distinct == len(set(as_row_counts(ds, table, raw)))
    assert manifest.dataset.checksum == ds.info.checksum


def test_skew_of_amazon_video_matches_the_published_figures(client, tmp_path):
    import_dataset("sasrec", REAL["sasrec"], tmp_path / "ds")
    stats = profile_dataset(tmp_path / "ds", tmp_path / "p", client=client).tables["item"]
    # The figures published with the data (top 1% 0.17, top 10% 0.55, slope 1.12), to their rounding.
    assert stats.top1pct_share == pytest.approx(0.17, abs=0.005)
    assert stats.top10pct_share == pytest.approx(0.55, abs=0.01)
    assert stats.zipf_slope == pytest.approx(1.12, abs=0.005)


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
    with pytest.raises(
        InputError, match=rf"tables/item\[250001\] = {value} is outside the table; accepted: 0 <= id < 20000"
    ):
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


@pytest.fixture(scope="module")
def three_days(tmp_path_factory):
    """The head of the bundled amazon-video log as three daily parts, imported as one three-part store."""
    from support import split_into_days

    root = tmp_path_factory.mktemp("window")
    (root / "head.txt").write_text("".join(REAL["sasrec"].read_text().splitlines(keepends=True)[:30000]))
    parts = root / "parts"
    parts.mkdir()
    for day in split_into_days(root / "head.txt", root / "days", (0.6, 0.2, 0.2), late_users=0.1, seed=0):
        shutil.copy(day, parts)
    import_dataset("sasrec", parts, root / "ds")
    return root


def window_oracle(ds: Dataset, first: int, history: int, features=(), validation: bool = False) -> tuple[dict, int]:
    """Per table, every row's lookups by the window's examples, built one by one as training builds them."""
    import numpy as np

    from shardflow.data.batches import TrainData
    from shardflow.data.clicks import model_config

    data = TrainData(ds, features, (first, 0), validation=validation)
    config = model_config(ds, dim=1, mlp=(1,), bottom=(1,), history=history, negatives=1, seed=0)
    targets = np.concatenate([data.block_targets(b) for b in range(data.blocks)])
    ex = data.examples(targets, config, 0)
    item = ds.info.sequence_table
    counts = {item: np.bincount(np.concatenate([ex.history[ex.history >= 0], ex.positive]),
                                minlength=ds.info.table(item).rows)}
    for f in features:
        counts[f] = np.bincount(ex.features[f], minlength=ds.info.table(f).rows)
    return counts, targets.size


@pytest.mark.parametrize("first, history, validation", [(0, 5, False), (1, 20, False), (2, 5, False),
                                                        (2, 1, False), (0, 5, True), (1, 20, True)])
def test_a_window_profile_counts_what_the_windows_examples_read(client, three_days, first, history, validation):
    """With a validation split (patience, the default) training leaves each user's last two events out, and
    moves the window's edge with them: the profile counts those examples, not the ones without a split."""
    from shardflow.profiling.profiles import profile_window

    out = three_days / f"p-{first}-{history}-{validation}"
    held = 2 if validation else 1
    m = profile_window(three_days / "ds", out, client=client, first=first, history=history, held=held)
    ds = Dataset.open(three_days / "ds")
    expected, examples = window_oracle(ds, first, history, validation=validation)
    got = Profile.open(out).counts("item")
    assert (got == expected["item"]).all()
    assert m.dataset.window == Window(first, history, examples, int(expected["item"].sum()), held)
    assert 0 < examples < ds.info.interactions and got.sum() > examples  # histories were counted: not vacuous


def test_a_window_profile_counts_feature_tables_once_per_example(client, tmp_path):
    from shardflow.profiling.profiles import profile_window

    synth_dataset(tmp_path / "ds", [SynthTable("item", 300, 1.1), SynthTable("genre", 12, 0.7)], interactions=6000,
                  seed=4, mean_length=10)
    profile_window(tmp_path / "ds", tmp_path / "p", client=client, first=0, history=4)
    expected, examples = window_oracle(Dataset.open(tmp_path / "ds"), 0, 4, features=("genre",))
    profile = Profile.open(tmp_path / "p")
    assert (profile.counts("genre") == expected["genre"]).all() and profile.counts("genre").sum() == examples
    assert (profile.counts("item") == expected["item"]).all()


def test_a_table_of_token_sequences_counts_every_token_an_example_holds_and_plans_that_many(client, tmp_path):
    from shardflow.profiling.profiles import profile_window
    from shardflow.sharding.stage import accesses_from_profile

    import_dataset("recbole", REAL["recbole"], tmp_path / "ds", label="rating>=4")
    profile_window(tmp_path / "ds", tmp_path / "p", client=client, first=0, history=1)
    ds, profile = Dataset.open(tmp_path / "ds"), Profile.open(tmp_path / "p")
    items = {line.split("\t")[0]: line.split("\t")[3].split()
             for line in REAL["recbole"].with_suffix(".item").read_text().splitlines()[1:]}
    genres = Counter(g for line in REAL["recbole"].read_text().splitlines()[1:] for g in items[line.split("\t")[1]])
    counts = profile.counts("class")
    assert {i: int(c) for i, c in enumerate(counts) if c} == as_row_counts(ds, "class", genres)
    per_example = {a.name: a.lookups_per_example for a in accesses_from_profile(profile, history=1, negatives=0)}
    assert per_example["class"] == pytest.approx(sum(genres.values()) / 100_000) and per_example["class"] > 2
    assert per_example["item"] == 1.0
