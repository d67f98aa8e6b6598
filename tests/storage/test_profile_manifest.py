"""The profile store's manifest read back as typed records: every table's figures a TableStats."""

from __future__ import annotations

import json

import numpy as np
import pytest

from shardflow.errors import InputError
from shardflow.profiling.counting import table_stats
from storage.manifest import MANIFEST
from storage.profile import Profile, ProfiledDataset, TableStats, finish_profile, start_profile, write_counts


def written(path, counts: np.ndarray) -> None:
    start_profile(path)
    digest = write_counts(path, "item", counts)
    finish_profile(path, ProfiledDataset("/data/ds", "sha256:0"), {"item": table_stats(counts)},
                   {"item": digest})


def test_a_profile_reads_back_its_tables_figures_as_written(tmp_path):
    counts = np.array([0, 4, 0, 1, 1], dtype=np.int64)
    written(tmp_path / "p", counts)
    back = Profile.open(tmp_path / "p")
    assert back.stats == {"item": table_stats(counts)} and isinstance(back.stats["item"], TableStats)
    assert back.rows == {"item": 5} and back.stats["item"].accesses == 6 and back.stats["item"].distinct == 3
    assert back.counts("item").tolist() == counts.tolist()


@pytest.mark.parametrize("key, value, says", [
    ("accesses", "many", r"tables\.item: accesses = 'many'; accepted: int"),
    ("zipf_slope", None, r"tables\.item: zipf_slope = None; accepted: int or float"),
])
def test_a_tables_bad_figure_is_named_with_what_is_accepted(tmp_path, key, value, says):
    written(tmp_path / "p", np.array([3, 1, 0], dtype=np.int64))
    m = json.loads((tmp_path / "p" / MANIFEST).read_text())
    m["tables"]["item"][key] = value
    (tmp_path / "p" / MANIFEST).write_text(json.dumps(m))
    with pytest.raises(InputError, match=says):
        Profile.open(tmp_path / "p")
