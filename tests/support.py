"""Helpers the tests share: the bundled real data, store snapshots, synthetic lookup profiles."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from shardflow.model import ModelConfig
from shardflow.optim import OptimizerConfig
from shardflow.planner.access import TableAccess
from shardflow.planner.plan import ShardingPlan, TablePlan
from shardflow.planner.topology import Node, Topology

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
    """Names beside `path` other than itself and writers' lock files: leftover staging directories show up here."""
    return sorted(p.name for p in Path(path).parent.iterdir()
                  if p.name != Path(path).name and not (p.name.startswith(".") and p.name.endswith(".lock")))


def zipf_access(name: str, rows: int, alpha: float, lookups: float = 8.0, seed: int = 0) -> TableAccess:
    """Expected Zipf counts (out of 10^7 accesses) on a seeded random permutation of the rows."""
    w = np.arange(1, rows + 1, dtype=np.float64) ** -alpha
    counts = np.round(w / w.sum() * 1e7).astype(np.int64)
    return TableAccess.from_counts(name, np.random.default_rng(seed).permutation(counts), lookups)


# The training tests' small model, batch and topologies.
MODEL = ModelConfig(dim=8, mlp=(16, 8), history=5, negatives=3, features=("genre",), seed=2)
OPTIMIZER = OptimizerConfig(row_lr=0.1, dense_lr=0.01)
BATCH = 96
STEPS = 3
# 1 to 4 devices; several nodes wherever there are two or more devices, so node tiers mean something.
TOPOLOGIES = {
    1: Topology((Node("a", 1, 10.0),), 100.0),
    2: Topology((Node("a", 1, 10.0), Node("b", 1, 10.0)), 100.0),
    3: Topology((Node("a", 2, 10.0), Node("b", 1, 5.0)), 100.0),
    4: Topology((Node("a", 2, 10.0), Node("b", 2, 10.0)), 100.0),
}


def random_plan(data, devices: int, seed: int) -> ShardingPlan:
    rng = np.random.default_rng(seed)
    return ShardingPlan(
        "random",
        tuple(
            TablePlan(t, rng.integers(0, 3, rows).astype(np.int8), rng.integers(0, devices, rows).astype(np.int32))
            for t, rows in data.rows.items()
        ),
    )


def split_into_days(src: Path, dest: Path, days: int = 3, seed: int = 0) -> list[Path]:
    """Cut a sasrec log into daily parts: each user's events in time order, cut at random points.

    A user's first day is drawn at random too, so some users arrive only in later parts.
    Every part is a sasrec file of its own (users grouped, in the source's order).
    """
    rng = np.random.default_rng(seed)
    by_user: dict[str, list[str]] = {}
    for line in Path(src).read_text().splitlines():
        user, item = line.split()
        by_user.setdefault(user, []).append(item)
    lines: list[list[str]] = [[] for _ in range(days)]
    for user, items in by_user.items():
        first = int(rng.integers(0, days))
        cuts = np.sort(rng.integers(0, len(items) + 1, days - first - 1))
        for day, chunk in zip(range(first, days), np.split(np.array(items), cuts)):
            lines[day] += [f"{user} {item}" for item in chunk]
    dest.mkdir(parents=True, exist_ok=True)
    paths = []
    for day, text in enumerate(lines, start=1):
        paths.append(dest / f"day-{day}.txt")
        paths[-1].write_text("\n".join(text) + "\n")
    return paths


def sequences_by_raw_user(ds, table: str = "item") -> dict:
    """raw user id -> the raw ids of the user's events in `table`, read back from a dataset store."""
    off = ds.offsets()
    raw, rows = ds.raw_ids(table)
    raw_of_row = dict(zip(rows.tolist(), raw.tolist()))
    ids = ds.ids(table).tolist()
    users = ds.user_ids().tolist()
    return {users[u]: [raw_of_row[i] for i in ids[off[u] : off[u + 1]]] for u in range(ds.info.users)}


def daily_parts(src: Path, out: Path, shares: tuple[float, ...], late_users: float = 0.1, seed: int = 0) -> list[Path]:
    """Split a sasrec log (`user item` lines, each user's in time order) into daily parts day-01.txt, ...

    Each user's events are cut in time order: part d gets the events between the
    cumulative shares d-1 and d of the user's sequence. A seeded `late_users` fraction of
    users arrives only later: their whole sequence lands in one of the later parts.
    """
    pairs = np.loadtxt(src, dtype=np.int64, ndmin=2)
    users, items = pairs[:, 0], pairs[:, 1]
    order = np.argsort(users, kind="stable")
    users, items = users[order], items[order]
    starts = np.flatnonzero(np.r_[True, users[1:] != users[:-1]])
    lengths = np.diff(np.r_[starts, users.size])
    rank = np.arange(users.size) - np.repeat(starts, lengths)
    fraction = rank / np.repeat(lengths, lengths)
    day = np.searchsorted(np.cumsum(shares) / sum(shares), fraction, side="right")
    rng = np.random.default_rng(seed)
    late = rng.random(starts.size) < late_users
    arrival = rng.integers(1, len(shares), starts.size)
    day = np.where(np.repeat(late, lengths), np.repeat(arrival, lengths), np.minimum(day, len(shares) - 1))
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for d in range(len(shares)):
        path = out / f"day-{d + 1:02d}.txt"
        keep = day == d
        np.savetxt(path, np.stack([users[keep], items[keep]], axis=1), fmt="%d")
        paths.append(path)
    return paths
