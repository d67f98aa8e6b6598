"""The training engine: one DeviceWorker actor per device on a Dask cluster, driven step by step.

Device d runs on the d-th worker (workers sorted by address); the engine holds the
actors' futures for as long as it lives, and `close` releases them. Each step is the
rounds described in shardflow.training.device; the engine waits for every device
between rounds, so a step starts only when every update of the one before is applied.
"""

from __future__ import annotations

import dataclasses
import math
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import zarr
from distributed import Client, wait

from shardflow.cluster import live_workers
from shardflow.errors import InputError, WorkerLost
from shardflow.model import ModelConfig
from shardflow.optim import OptimizerConfig
from shardflow.planner.plan import SINGLE, ShardingPlan, TablePlan, row_bytes
from shardflow.planner.topology import Topology
from shardflow.training.batches import DEDUP_SCOPES, TrainData, negative_seed
from shardflow.training.device import DeviceWorker, answer
from shardflow.training.evaluate import eval_targets
from shardflow.training.shard import TRAFFIC_KINDS
from storage.checkpoint import CHECKPOINT, COMPRESSORS, EXPORT, EXPORT_CHUNK_ROWS, digest, finish, write_arrays
from storage.checkpoint import read as read_checkpoint
from storage.staging import staged

# How often a wait on the devices checks that their workers are still in the cluster.
POLL_S = 0.5
# How long an unreachable worker may take to be reported lost by the scheduler.
LOSS_GRACE_S = 10.0
# A lost worker last seen above this share of its memory limit is reported as probably stopped for memory.
MEMORY_NOTE_SHARE = 0.8


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
    window: tuple[int, int] = (0, 0)  # (first segment trained on, first evaluated on): see TrainData.load

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


def export_chunk(actors: list, table: str, home: np.ndarray, start: int, store: str) -> dict[str, str]:
    """One chunk of the export: rows start..start+len(home) and their Adagrad sums from their homes,
    written by this task alone; {array chunk name: digest}."""
    ids = np.arange(start, start + home.size, dtype=np.int64)
    calls = [(np.flatnonzero(home == d), int(d)) for d in np.unique(home)]
    calls = [(sel, d, actors[d].export_rows(table, ids[sel])) for sel, d in calls]
    rows = state = None
    for sel, d, call in calls:
        got, got_state = answer(call, actors[d])
        if rows is None:
            rows = np.empty((ids.size, got.shape[1]), dtype=np.float32)
            state = np.empty(ids.size, dtype=np.float32)
        rows[sel], state[sel] = got, got_state
    out = {}
    for kind, values in (("tables", rows), ("state", state)):
        zarr.open_array(f"{store}/{kind}/{table}", mode="r+")[start : start + ids.size] = values
        out[f"{kind}/{table}/{start}"] = digest(f"{kind}/{table}/{start}", values)
    return out


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
            raise InputError(
                f"table '{t.name}': home {int(t.home.max())} on a topology of {topology.devices} devices; "
                f"accepted: homes 0 to {topology.devices - 1} (a plan made for this topology)"
            )


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
        self.client, self.topology, self.model, self.train, self.plan = client, topology, model, train, plan
        self.data = TrainData.load(dataset, model.features, train.window)
        check_plan_matches(self.data, plan, topology)
        P = topology.devices
        if train.batch_size < P:
            raise InputError(f"batch size {train.batch_size} < {P} trainers; accepted: batch size >= {P}")
        if self.data.steps_per_epoch(train.batch_size) == 0:
            raise InputError(
                f"batch size {train.batch_size} > {self.data.targets.size} training examples; "
                f"accepted: at most {self.data.targets.size}"
            )
        info = live_workers(client)
        workers = sorted(info)
        if len(workers) < P:
            raise InputError(f"the plan has {P} devices, the cluster {len(workers)} workers; accepted: >= {P} workers")
        resources = {"GPU": 1} if train.device == "cuda" else None
        run = uuid.uuid4().hex[:8]
        # The worker each device lives on, by address and by the worker's unique id: a
        # worker restarted by its nanny comes back as a different id without the shard.
        self.workers = {workers[d]: info[workers[d]]["id"] for d in range(P)}
        self._last_seen: dict[str, dict] = {}  # address -> the scheduler's last word on that worker
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
                window=train.window,
                actor=True,
                workers=[workers[d]],
                allow_other_workers=False,
                resources=resources,
                key=f"device-{d}-{run}",
            )
            for d in range(P)
        ]
        try:
            self._wait_futures(self._futures)
            self.actors = [f.result() for f in self._futures]
            self._wait([a.connect(self.actors) for a in self.actors])
        except BaseException:
            self.close()
            raise
        replicated = any((t.tier != SINGLE).any() for t in plan.tables)
        several_nodes = len(topology.nodes) > 1
        self.rounds = (["to_primaries"] if replicated and several_nodes else []) + ["apply"]
        self.step_count = 0
        self.downloads = 0  # parameter downloads (exports) this engine has written

    def _all(self, method: str, *args) -> list:
        try:
            calls = [getattr(a, method)(*args) for a in self.actors]
        except RuntimeError:  # distributed refuses calls to an actor whose worker is known lost
            self.check_workers()
            raise
        return self._wait(calls)

    def check_workers(self, grace_s: float = 0.0) -> None:
        """WorkerLost if a worker holding one of this engine's shards has left the cluster.

        With `grace_s`, keep looking that long: the scheduler may learn of a death after a
        peer already failed to reach the worker.
        """
        deadline = time.monotonic() + grace_s
        while True:
            now = live_workers(self.client)  # first: a lost scheduler cancels every actor, and is no worker loss
            for d, f in enumerate(self._futures):
                if f.status in ("error", "lost", "cancelled"):
                    raise WorkerLost(f"device {d}'s actor is {f.status}: its worker left the cluster, the shard is lost"
                                     + self._memory_note(list(self.workers)[d]))
            for d, (address, wid) in enumerate(self.workers.items()):
                if now.get(address, {}).get("id") != wid:
                    raise WorkerLost(f"device {d}'s worker {address} left the cluster; its parameter shard is lost"
                                     + self._memory_note(address))
                self._last_seen[address] = now[address]
            if time.monotonic() >= deadline:
                return
            time.sleep(POLL_S)

    def _memory_note(self, address: str) -> str:
        """What the worker at `address` last reported of its memory, when that was near its limit."""
        seen = self._last_seen.get(address, {})
        used, limit = seen.get("metrics", {}).get("memory"), seen.get("memory_limit")
        if not used or not limit or used < MEMORY_NOTE_SHARE * limit:
            return ""
        return (f" (last seen using {used / 2**30:.2f} GiB of its {limit / 2**30:.2f} GiB memory limit: probably "
                "stopped for exceeding it; a plan with more devices, or a larger memory limit per worker, fits)")

    def _wait(self, calls: list) -> list:
        """The results of actor calls, in order; WorkerLost as soon as a device's worker is gone.

        A call to an actor whose worker died may never return, so no wait here is unbounded.
        """
        out = []
        for call in calls:
            while True:
                try:
                    out.append(call.result(timeout=POLL_S))
                    break
                except TimeoutError:
                    self.check_workers()
                except OSError:  # the worker could not be reached, or the method's own I/O error
                    self.check_workers(grace_s=LOSS_GRACE_S)
                    raise
        return out

    def _wait_futures(self, futures: list) -> None:
        while True:
            try:
                wait(futures, timeout=POLL_S)
                return
            except TimeoutError:
                self.check_workers()

    def step(self, epoch: int, step_in_epoch: int) -> tuple[list[dict], float]:
        """One synchronous step on every device; (per-trainer stats, seconds spent in the sync rounds)."""
        s = self.step_count
        try:
            stats = self._all("compute", epoch, step_in_epoch, s, self.train.seed)
            t = time.perf_counter()
            for r in self.rounds:
                self._all(r, s)
        except WorkerLost:
            raise
        except Exception:
            self._all("discard")
            raise
        self.step_count += 1
        return stats, time.perf_counter() - t

    def train_epoch(self, epoch: int, max_steps: int | None = None, on_step=None) -> dict:
        """Every step of `epoch` (at most `max_steps`); loss, examples, steps, seconds and the time split.

        `on_step(done, steps, loss, examples, seconds)`, if given, hears after every step
        how far the epoch is (the mean loss and the examples so far).
        """
        candidates = 1 + self.model.negatives
        per_epoch = self.data.steps_per_epoch(self.train.batch_size)
        steps = per_epoch if max_steps is None else min(per_epoch, max_steps)
        parts = {k: 0.0 for k in ("batch", "pull", "compute", "push", "sync")}
        loss = examples = 0.0
        t0 = time.perf_counter()
        for i in range(steps):
            stats, sync_s = self.step(epoch, i)
            loss += sum(x["loss_sum"] for x in stats)
            examples += sum(x["examples"] for x in stats)
            for k in ("batch", "pull", "compute", "push"):
                parts[k] += max(x[f"{k}_s"] for x in stats)
            parts["sync"] += sync_s
            if on_step is not None:
                on_step(i + 1, steps, loss / (examples * candidates) if examples else float("nan"), int(examples),
                        time.perf_counter() - t0)
        return {
            "epoch": epoch,
            "steps": steps,
            "examples": int(examples),
            "loss": loss / (examples * candidates) if examples else float("nan"),
            "seconds": time.perf_counter() - t0,
            "parts": parts,
        }

    def fit(self, start_epoch: int = 0) -> TrainResult:
        result = TrainResult()
        parts = {k: 0.0 for k in ("batch", "pull", "compute", "push", "sync")}
        for epoch in range(start_epoch, self.train.epochs):
            left = None if self.train.max_steps is None else self.train.max_steps - result.steps
            if left is not None and left <= 0:
                break
            e = self.train_epoch(epoch, left)
            result.steps += e["steps"]
            result.examples += e["examples"]
            result.seconds += e["seconds"]
            result.epoch_loss.append(e["loss"])
            for k, v in e["parts"].items():
                parts[k] += v
        result.timings = {k: v / max(result.steps, 1) for k, v in parts.items()}
        return result

    # -- checkpoints and the parameter download ---------------------------------------------
    def checkpoint(self, path: str | Path, info: dict) -> dict:
        """Every shard writes itself into a staging directory beside `path`; the manifest is written
        last and the directory renamed to `path` (replacing a damaged checkpoint a resume skipped).

        A checkpoint cut off at any point is a leftover staging directory, never `path`.
        """
        with staged(Path(path), overwrite=True) as stage:
            saved = self._all("save", str(stage))
            digests = {k: v for s in saved for k, v in s["digests"].items()}
            return finish(stage, CHECKPOINT, {
                **info,
                "step": self.step_count,
                "dense_steps": saved[0]["dense_steps"],
                "devices": self.topology.devices,
                "model": dataclasses.asdict(self.model),
                "batch_size": self.train.batch_size,
                "seed": self.train.seed,
            }, digests)

    def restore(self, path: str | Path) -> dict:
        """Load every shard from the complete checkpoint at `path`; its manifest."""
        m = read_checkpoint(path, CHECKPOINT)
        mine = dataclasses.asdict(self.model)
        theirs = {k: tuple(v) if isinstance(v, list) else v for k, v in m["model"].items()}
        if theirs != mine or m["devices"] != self.topology.devices:
            raise InputError(
                f"{path}: checkpoint of model {theirs} on {m['devices']} devices; accepted: model {mine} "
                f"on {self.topology.devices} devices (the run's configuration)"
            )
        self._wait([a.load(str(path), m["arrays"], m["step"], m["dense_steps"]) for a in self.actors])
        self.step_count = m["step"]
        return m

    def warm_start(self, model: str | Path, manifest: dict) -> None:
        """Start from an exported model (`manifest` is its verified manifest), placed onto this plan.

        Row r of a table takes the export's row r and its Adagrad sum where the export has
        it (the dataset's appends keep every raw id's row, so row r is the same item); rows
        added since keep their fresh initial values and a zero sum. Each shard reads only
        the rows it stores, straight from the export store: the model is never gathered in
        one process. The dense layers and their optimiser state (and step count) are
        carried over: training goes on as if the new days had been more epochs, instead of
        a reset whose first Adagrad and Adam steps (about lr per coordinate) would throw
        the carried weights off.
        """
        mine = dataclasses.asdict(self.model)
        theirs = {k: tuple(v) if isinstance(v, list) else v for k, v in manifest["model"].items()}
        differ = sorted(k for k in mine if k != "seed" and theirs.get(k) != mine[k])
        if differ:
            raise InputError(
                f"{model}: exported with {', '.join(f'{k}={theirs.get(k)!r}' for k in differ)}; accepted for a warm "
                f"start: {', '.join(f'{k}={mine[k]!r}' for k in differ)} (the run's configuration), or a cold start"
            )
        rows = manifest["tables"]
        grown = {t.name: t.rows for t in self.plan.tables}
        shrunk = sorted(name for name, n in rows.items() if n > grown.get(name, -1))
        if shrunk:
            raise InputError(f"{model}: tables {shrunk} have more rows than this dataset's; accepted: an export of "
                             "this dataset before an append")
        self._wait([a.warm_start(str(model), rows, manifest["dense_steps"]) for a in self.actors])

    def export(self, out: str | Path, info: dict) -> dict:
        """The parameter download: every table in global id order, chunk by chunk in parallel, with the
        optimiser state a later model version starts from (row Adagrad sums, the dense optimiser's).

        One task per output chunk pulls that chunk's rows from their home shards and writes
        it; no process holds more than one chunk of a table. Built beside `out` and swapped
        in when its manifest is written.
        """
        with staged(Path(out), overwrite=True) as stage:
            root = zarr.open_group(str(stage), mode="w")
            tasks = []
            for t in self.plan.tables:
                root.create_array(
                    f"tables/{t.name}", shape=(t.rows, self.model.dim), dtype=np.float32,
                    chunks=(EXPORT_CHUNK_ROWS, self.model.dim), compressors=COMPRESSORS,
                )
                root.create_array(f"state/{t.name}", shape=(t.rows,), dtype=np.float32,
                                  chunks=(EXPORT_CHUNK_ROWS,), compressors=COMPRESSORS)
                for start in range(0, t.rows, EXPORT_CHUNK_ROWS):
                    home = t.home[start : start + EXPORT_CHUNK_ROWS]
                    tasks.append(self.client.submit(
                        export_chunk, self.actors, t.name, home, start, str(stage), pure=False,
                        key=f"export-{t.name}-{start}-{uuid.uuid4().hex[:8]}",
                    ))
            self._wait_futures(tasks)
            digests = {k: v for chunk in self.client.gather(tasks) for k, v in chunk.items()}
            dense, dense_state, dense_steps = self._wait([self.actors[0].dense_parameters()])[0]
            digests.update(write_arrays(stage / "dense", dense, "dense"))
            digests.update(write_arrays(stage / "dense_opt", dense_state, "dense_opt"))
            manifest = finish(stage, EXPORT, {
                **info,
                "tables": {t.name: t.rows for t in self.plan.tables},
                "dim": self.model.dim,
                "model": dataclasses.asdict(self.model),
                "chunk_rows": EXPORT_CHUNK_ROWS,
                "dense_steps": dense_steps,
            }, digests)
        self.downloads += 1
        return manifest

    def evaluate(self) -> dict:
        """Leave-last-out AUC (one sampled negative) and HR@10 (among eval_candidates) over a seeded user sample."""
        targets = eval_targets(self.data, self.train.eval_users, self.train.seed)
        parts = np.array_split(targets, len(self.actors))
        seed = negative_seed(self.train.seed, -1)
        calls = [a.evaluate(p, self.train.eval_candidates, seed) for a, p in zip(self.actors, parts)]
        out = self._wait(calls)
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
        if self._futures and self.client.status == "running":  # a closed client's scheduler holds nothing
            self.client.cancel(self._futures)
        self._futures = []

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
