"""The training engine: one DeviceWorker actor per device on a Dask cluster, driven step by step.

Device d runs on the d-th worker (workers sorted by address); the engine holds the
actors' futures for as long as it lives, and `close` releases them. Each step is the
rounds described in shardflow.training.device; the engine waits for every device
between rounds, so a step starts only when every update of the one before is applied.
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass, field

import numpy as np
from distributed import Client

from shardflow.errors import InputError
from shardflow.model import ModelConfig
from shardflow.optim import OptimizerConfig
from shardflow.planner.plan import SINGLE, ShardingPlan, TablePlan, row_bytes
from shardflow.planner.topology import Topology
from shardflow.training.batches import DEDUP_SCOPES, TrainData, negative_seed
from shardflow.training.device import DeviceWorker
from shardflow.training.shard import TRAFFIC_KINDS



@dataclass(frozen=True)
class TrainConfig:
    batch_size: int = 4096
    dedup: str = "device"
    epochs: int = 1
    max_steps: int | None = None  # stop after this many steps in all (None: run every epoch)
    device: str = "cpu"
    seed: int = 0
    eval_users: int | None = 5000  # users evaluated (a seeded sample; None: all)
    eval_candidates: int = 100

    def __post_init__(self) -> None:
        for name in ("batch_size", "epochs", "eval_candidates"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise InputError(f"{name} = {v!r}; accepted: an integer >= 1")
        for name in ("max_steps", "eval_users"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise InputError(f"{name} = {v!r}; accepted: an integer >= 1, or none")
        if self.eval_candidates < 2:
            raise InputError(f"eval_candidates = {self.eval_candidates}; accepted: >= 2 (the positive and a negative)")
        if self.dedup not in DEDUP_SCOPES:
            raise InputError(f"dedup scope {self.dedup!r}; accepted: {', '.join(DEDUP_SCOPES)}")


@dataclass
class TrainResult:
    steps: int = 0
    examples: int = 0
    seconds: float = 0.0
    epoch_loss: list = field(default_factory=list)  # mean BCE per epoch (per candidate)
    timings: dict = field(default_factory=dict)  # mean seconds per step: batch, pull, compute, push, sync


def check_plan_matches(data: TrainData, plan: ShardingPlan, topology: Topology) -> None:
    """The plan must hold exactly the tables the model reads, with the dataset's row counts."""
    planned = {t.name: t.rows for t in plan.tables}
    for name, rows in data.rows.items():
        if name not in planned:
            raise InputError(f"the plan has no table '{name}' (it has {', '.join(planned)}); accepted: a plan of this dataset")
        if planned[name] != rows:
            raise InputError(
                f"the plan's table '{name}' has {planned[name]:,} rows, the dataset's {rows:,}; "
                "accepted: a plan made from this dataset's profile"
            )
    extra = sorted(set(planned) - set(data.rows))
    if extra:
        raise InputError(f"the plan has tables {extra} the model does not read; accepted: {', '.join(data.rows)}")
    for t in plan.tables:
        if t.home.size and int(t.home.max()) >= topology.devices:
            raise InputError(f"table '{t.name}': home {int(t.home.max())} on a topology of {topology.devices} devices")


def estimation_plan(
    rows: dict[str, int], dim: int, server_bytes: int | None
) -> tuple[ShardingPlan, dict[str, int], float]:
    """Caffe2-style estimation: every table on one parameter server (device 0).

    If the tables exceed `server_bytes`, every table's row count is scaled by one common
    factor so they fit; the server maps id -> id mod scaled rows. Returns (plan with every
    row single on device 0, scaled rows per table, the factor).
    """
    need = sum(rows.values()) * row_bytes(dim)
    factor = 1.0 if server_bytes is None else min(1.0, server_bytes / need)
    scaled = {t: max(1, math.floor(r * factor)) for t, r in rows.items()}
    if server_bytes is not None and sum(scaled.values()) * row_bytes(dim) > server_bytes:
        raise InputError(
            f"estimation server memory {server_bytes:,} bytes cannot hold one row of each of {len(rows)} tables; "
            f"accepted: at least {len(rows) * row_bytes(dim):,} bytes"
        )
    tables = tuple(TablePlan(t, np.full(r, SINGLE, np.int8), np.zeros(r, np.int32)) for t, r in rows.items())
    return ShardingPlan("estimation", tables), scaled, factor


class Engine:
    def __init__(
        self,
        client: Client,
        dataset: str,
        plan: ShardingPlan,
        topology: Topology,
        model: ModelConfig,
        optimizer: OptimizerConfig,
        train: TrainConfig,
        scaled_rows: dict[str, int] | None = None,
    ) -> None:
        self.client, self.topology, self.model, self.train = client, topology, model, train
        self.data = TrainData.load(dataset, model.features)
        check_plan_matches(self.data, plan, topology)
        P = topology.devices
        if train.batch_size < P:
            raise InputError(f"batch size {train.batch_size} < {P} trainers; accepted: batch size >= {P}")
        if self.data.steps_per_epoch(train.batch_size) == 0:
            raise InputError(
                f"batch size {train.batch_size} > {self.data.targets.size} training examples; "
                f"accepted: at most {self.data.targets.size}"
            )
        workers = sorted(client.scheduler_info()["workers"])
        if len(workers) < P:
            raise InputError(f"the plan has {P} devices, the cluster {len(workers)} workers; accepted: >= {P} workers")
        resources = {"GPU": 1} if train.device == "cuda" else None
        run = uuid.uuid4().hex[:8]
        self._futures = [
            client.submit(
                DeviceWorker,
                d,
                topology,
                {t.name: t for t in plan.tables},
                str(dataset),
                model,
                optimizer,
                batch_size=train.batch_size,
                dedup=train.dedup,
                array_device=train.device,
                scaled_rows=scaled_rows,
                actor=True,
                workers=[workers[d]],
                allow_other_workers=False,
                resources=resources,
                key=f"device-{d}-{run}",
            )
            for d in range(P)
        ]
        try:
            self.actors = [f.result() for f in self._futures]
            for a in [a.connect(self.actors) for a in self.actors]:
                a.result()
        except BaseException:
            self.close()
            raise
        replicated = any((t.tier != SINGLE).any() for t in plan.tables)
        several_nodes = len(topology.nodes) > 1
        self.rounds = (["to_primaries"] if replicated and several_nodes else []) + ["apply"]
        self.step_count = 0

    def _all(self, method: str, *args) -> list:
        calls = [getattr(a, method)(*args) for a in self.actors]
        return [c.result() for c in calls]

    def step(self, epoch: int, step_in_epoch: int) -> tuple[list[dict], float]:
        """One synchronous step on every device; (per-trainer stats, seconds spent in the sync rounds)."""
        s = self.step_count
        try:
            stats = self._all("compute", epoch, step_in_epoch, s, self.train.seed)
            t = time.perf_counter()
            for r in self.rounds:
                self._all(r, s)
        except Exception:
            self._all("discard")
            raise
        self.step_count += 1
        return stats, time.perf_counter() - t

    def fit(self) -> TrainResult:
        result = TrainResult()
        per_epoch = self.data.steps_per_epoch(self.train.batch_size)
        candidates = 1 + self.model.negatives
        parts = {k: 0.0 for k in ("batch", "pull", "compute", "push", "sync")}
        t0 = time.perf_counter()
        for epoch in range(self.train.epochs):
            loss = examples = 0.0
            for i in range(per_epoch):
                if self.train.max_steps is not None and result.steps >= self.train.max_steps:
                    break
                stats, sync_s = self.step(epoch, i)
                result.steps += 1
                loss += sum(x["loss_sum"] for x in stats)
                examples += sum(x["examples"] for x in stats)
                for k in ("batch", "pull", "compute", "push"):
                    parts[k] += max(x[f"{k}_s"] for x in stats)
                parts["sync"] += sync_s
            if examples:
                result.epoch_loss.append(loss / (examples * candidates))
                result.examples += int(examples)
        result.seconds = time.perf_counter() - t0
        result.timings = {k: v / max(result.steps, 1) for k, v in parts.items()}
        return result

    def evaluate(self) -> dict:
        """Leave-last-out AUC (one sampled negative) and HR@10 (among eval_candidates) over a seeded user sample."""
        targets = self.data.eval_targets
        n = self.train.eval_users
        if n is not None and n < targets.size:
            targets = np.sort(np.random.default_rng([self.train.seed, 1]).choice(targets, n, replace=False))
        parts = np.array_split(targets, len(self.actors))
        seed = negative_seed(self.train.seed, -1)
        calls = [a.evaluate(p, self.train.eval_candidates, seed) for a, p in zip(self.actors, parts)]
        out = [c.result() for c in calls]
        total = sum(o["examples"] for o in out)
        return {
            "auc": sum(o["auc_sum"] for o in out) / max(total, 1),
            "hr_at_10": sum(o["hits"] for o in out) / max(total, 1),
            "users": total,
        }

    def traffic(self) -> dict[str, np.ndarray]:
        """Bytes per kind, [sender, receiver], summed over every shard since the start."""
        per = self._all("traffic")
        return {k: sum(p[k] for p in per) for k in TRAFFIC_KINDS}

    def parameters(self) -> list[dict]:
        return self._all("parameters")

    def close(self) -> None:
        self.actors = []
        if self._futures:
            self.client.cancel(self._futures)
            self._futures = []

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
