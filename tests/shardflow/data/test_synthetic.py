import tracemalloc
from itertools import pairwise

import numpy as np
import psutil
import pytest

from shardflow.data.synthetic import (
    SYNTH_ROW_BYTES,
    Repeats,
    SynthTable,
    ZipfRows,
    parse_synth_table,
    synth_dataset,
    user_lengths,
)
from shardflow.errors import InputError
from storage.dataset import Dataset


def test_parse_synth_table():
    assert parse_synth_table("item:1000:1.2") == SynthTable("item", 1000, 1.2)
    assert parse_synth_table("cat:1e7") == SynthTable("cat", 10_000_000, 1.0)
    for bad, message in [
        ("item", "accepted: NAME:ROWS or NAME:ROWS:ALPHA"),
        ("item:many", "ROWS must be an integer"),
        ("item:0", r"rows = 0; accepted: an integer >= 1"),
        ("item:10:-1", r"alpha = -1.0; accepted: a finite number >= 0"),
        ("it em:10", "table name 'it em' is not accepted"),
    ]:
        with pytest.raises(InputError, match=message):
            parse_synth_table(bad)


@pytest.mark.parametrize("rows", [1, 2, 10, 97, 1000, 65536])
def test_rank_to_row_is_a_permutation(rows):
    z = ZipfRows(SynthTable("t", rows, 1.0), (3, 0))
    assert np.array_equal(np.sort(z.row_of_rank(np.arange(rows))), np.arange(rows))


def test_samples_follow_the_zipf_law():
    table = SynthTable("t", 1000, 1.2)
    z = ZipfRows(table, (0, 0))
    ids = z.sample(np.random.default_rng(1), 400_000)
    counts = np.bincount(ids, minlength=1000)
    weights = np.arange(1, 1001) ** -1.2
    expected = weights / weights.sum()
    observed = counts[z.row_of_rank(np.arange(1000))] / ids.size
    np.testing.assert_allclose(observed[:20], expected[:20], rtol=0.05)
    assert abs(observed[:100].sum() - expected[:100].sum()) < 0.005


def test_user_lengths_sum_to_the_interactions():
    lengths = user_lengths(100_003, 20, seed=4)
    assert lengths.sum() == 100_003 and (lengths >= 1).all()
    assert 15 < lengths.mean() < 25


def test_synth_is_seeded_and_stores_every_table(tmp_path):
    tables = [SynthTable("item", 5000, 1.1), SynthTable("genre", 30, 0.5)]
    a = synth_dataset(tmp_path / "a", tables, interactions=50_000, seed=7, events_per_chunk=4096)
    b = synth_dataset(tmp_path / "b", tables, interactions=50_000, seed=7, events_per_chunk=4096)
    c = synth_dataset(tmp_path / "c", tables, interactions=50_000, seed=8, events_per_chunk=4096)
    assert a["checksum"] == b["checksum"] != c["checksum"]
    ds = Dataset.open(tmp_path / "a")
    assert ds.info.sequence_table == "item"
    assert ds.info.table_names == ["item", "genre"]
    assert ds.offsets()[-1] == 50_000
    genre = ds.ids("genre")
    assert genre.min() >= 0 and genre.max() < 30


def test_synth_writes_block_by_block(tmp_path):
    """Peak traced memory stays far below one whole id column (the column is 8 MiB as int64)."""
    interactions, block = 1 << 20, 1 << 14
    tracemalloc.start()
    synth_dataset(
        tmp_path / "ds", [SynthTable("item", 1000, 1.2)], interactions=interactions, seed=1, events_per_chunk=block
    )
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < interactions * 8 / 4, f"peak {peak} bytes"


def test_bad_synth_arguments(tmp_path):
    t = [SynthTable("item", 10, 1.0)]
    with pytest.raises(InputError, match=r"interactions = 0; accepted: an integer >= 1"):
        synth_dataset(tmp_path / "ds", t, interactions=0, seed=1)
    with pytest.raises(InputError, match=r"seed = -2"):
        synth_dataset(tmp_path / "ds", t, interactions=10, seed=-2)
    with pytest.raises(InputError, match="table names repeat"):
        synth_dataset(tmp_path / "ds", t + t, interactions=10, seed=1)
    with pytest.raises(InputError, match="mean length = 0.5"):
        synth_dataset(tmp_path / "ds", t, interactions=10, seed=1, mean_length=0.5)
    with pytest.raises(InputError, match="mean length = inf"):
        synth_dataset(tmp_path / "ds", t, interactions=10, seed=1, mean_length=float("inf"))
    assert not (tmp_path / "ds").exists()


def test_a_table_or_a_log_too_large_for_this_machine_is_refused_before_anything_is_written(tmp_path):
    """A table of 3·10^9 rows was killed for memory on a 25 GB machine; 10^20 rows or interactions ended in a
    numpy traceback, 1e999999999999 in a MemoryError. The bounds follow this machine's memory: one past each is
    refused, naming the limit."""
    half = psutil.virtual_memory().total // 2
    rows = half // SYNTH_ROW_BYTES
    with pytest.raises(InputError, match=rf"table 'big': rows = {rows + 1:,} need 16 bytes each .* over half this "
                                         rf"machine's memory .*; accepted: at most {rows:,} rows"):
        synth_dataset(tmp_path / "ds", [SynthTable("item", 10, 1.0), SynthTable("big", rows + 1, 1.0)],
                      interactions=10, seed=1)
    with pytest.raises(InputError, match=r"table 'item': rows = 100,000,000,000,000,000 need"):
        synth_dataset(tmp_path / "ds", [parse_synth_table("item:1e17")], interactions=10, seed=1)
    for huge in ("item:1e999999999999", "item:99999999999999999999"):
        with pytest.raises(InputError, match=rf"table '{huge}': rows = \d\S*; accepted: fewer than 2\^63"):
            parse_synth_table(huge)
    with pytest.raises(InputError, match=r"interactions = 10,000,000,000,000,000,000 at mean length 20: .*; accepted: "
                                         r"at most [\d,]+ interactions, or a longer mean length"):
        synth_dataset(tmp_path / "ds", [SynthTable("item", 10, 1.0)], interactions=10**19, seed=1)
    assert not (tmp_path / "ds").exists()


def repeat_share(ids: np.ndarray, offsets: np.ndarray, window: int) -> float:
    """Share of events (users' first excepted) whose id is one of the user's previous `window` ids."""
    hits = total = 0
    for a, b in pairwise(offsets.tolist()):
        for p in range(a + 1, b):
            total += 1
            hits += int(ids[p] in ids[max(a, p - window) : p])
    return hits / total


@pytest.mark.parametrize("chunk", [7, 1000, 1 << 22])
def test_session_repeats_hold_their_share_across_blocks(tmp_path, chunk):
    uniform = [SynthTable("item", 1_000_000, 0.0)]  # almost no repeat by chance: 5 in 10^6 per event
    synth_dataset(tmp_path / "plain", uniform, interactions=20_000, seed=4, mean_length=12)
    synth_dataset(tmp_path / "sessions", uniform, interactions=20_000, seed=4, mean_length=12, events_per_chunk=chunk,
                  repeats=Repeats(0.3, 5))
    plain, sessions = Dataset.open(tmp_path / "plain"), Dataset.open(tmp_path / "sessions")
    offsets = sessions.offsets()
    assert np.array_equal(offsets, plain.offsets())
    share = repeat_share(sessions.ids("item"), offsets, 5)
    assert 0.29 <= share <= 0.31, share  # 18,300 candidate events: one standard deviation is 0.0034
    assert repeat_share(plain.ids("item"), offsets, 5) < 0.001
    assert sessions.info.source["repeats"] == {"share": 0.3, "window": 5}
    again = tmp_path / "again"
    synth_dataset(again, uniform, interactions=20_000, seed=4, mean_length=12, events_per_chunk=chunk,
                  repeats=Repeats(0.3, 5))
    assert np.array_equal(Dataset.open(again).ids("item"), sessions.ids("item"))


def test_bad_repeats_are_refused():
    with pytest.raises(InputError, match=r"repeat share = 1.5; accepted: a number from 0 to 1"):
        Repeats(1.5)
    with pytest.raises(InputError, match=r"repeat window = 0; accepted: an integer >= 1"):
        Repeats(0.3, 0)
