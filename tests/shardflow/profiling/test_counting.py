from collections import Counter

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from shardflow.errors import InputError
from shardflow.profiling.counting import count_ids, table_stats, top_share, zipf_slope


@given(st.lists(st.integers(0, 49), max_size=300), st.sampled_from([np.int32, np.int64, np.uint16]))
def test_count_ids_equals_counter(ids, dtype):
    counts = count_ids(np.array(ids, dtype=dtype), 50, where="t")
    assert counts.dtype == np.int64 and counts.shape == (50,)
    assert {i: int(c) for i, c in enumerate(counts) if c} == dict(Counter(ids))


@pytest.mark.parametrize("bad, position", [([3, 1, -1, 2], 12), ([0, 50, 7], 11)])
def test_count_ids_names_the_first_bad_id_and_its_position(bad, position):
    with pytest.raises(InputError) as e:
        count_ids(np.array(bad), 50, where="ds/tables/item", first_position=10)
    assert f"ds/tables/item[{position}]" in str(e.value)
    assert "accepted: 0 <= id < 50" in str(e.value)


def test_count_ids_refuses_float_ids():
    with pytest.raises(InputError, match="dtype float64; accepted: an integer dtype"):
        count_ids(np.array([1.0, 2.0]), 5, where="t")


def test_top_shares_on_hand_built_counts():
    counts = np.zeros(200, dtype=np.int64)
    counts[:4] = [50, 30, 10, 5]
    counts[10:26] = 1
    # 20 rows were read (111 accesses): their top 10% is 2 rows, their top 1% one row.
    assert top_share(counts, 0.10) == pytest.approx(80 / 111)
    assert top_share(counts, 0.01) == pytest.approx(50 / 111)
    # at least one row, even for a tiny table
    assert top_share(np.array([1, 3]), 0.01) == pytest.approx(0.75)


def test_top_shares_of_a_sparsely_read_hashed_table_are_over_the_rows_read():
    # 4,000 of 2^20 rows read, each equally often: the top 10% of them take 10% of the accesses,
    # not (as a share of the table's rows would say) every access.
    counts = np.zeros(1 << 20, dtype=np.int64)
    counts[np.random.default_rng(0).choice(1 << 20, 4000, replace=False)] = 3
    assert top_share(counts, 0.10) == pytest.approx(0.10)
    assert top_share(counts, 0.01) == pytest.approx(0.01)


def test_zipf_slope_recovers_the_exponent_of_an_exact_power_law():
    ranks = np.arange(1, 2001)
    counts = np.round(1e7 * ranks**-1.2).astype(np.int64)
    rng = np.random.default_rng(0)
    assert zipf_slope(rng.permutation(counts)) == pytest.approx(1.2, abs=0.01)
    assert zipf_slope(np.full(10, 7)) == pytest.approx(0.0, abs=1e-9)


def test_table_stats_fields():
    s = table_stats(np.array([0, 4, 0, 1, 1], dtype=np.int64))
    assert (s.rows, s.accesses, s.distinct) == (5, 6, 3)
    assert s.top1pct_share == pytest.approx(4 / 6)
