"""Shared fixtures: the bundled real data, one LocalCluster for the session, store snapshots."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from distributed import Client, LocalCluster

DATA = Path(__file__).resolve().parents[1] / "data"
REAL = {
    "sasrec": DATA / "amazon-video" / "Video.txt",
    "s3rec": DATA / "amazon-beauty" / "Beauty.txt",
    "recbole": DATA / "movielens-100k" / "ml-100k.inter",
    "criteo": DATA / "criteo-sample" / "criteo_sample.txt",
}


@pytest.fixture(scope="session")
def client():
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0") as cluster:
        with Client(cluster) as c:
            yield c


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
