"""Helpers the tests share: the bundled real data, store snapshots, synthetic lookup profiles."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from shardflow.planner.access import TableAccess

DATA = Path(__file__).resolve().parents[1] / "data"
REAL = {
    "sasrec": DATA / "amazon-video" / "Video.txt",
    "s3rec": DATA / "amazon-beauty" / "Beauty.txt",
    "recbole": DATA / "movielens-100k" / "ml-100k.inter",
    "criteo": DATA / "criteo-sample" / "criteo_sample.txt",
}


def snapshot(root: Path) -> dict[str, str]:
    """sha256 of every file under `root`, by relative path: equal snapshots mean byte-identical trees."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(Path(root).rglob("*"))
        if p.is_file()
    }


def siblings(path: Path) -> list[str]:
    """Names beside `path` other than itself: leftover staging directories show up here."""
    return sorted(p.name for p in Path(path).parent.iterdir() if p.name != Path(path).name)


def zipf_access(name: str, rows: int, alpha: float, lookups: float = 8.0, seed: int = 0) -> TableAccess:
    """Expected Zipf counts (out of 10^7 accesses) on a seeded random permutation of the rows."""
    w = np.arange(1, rows + 1, dtype=np.float64) ** -alpha
    counts = np.round(w / w.sum() * 1e7).astype(np.int64)
    return TableAccess.from_counts(name, np.random.default_rng(seed).permutation(counts), lookups)
