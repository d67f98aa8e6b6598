"""The cost model's distinct rows fitted to real batches (shardflow.sharding.touch), on generated stores."""

import numpy as np
import pytest

from shardflow.data.synthetic import Repeats, SynthTable, synth_dataset
from shardflow.planner.access import TableAccess, sequence_lookups
from shardflow.planner.topology import uniform
from shardflow.sharding.touch import fit_touch
from storage.dataset import Dataset

HISTORY, NEGATIVES = 5, 2


def fitted(root, repeats: Repeats):
    synth_dataset(root, [SynthTable("item", 5_000, 1.1), SynthTable("shop", 300, 0.8)], interactions=200_000,
                  seed=3, mean_length=25, repeats=repeats)
    ds = Dataset.open(root)
    per_example, uniform_share = sequence_lookups(ds.offsets(), HISTORY, NEGATIVES)
    accesses = [TableAccess.from_counts("item", np.bincount(ds.ids("item"), minlength=5_000), per_example,
                                        uniform_share),
                TableAccess.from_counts("shop", np.bincount(ds.ids("shop"), minlength=300), 1.0)]
    return fit_touch(ds, accesses, uniform(2, 2, 12.5), 1024, HISTORY, NEGATIVES)


def test_independent_draws_fit_a_factor_near_one_and_session_repeats_one_below(tmp_path):
    plain, sessions = fitted(tmp_path / "plain", Repeats()), fitted(tmp_path / "sessions", Repeats(0.3, 5))
    assert set(plain) == set(sessions) == {"item", "shop"}
    for level in ("trainer", "batch"):
        assert getattr(plain["shop"], level) == pytest.approx(1.0, abs=0.02)  # one independent draw an example
        assert getattr(plain["item"], level) == pytest.approx(1.0, abs=0.02)  # histories of many users
        assert getattr(sessions["item"], level) < 0.95  # a user's repeats are one row, not several
    assert set(plain["item"].node) == {2} and plain["item"].node[2] == pytest.approx(1.0, abs=0.02)
