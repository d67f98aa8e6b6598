"""Helpers the tests share: the bundled real data, store snapshots, synthetic lookup profiles."""

from __future__ import annotations

import copy
import hashlib
import itertools
import os
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from shardflow.model.configs import ModelConfig, OptimizerConfig
from shardflow.model.forward import on_device
from shardflow.model.sequence import scores
from shardflow.planner.access import TableAccess
from shardflow.planner.costmodel import CostModel, StepShape
from shardflow.planner.memory import budget_bytes_per_device
from shardflow.planner.sharding_plan import NODE, ShardingPlan, TablePlan
from shardflow.planner.strategies import propose
from shardflow.planner.topology import Node, Topology
from shardflow.training.device import Device
from shardflow.training.reference import ReferenceTrainer
from storage.dataset import Dataset
from storage.versions import VersionStart

DATA = Path(__file__).resolve().parents[1] / "data"
REAL = {
    "sasrec": DATA / "amazon-video" / "Video.txt",
    "s3rec": DATA / "amazon-beauty" / "Beauty.txt",
    "recbole": DATA / "movielens-100k" / "ml-100k.inter",
    "criteo": DATA / "criteo-sample" / "criteo_sample.txt",
}
AVAZU = DATA / "avazu-sample" / "avazu_sample.txt"  # the criteo format's other layout


def head_of_log(dest: Path, lines: int) -> Path:
    """The bundled sasrec log's first `lines` lines (its first users' events, in order) written to `dest`."""
    with open(REAL["sasrec"]) as whole:
        dest.write_text("".join(itertools.islice(whole, lines)))
    return dest


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
ATTENTION = replace(MODEL, encoder="self-attention", blocks=2, heads=2, dropout=0.3, item_dropout=0.2)
OPTIMIZER = OptimizerConfig(row_lr=0.1, dense_lr=0.01)
ADAM = OptimizerConfig(rows="adam", row_lr=0.01, dense_lr=0.01)
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


def random_case(data, seed: int) -> tuple[Topology, ShardingPlan, str, OptimizerConfig]:
    """A topology of 1-4 nodes of 1-3 devices each (uplinks 2-10 GB/s), a plan of random tiers and homes (some
    tables all one tier; on 3 or more nodes, half the node rows copied onto two nodes only), a dedup scope and
    the rows' optimizer: a case no fixed topology above names."""
    rng = np.random.default_rng(seed)
    topology = Topology(tuple(Node(f"n{i}", int(d), float(rng.choice([2.0, 5.0, 10.0])))
                              for i, d in enumerate(rng.integers(1, 4, rng.integers(1, 5)))), 100.0)
    nodes, tables = len(topology.nodes), []
    for name, rows in data.rows.items():
        tier = rng.integers(0, 3, rows).astype(np.int8) if rng.random() < 0.7 else np.full(rows, rng.integers(0, 3),
                                                                                                np.int8)
        home = rng.integers(0, topology.devices, rows).astype(np.int32)
        if nodes < 3 or rng.random() < 0.5:
            tables.append(TablePlan(name, tier, home))
            continue
        ids = np.flatnonzero(tier == NODE)
        ids = np.sort(rng.choice(ids, ids.size // 2, replace=False)).astype(np.int64)
        home_node = topology.node_of_device[home[ids]]
        other = (home_node + rng.integers(1, nodes, ids.size)) % nodes
        tables.append(TablePlan(name, tier, home, ids, (1 << home_node) | (1 << other)))
    dedup = str(rng.choice(["none", "device", "node"]))
    return topology, ShardingPlan("random", tuple(tables)), dedup, ADAM if rng.random() < 0.3 else OPTIMIZER


# -- the engine against the single-process reference -------------------------------------------
def accesses(dataset) -> list[TableAccess]:
    """Every table's lookups by the dataset's events: one per event, or a table of token sequences' ids."""
    ds = Dataset.open(dataset)
    out = []
    for t in ds.info.table_names:
        ids = ds.ids(t)
        held = ids[ids >= 0]
        out.append(TableAccess.from_counts(t, np.bincount(held, minlength=ds.info.table(t).rows),
                                           held.size / ds.info.interactions))
    return out


_PLANS: dict[tuple, ShardingPlan] = {}


def planned(dataset, strategy: str, devices: int, dim: int = MODEL.dim, batch: int = BATCH) -> ShardingPlan:
    """The plan `strategy` makes for the store at `dataset`, made once per test process and shared: the exactness
    grids ask for each one dozens of times. Its arrays are read-only, so a test that wrote into a shared plan
    would fail there."""
    key = (str(dataset), strategy, devices, dim, batch)
    if key not in _PLANS:
        topo = TOPOLOGIES[devices]
        acc = accesses(dataset)
        model = CostModel(topo, StepShape(batch, dim))
        plan = propose(strategy, acc, topo, budget_bytes_per_device(acc, topo, dim, 3.0), model)
        for table in plan.tables:
            for array in (table.tier, table.home, table.partial_ids, table.partial_nodes):
                array.flags.writeable = False
        _PLANS[key] = plan
    return _PLANS[key]


_REFERENCES: dict[tuple, tuple] = {}


def reference(data, steps: int, model=MODEL, batch: int = BATCH, optimizer: OptimizerConfig = OPTIMIZER
              ) -> ReferenceTrainer:
    """The single-process reference after `steps` steps of epoch 0: trained once per test process and argument
    list, and each caller given its own copy (a test may go on stepping it), sharing the read-only `data`."""
    key = (id(data), steps, model, batch, optimizer)
    if key not in _REFERENCES:
        ref = ReferenceTrainer(data, model, optimizer, batch, seed=0)
        for i in range(steps):
            ref.step(0, i)
        _REFERENCES[key] = (data, ref)  # holding `data` keeps its id from being reused by another object
    return copy.deepcopy(_REFERENCES[key][1], {id(data): data})


def check_against(ref: ReferenceTrainer, shards: list[dict]) -> None:
    """Every stored row and its optimizer state within float32 rounding of the reference; every replica bitwise
    equal to the others."""
    for t, table in ref.weights.items():
        scale = np.abs(table).max()
        copies: dict[int, np.ndarray] = {}
        for p in shards:
            ids, w = p[t]["ids"], p[t]["weights"]
            assert np.abs(w - table[ids]).max(initial=0.0) <= 1e-5 * scale, t
            want = ref.state[t][ids]  # within rounding of each state column's scale (Adam's moments sum to ~0)
            bound = 1e-5 * (np.abs(want) + np.abs(ref.state[t]).max(axis=0, initial=0.0)) + 1e-12
            assert (np.abs(p[t]["state"] - want) <= bound).all(), f"{t}: optimizer state"
            for i, row, acc in zip(ids.tolist(), w, p[t]["state"], strict=True):
                if i in copies:
                    assert copies[i][0].tobytes() == row.tobytes() and copies[i][1].tobytes() == acc.tobytes(), (
                        f"{t} row {i}: replicas differ"
                    )
                else:
                    copies[i] = (row, acc)
        assert sorted(copies) == list(range(table.shape[0])), f"{t}: some row is stored nowhere"
    for k, v in shards[0]["dense"].items():
        assert np.abs(v - ref.dense[k]).max() <= 1e-5 * np.abs(ref.dense[k]).max(), k


def in_process_devices(data, plan: ShardingPlan, topology: Topology, dedup: str = "device", batch: int = BATCH,
                       model: ModelConfig = MODEL, optimizer: OptimizerConfig = OPTIMIZER,
                       early: bool = False, fuse: bool = True) -> list[Device]:
    """One Device per device of `topology`, all in this process (for shardflow.training.protocol.InProcess),
    each given the plan as the engine gives it to its actors."""
    tables = plan.for_devices(topology.devices)
    return [Device(d, topology, tables, data, model, optimizer, batch_size=batch, dedup=dedup, early=early,
                   fuse=fuse) for d in range(topology.devices)]


def sequences_by_raw_user(ds, table: str = "item") -> dict:
    """raw user id -> the raw ids of the user's events in `table`, read back from a dataset store."""
    off = ds.offsets()
    raw, rows = ds.raw_ids(table)
    raw_of_row = dict(zip(rows.tolist(), raw.tolist(), strict=True))
    ids = ds.ids(table).tolist()
    users = ds.user_ids().tolist()
    return {users[u]: [raw_of_row[i] for i in ids[off[u] : off[u + 1]]] for u in range(ds.info.users)}


def split_into_days(src: Path, out: Path, shares: tuple[float, ...] = (1, 1, 1), late_users: float = 1 / 3,
                    seed: int = 0) -> list[Path]:
    """Split a sasrec log (`user item` lines, each user's in time order) into daily parts day-1.txt, ...

    Each user's events are cut in time order: part d gets the events between the
    cumulative shares d-1 and d of the user's sequence (cut points rounded up or down at
    random, so the parts hold about `shares` of all events). A seeded `late_users`
    fraction of users arrives only later: their whole sequence lands in one later part.
    """
    pairs = np.loadtxt(src, dtype=np.int64, ndmin=2)
    users, items = pairs[:, 0], pairs[:, 1]
    order = np.argsort(users, kind="stable")
    users, items = users[order], items[order]
    starts = np.flatnonzero(np.r_[True, users[1:] != users[:-1]])
    lengths = np.diff(np.r_[starts, users.size])
    rank = np.arange(users.size) - np.repeat(starts, lengths)
    rng = np.random.default_rng(seed)
    cuts = np.cumsum(shares)[:-1] / sum(shares)
    bounds = np.floor(lengths[:, None] * cuts[None, :] + rng.random(starts.size)[:, None]).astype(np.int64)
    day = (rank[:, None] >= np.repeat(bounds, lengths, axis=0)).sum(axis=1)
    late = rng.random(starts.size) < late_users
    arrival = rng.integers(1, len(shares), starts.size) if len(shares) > 1 else np.zeros(starts.size, np.int64)
    day = np.where(np.repeat(late, lengths), np.repeat(arrival, lengths), day)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for d in range(len(shares)):
        path = out / f"day-{d + 1}.txt"
        keep = day == d
        np.savetxt(path, np.stack([users[keep], items[keep]], axis=1), fmt="%d")
        paths.append(path)
    return settled(*paths)


# The soak's nights (tests/flows/test_soak.py), here so that its bound's unit tests judge the same figures.
CYCLES = 12
# Runs before the baseline: imports, caches, Dask's bounded logs and the allocator settle. Resident memory
# after a malloc_trim, per run (2 cores, 3 runs of the soak): the flow process 777, 782, 784, 786, 786, 786,
# 786, 787, 788, 789, 790, 790 MB; a worker 543, 543, 546, 551, 563, 557, 557, 555, 555, 564, 559, 564 —
# up 12-20 MB by run 5, then within a few MB (Python's own allocations, traced, grow 0.3-0.5 MB a worker over 9 runs).
WARM = 5
WORKER_GROWTH_MB = 20  # allowed growth of each worker over the last CYCLES - WARM runs (measured: 1-7)


def worker_growth_mb(base: dict[str, float], last: dict[str, float]) -> dict[str, float]:
    """Each worker's growth in resident MB from `base` (a run after warm-up) to `last`, for the soak's bound.

    A worker first given some kind of work late steps once to its peers' level (488 -> 532 MB at night 9 where
    its peers sat at 514-546 from night 1): growth counts from the higher of its own level and the busiest
    worker's at `base`, so a leak shows as growth past the busiest level, from any worker."""
    level = max(base.values())
    return {a: mb - max(base[a], level) for a, mb in last.items() if a in base}


def settled(*paths: Path) -> list[Path]:
    """`paths`, last modified a day ago: finished parts a night's run reads (config part_settle_s).

    Copy them with shutil.copy2, which keeps the time."""
    a_day_ago = time.time() - 86400
    for p in paths:
        os.utime(p, (a_day_ago, a_day_ago))
    return list(paths)


def bce_loss(config, dense: dict, rows: dict, index, norm: int) -> float:
    """The sequence model's loss computed apart from forward_backward: binary cross-entropy of `index`'s
    logits (the positive in column 0), summed in numpy and divided by `norm`."""
    logit = scores(config, dense, rows, on_device(index, torch.device("cpu"))).numpy()
    label = np.zeros_like(logit)
    label[:, 0] = 1
    return float((np.logaddexp(0, logit) - label * logit).sum()) / norm


def numeric_gradient(param, loss, eps: float = 1e-6) -> np.ndarray:
    """Central finite differences of `loss()` in every entry of the float64 tensor `param` (restored after)."""
    out = np.zeros(tuple(param.shape))
    for i in np.ndindex(*param.shape):
        keep = float(param[i])
        param[i] = keep + eps
        up = loss()
        param[i] = keep - eps
        down = loss()
        param[i] = keep
        out[i] = (up - down) / (2 * eps)
    return out


def version_start(number: int, **fields) -> VersionStart:
    """A start record of version `number` as a test needs one: the fields it names, the rest empty."""
    return VersionStart(**{"version": number, "dataset": "", "segments": (), "warm_start_from": None,
                           "window": (0, 0), "config": {}, "started": "2026-01-01T00:00:00+00:00", **fields})


# A trained version's run summary as result.json and the flow's result hold it (every key, plain JSON values).
TRAINED = {
    "run_dir": "/runs/nightly", "version": 2, "trained": True, "warm_start_from": 1, "parts_added": ["day2.txt"],
    "parts": 2, "window": [1, 1], "epochs": 3, "best_epoch": 2, "patience": 1, "auc": 0.81, "hr_at_10": 0.5,
    "ndcg_at_10": 0.3, "logloss": None, "val_auc": 0.8, "val_hr_at_10": 0.49, "val_ndcg_at_10": 0.29,
    "val_logloss": None, "val_full_hr_at_10": 0.07, "val_full_ndcg_at_10": 0.035, "val_full_hr_at_20": 0.1,
    "val_full_ndcg_at_20": 0.045, "full_ranking": "exclude-seen", "full_hr_at_10": 0.06, "full_ndcg_at_10": 0.03,
    "full_hr_at_20": 0.09, "full_ndcg_at_20": 0.04, "eval_users": 500, "bytes_per_step": 1.5e6,
    "modeled_bytes_per_step": 1.49e6,
    "row_wise_bytes_per_step": 2e6, "comm_time_us_per_step": 120.0, "row_wise_comm_time_us_per_step": 160.5,
    "replanned": False, "replan_reason": "kept", "fresh_plan_comm_time_us_per_step": 119.0,
    "previous_plan_comm_time_us_per_step": 120.0, "checkpoints": ["/c/1", "/c/2"], "model": "/m", "downloads": 1,
    "epoch_loss": [0.5, 0.4, 0.35], "resumed_from": None,
    "skipped_checkpoints": [{"checkpoint": "/c/0", "reason": "truncated"}], "restarts": 0, "warnings": [],
    "plots": ["/p.svg"], "previous_auc": 0.8, "previous_hr_at_10": 0.48, "previous_ndcg_at_10": 0.28,
    "previous_logloss": None, "previous_full_ranking": "exclude-seen", "previous_full_hr_at_10": 0.05,
    "previous_full_ndcg_at_10": 0.025, "previous_full_hr_at_20": 0.08, "previous_full_ndcg_at_20": 0.035,
    "promoted": True, "promoted_on": "auc", "finished": "2026-11-26T02:00:00+00:00", "current": 2,
    "message": None,
}


def pem_files(tmp_path: Path) -> dict[str, str]:
    """A CA, a certificate and its key as PEM files (distributed's own temporary credentials, written out)."""
    from distributed.security import Security

    made = Security.temporary()
    files = {"tls_ca_file": made.tls_ca_file, "tls_cert": made.tls_scheduler_cert, "tls_key": made.tls_scheduler_key}
    for key, text in files.items():
        (tmp_path / f"{key}.pem").write_text(text)
    return {key: str(tmp_path / f"{key}.pem") for key in files}


def tiny_scorer(encoder: str, seed: int, items: int, users: int) -> tuple:
    """A float64 sequence model over `items` items and `users` users' 3-item histories (user 0's a short one),
    for scoring against a plain count: (config, dense, rows, history, the generator that made them)."""
    rng = np.random.default_rng(seed)
    config = ModelConfig(dim=4, mlp=(5, 3), history=3, negatives=1, seed=seed, encoder=encoder, blocks=1, dropout=0.0)
    dense = {k: torch.from_numpy(v.astype(np.float64)) for k, v in config.init_dense().items()}
    rows = {"item": torch.from_numpy(rng.normal(size=(items, 4)))}
    history = rng.integers(0, items, size=(users, 3))
    history[0, :2] = -1
    return config, dense, rows, history, rng
