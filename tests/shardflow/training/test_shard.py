"""A shard's row layout: global ids to local rows, and the ids it refuses."""

from __future__ import annotations

import numpy as np
import pytest

from shardflow.errors import InputError
from shardflow.training.shard import RowLayout


def test_global_ids_become_their_local_rows_in_any_stored_order():
    stored = np.array([40, 7, 19, 3], dtype=np.int64)  # local row k holds global id stored[k]
    layout = RowLayout("item", stored=stored)
    ids = np.array([3, 40, 19, 7, 3], dtype=np.int64)
    assert layout.local(ids).tolist() == [3, 0, 2, 1, 3]
    assert stored[layout.local(ids)].tolist() == ids.tolist()
    assert RowLayout("item", modulus=5).local(np.array([12, 4])).tolist() == [2, 4]


@pytest.mark.parametrize("missing", [5, 41, 0])  # between stored ids, past the last, before the first
def test_an_id_the_shard_does_not_store_is_refused_by_name(missing):
    layout = RowLayout("item", stored=np.array([40, 7, 19, 3], dtype=np.int64))
    with pytest.raises(InputError, match=f"table 'item': id {missing} is not stored on this shard"):
        layout.local(np.array([7, missing], dtype=np.int64))


def test_a_shard_storing_no_rows_refuses_every_id_and_takes_none():
    layout = RowLayout("item", stored=np.zeros(0, dtype=np.int64))
    assert layout.local(np.zeros(0, dtype=np.int64)).size == 0
    with pytest.raises(InputError, match="id 2 is not stored"):
        layout.local(np.array([2], dtype=np.int64))


@pytest.mark.parametrize("stored", [np.arange(10, 16), np.array([10, 11, 12, 14, 15, 16])])  # one run; a gap
def test_a_run_of_ids_and_ids_with_gaps_give_the_same_rows_and_refusals(stored):
    layout = RowLayout("item", stored=stored.astype(np.int64))
    ids = stored[[5, 0, 3, 3, 1]]
    assert stored[layout.local(ids)].tolist() == ids.tolist()
    for missing in (9, int(stored[-1]) + 1, 13 if 13 not in stored else -1):
        with pytest.raises(InputError, match=f"table 'item': id {missing} is not stored on this shard"):
            layout.local(np.array([int(stored[0]), missing], dtype=np.int64))
