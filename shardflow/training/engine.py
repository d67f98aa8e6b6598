"""The engine: a training run's lifecycle on a Dask cluster — start one actor per device, run steps and epochs
(`fit`), evaluate, and close — keeping watch that every device's worker is still there.

Device d runs on the d-th worker (workers sorted by address), hosted by a DeviceActor
(shardflow.training.actor); the engine holds the actors' futures for as long as it
lives, and `close` releases them. For each call the engine makes one call per device,
and inside it the devices exchange the protocol's rounds directly
(shardflow.training.transport). A step starts only when every update of the one before
is applied. Checkpoints, restores, warm starts and exports: shardflow.training.persistence.
"""

from __future__ import annotations

import functools
import math
import operator
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from distributed import Client, wait
from distributed.client import FutureCancelledError, FuturesCancelledError

from shardflow.cluster import live_workers
from shardflow.data.batches import TrainData, negative_seed
from shardflow.data.clicks import load_training_data
from shardflow.data.workload import Workload
from shardflow.errors import InputError, WorkerLost, WorkerOutOfMemory, stop_if_asked
from shardflow.model.configs import ClickConfig, ModelConfig, OptimizerConfig
from shardflow.model.metrics import Metrics
from shardflow.model.ranking import CatalogRanks, UsersToRank
from shardflow.planner.memory import check_worker_memory
from shardflow.planner.sharding_plan import ShardingPlan
from shardflow.planner.topology import Topology
from shardflow.training.actor import DeviceActor
from shardflow.training.config import EpochStats, Span, TrainConfig, TrainResult, check_batch
from shardflow.training.device import StepStats
from shardflow.training.evaluate import SPLITS, eval_targets
from shardflow.training.messages import PeerStopped, Traffic
from shardflow.training.persistence import Persistence
from shardflow.training.transport import CLOSE_WAIT_S, PROBE_S, EngineClosing
from shardflow.training.validation import PREFIX, Values, best_epoch, epoch_scores, stop_now, validation_values
from storage.staging import for_workers

# How often a wait on the devices checks that their workers are still in the cluster.
POLL_S = 0.5
# How long an unreachable worker may take to be reported lost by the scheduler.
LOSS_GRACE_S = 10.0
# A lost worker last seen above this share of its memory limit is reported as probably stopped for memory.
MEMORY_NOTE_SHARE = 0.8
# Steps left out of the steady-state speed (the first ones pay for allocations and warm caches).
WARMUP_STEPS = 2
# Steps one call to the devices runs: they overlap each step's batch building and requests with
# the step before, and the engine's round trip is paid once per call (progress is heard per call).
# A call runs STEPS_PER_CALL steps, or as many more as take CALL_S at the last call's pace, up to
# MAX_STEPS_PER_CALL: the MovieLens DLRM's 5-10 ms steps ran 1.06x as fast on 1 device, 1.04x on 2
# (medians of 5 alternated rounds; bench/click_logs.py's model) as at 8 a call; the bundled log's 35 ms keep 8.
STEPS_PER_CALL = 8
MAX_STEPS_PER_CALL = 64
CALL_S = 0.25


def steps_per_call(step_s: float) -> int:
    """Steps a call runs when a step took `step_s` seconds in the last one (module constants)."""
    if not step_s < CALL_S / STEPS_PER_CALL:  # slow steps, or none measured (inf, nan)
        return STEPS_PER_CALL
    return min(MAX_STEPS_PER_CALL, int(CALL_S / max(step_s, CALL_S / MAX_STEPS_PER_CALL)))


def add_up(into: dict[str, float], seconds: dict[str, float]) -> None:
    """Add each part's seconds into `into`."""
    for part, s in seconds.items():
        into[part] = into.get(part, 0.0) + s


def check_plan_matches(data: Workload, plan: ShardingPlan, topology: Topology) -> None:
    """The plan must hold exactly the tables the model reads, with the dataset's row counts."""
    planned = {t.name: t.rows for t in plan.tables}
    for name, rows in data.rows.items():
        if name not in planned:
            raise InputError(
                f"the plan has no table '{name}' (it has {', '.join(planned)}); accepted: a plan of this dataset"
            )
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


class Engine(Persistence):
    def __init__(
        self,
        client: Client,
        dataset: str,
        plan: ShardingPlan,
        topology: Topology,
        model: ModelConfig | ClickConfig,
        optimizer: OptimizerConfig,
        train: TrainConfig,
        scaled_rows: dict[str, int] | None = None,
    ) -> None:
        self.client, self.topology, self.model, self.train, self.plan = client, topology, model, train, plan
        self.data = load_training_data(dataset, model.features, train.window, validation=train.validation)
        check_plan_matches(self.data, plan, topology)
        P = topology.devices
        check_batch(train.batch_size, P, self.data.targets)
        info = live_workers(client)
        workers = sorted(info)
        if len(workers) < P:
            raise InputError(f"the plan has {P} devices, the cluster {len(workers)} workers; accepted: >= {P} workers")
        # a sequence model's step, at an even share of the batch (a click log's is in the measured fixed part)
        step = model.step_bytes(-(-train.batch_size // P)) if isinstance(model, ModelConfig) else 0
        self.need_bytes = check_worker_memory(plan, topology, model.dim, scaled_rows,
                                              {workers[d]: info[workers[d]] for d in range(P)},
                                              users=self.data.offset_users, held=self.data.held_bytes(P),
                                              rows_optimizer=optimizer.rows, step=step)
        # The worker each device lives on, by address and by the worker's unique id: a
        # worker restarted by its nanny comes back as a different id without the shard.
        self.workers = {workers[d]: info[workers[d]]["id"] for d in range(P)}
        self._last_seen: dict[str, dict[str, Any]] = {}  # address -> the scheduler's last word on that worker
        self.actors: list[Any] = []  # one DeviceActor handle per device
        self._inflight: list[Any] = []  # the running actor calls close() waits for
        self._device_lost = False  # a device's worker left: its peers' calls may be blocked asking it
        self._closing = False  # close() has begun: the actors it cancels are released, not lost
        self.optimizer = optimizer
        self._futures: list[Any] = []
        try:
            try:
                self._futures = self._submit_actors(dataset, optimizer, scaled_rows)
                self._wait_futures(self._futures)
                self.actors = [f.result() for f in self._futures]
            except (FutureCancelledError, FuturesCancelledError):
                # An actor's worker died while the actor was being made: a lost worker, not a failed run.
                self.check_workers(grace_s=LOSS_GRACE_S)
                raise
            except (RuntimeError, OSError):
                # Made, then its worker died before this read it (distributed: "Worker holding Actor was lost"),
                # or gone as the plan was scattered to it (a closed comm). An actor whose constructor raised is
                # in error too, on a worker still there: raised as it came.
                self.check_workers(grace_s=LOSS_GRACE_S, by_actor=False)
                raise
            self._wait([a.connect(self.actors) for a in self.actors])
            self._generation = 0
            self._form_group()
        except BaseException:
            self.close()
            raise
        self.step_count = 0
        self._tag = 0  # numbers every step call, so a failed call's late messages are never taken for the next
        self.downloads = 0  # parameter downloads (exports) this engine has written

    def _submit_actors(self, dataset: str, optimizer: OptimizerConfig, scaled_rows: dict[str, int] | None) -> list[Any]:
        """One DeviceActor per device, each pinned to its worker: their futures."""
        train, P, run = self.train, self.topology.devices, uuid.uuid4().hex[:8]
        # The plan goes to the workers once, beside the graph: a hashed click log's (26 tables of 2^20 rows)
        # was 52 MiB inside it, Dask's "Sending large graph" warning on the terminal.
        [tables] = self.client.scatter([self.plan.for_devices(P)], workers=self.workers, broadcast=True,
                                       hash=False)
        return [
            self.client.submit(
                DeviceActor, d, self.topology, tables, for_workers(dataset), self.model, optimizer,
                batch_size=train.batch_size, dedup=train.dedup, array_device=train.device,
                early=train.early_answers, scaled_rows=scaled_rows, window=train.window,
                validation=train.validation, build_ahead=train.builds_ahead(),
                actor=True, workers=[address], allow_other_workers=False, key=f"device-{d}-{run}",
            )
            for d, address in enumerate(self.workers)
        ]

    def _form_group(self) -> None:
        """Transport collective, several devices: the devices form a new gloo group (each leaves the one before;
        after a failed call the old one's streams are out of step)."""
        if self.train.transport != "collective" or len(self.actors) < 2:
            return
        self._generation += 1
        host, port = self._wait([self.actors[0].open_rendezvous()])[0]
        self._wait([a.join(host, port, self._generation) for a in self.actors])

    def _all(self, method: str, *args: object) -> list[Any]:
        try:
            calls = [getattr(a, method)(*args) for a in self.actors]
        except RuntimeError:  # distributed refuses calls to an actor whose worker is known lost
            self.check_workers()
            raise
        return self._wait(calls)

    def check_workers(self, grace_s: float = 0.0, by_actor: bool = True) -> None:
        """WorkerLost if a worker holding one of this engine's shards has left the cluster.

        With `grace_s`, keep looking that long: the scheduler may learn of a death after a
        peer already failed to reach the worker. With `by_actor`, an actor's future in error,
        lost or cancelled counts as its worker gone too.
        """
        deadline = time.monotonic() + grace_s
        while True:
            now = live_workers(self.client)  # first: a lost scheduler cancels every actor, and is no worker loss
            if self._closing:  # a call's wait that close() cut short: its actors are cancelled there, not lost
                raise EngineClosing("the engine is closing: its shards are released")
            for d, f in enumerate(self._futures if by_actor else ()):
                if f.status in ("error", "lost", "cancelled"):
                    self._lost(d, f"device {d}'s actor is {f.status}: its worker left the cluster, the shard is lost")
            for d, (address, wid) in enumerate(self.workers.items()):
                if now.get(address, {}).get("id") != wid:
                    self._lost(d, f"device {d}'s worker {address} left the cluster; its parameter shard is lost")
                self._last_seen[address] = now[address]
            if time.monotonic() >= deadline:
                return
            time.sleep(POLL_S)

    def _lost(self, device: int, what: str) -> None:
        self._device_lost = True
        note = self._memory_note(list(self.workers)[device], device)
        raise (WorkerOutOfMemory if note else WorkerLost)(what + note)

    def _memory_note(self, address: str, device: int) -> str:
        """What the worker at `address` last reported of its memory, when that was near its limit."""
        seen = self._last_seen.get(address, {})
        used, limit = seen.get("metrics", {}).get("memory"), seen.get("memory_limit")
        if not used or not limit or used < MEMORY_NOTE_SHARE * limit:
            return ""
        return (f" (last seen using {used / 2**30:.2f} GiB of its {limit / 2**30:.2f} GiB memory limit, the plan's "
                f"rows and sums there {self.need_bytes[device] / 2**30:.2f} GiB: probably stopped for exceeding it; a "
                "plan with more devices, less memory_slack, a smaller dim or a larger memory limit per worker fits)")

    def _wait(self, calls: list[Any]) -> list[Any]:
        """The results of actor calls, in order; WorkerLost as soon as a device's worker is gone.

        A call to an actor whose worker died may never return, so no wait here is unbounded.
        """
        self._inflight = list(calls)  # what close() waits for if this wait is cut short
        out = [self._result(call) for call in calls]
        self._inflight = []
        return out

    def _result(self, call: Any) -> Any:
        while True:
            try:
                return call.result(timeout=POLL_S)
            except TimeoutError:
                self.check_workers()
            except (OSError, WorkerLost):
                # The worker could not be reached (or the method's own I/O error), or a device found a peer
                # gone: the scheduler, given its grace, names the device whose worker left (a node cut off is
                # often seen by a peer's probe first); else the error as it came.
                self.check_workers(grace_s=LOSS_GRACE_S)
                raise

    def _wait_futures(self, futures: list[Any]) -> None:
        """Until every actor is made: WorkerLost where a worker is gone; an actor whose constructor refused (a
        dataset its worker cannot read, a GPU it does not have) as an InputError naming its device and worker."""
        while True:
            try:
                wait(futures, timeout=POLL_S)
                made = True
            except TimeoutError:
                made = False
                self.check_workers(by_actor=False)
            for d, f in enumerate(futures):
                if f.status == "error" and isinstance(e := f.exception(), InputError):
                    raise InputError(f"device {d} (worker {list(self.workers)[d]}): {e}") from None
            if made:
                return
            self.check_workers()

    def step(self, epoch: int, step_in_epoch: int) -> list[StepStats]:
        """One synchronous step on every device; per-device stats (loss, examples, seconds per part)."""
        return self.steps(epoch, step_in_epoch, 1)[0]

    def steps(self, epoch: int, first: int, count: int) -> list[list[StepStats]]:
        """Steps first..first+count-1 of `epoch` in one call per device; per step, per-device stats.

        If a step fails, the steps before it stay applied (and counted) and the error is the
        failing device's own, not a peer's relay of it.
        """
        stop_if_asked()  # a stop signal whose exception a finalizer lost is taken up here, before the call
        self._tag += 1
        args = (self._tag, epoch, first, count, self.step_count, self.train.seed)
        try:
            calls = [a.steps(*args) for a in self.actors]
        except RuntimeError:  # distributed refuses calls to an actor whose worker is known lost
            self.check_workers()
            raise
        results, errors = [], []
        self._inflight = list(calls)
        for call in calls:  # every device ends its part (a failed one tells the others) before this returns
            try:
                results.append(self._result(call))
            except WorkerLost:
                raise
            except Exception as e:
                errors.append(e)
        self._inflight = []
        if errors:
            if self.actors:  # else closed meanwhile: nothing left to ask
                self.step_count = min(self._all("clock"))
                self._form_group()
            raise next((e for e in errors if not isinstance(e, PeerStopped)), errors[0])
        self.step_count += count
        return [list(per_step) for per_step in zip(*results, strict=True)]

    def train_epoch(self, epoch: int, max_steps: int | None = None,
                    on_step: Callable[[int, int, float, int, float], None] | None = None) -> EpochStats:
        """Every step of `epoch` (at most `max_steps` and the config's steps_per_epoch): what they did.

        `on_step(done, steps, loss, examples, seconds)`, if given, hears after every step
        how far the epoch is (the mean loss and the examples so far). The split is the
        slowest device's seconds per part: building the batch, each round (the wait for
        its messages included) and the forward and backward.
        """
        terms = self.model.loss_terms
        caps = [c for c in (max_steps, self.train.steps_per_epoch) if c is not None]
        steps = min([self.data.steps_per_epoch(self.train.batch_size), *caps])
        parts: dict[str, float] = {}
        steady_parts: dict[str, float] = {}
        loss = examples = 0.0
        steady = Span()
        t0 = time.perf_counter()
        i = 0
        step_s = math.inf  # the last call's seconds per step
        while i < steps:
            # The first steps alone (they are the warm-up), then several per call.
            count = 1 if self.step_count < WARMUP_STEPS else min(steps_per_call(step_s), steps - i)
            began = time.monotonic()
            per_step = self.steps(epoch, i, count)
            ended = time.monotonic()
            took = ended - began
            step_s = took / count
            for stats in per_step:
                i += 1
                loss += sum(x.loss_sum for x in stats)
                n = sum(x.examples for x in stats)
                examples += n
                slowest = StepStats.slowest(stats)
                add_up(parts, slowest)
                if self.step_count > WARMUP_STEPS:
                    steady += Span(1, int(n), took / count, began, ended)
                    add_up(steady_parts, slowest)
                if on_step is not None:
                    on_step(i, steps, loss / (examples * terms) if examples else float("nan"), int(examples),
                            time.perf_counter() - t0)
        return EpochStats(epoch, steps, int(examples), loss / (examples * terms) if examples else float("nan"),
                          time.perf_counter() - t0, parts, steady, steady_parts)

    def fit(self, start_epoch: int = 0, best: str | Path | None = None) -> TrainResult:
        """Epochs start_epoch.. (at most max_steps steps in all). With a validation split (train.patience),
        each epoch is scored on it; training stops `patience` epochs after the best one, whose
        parameters are kept in a checkpoint at `best` and restored at the end."""
        if self.train.validation and best is None:
            raise InputError("a validation split keeps its best epoch in a checkpoint; accepted: fit(best=PATH)")
        keep = None if best is None else Path(best)
        result = TrainResult()
        parts: dict[str, float] = {}
        steady_parts: dict[str, float] = {}
        for epoch in range(start_epoch, self.train.epochs):
            left = None if self.train.max_steps is None else self.train.max_steps - result.steps
            if left is not None and left <= 0:
                break
            e = self.train_epoch(epoch, left)
            result.steps += e.steps
            result.examples += e.examples
            result.seconds += e.seconds
            result.epoch_loss.append(e.loss)
            add_up(parts, e.parts)
            add_up(steady_parts, e.steady_parts)
            result.steady += e.steady
            if keep is not None and self.train.validation and self._validate(epoch + 1, result, keep):
                break
        if keep is not None and result.best_epoch not in (None, start_epoch + len(result.epoch_loss)):
            self.restore(keep)
        timed, steps = (steady_parts, result.steady.steps) if result.steady.steps else (parts, result.steps)
        result.timings = {k: v / max(steps, 1) for k, v in timed.items()}
        return result

    def _validate(self, epoch: int, result: TrainResult, best: str | Path) -> bool:
        """Score epoch `epoch` (from 1) on the validation split, checkpoint it to `best` if it is the best so
        far; whether to stop."""
        result.validation[epoch] = self.validate()
        scores = epoch_scores(result.validation)
        if best_epoch(scores) == epoch:
            self.checkpoint(best, epoch, result.validation[epoch])
            result.best_epoch = epoch
        return stop_now(scores, self.train.patience, self.train.min_epochs)

    def evaluate(self, split: str = "test") -> Metrics:
        """The model's metrics on a seeded sample of eval_users held-out examples of `split` (test, or
        validation when one is held out). Sequences: HR@10 and NDCG@10 among eval_negatives items its
        user had not touched, AUC against the first of them; click logs: AUC and log-loss."""
        if split not in SPLITS:
            raise InputError(f"split {split!r}; accepted: {', '.join(SPLITS)}")
        targets = eval_targets(self.data, self.train.eval_users, self.train.seed, split)
        parts = self.data.sub_batches(targets, len(self.actors))  # each device's in the parts it reads
        seed = negative_seed(self.train.seed, -1)
        calls = [a.evaluate(p, self.train.eval_negatives, seed) for a, p in zip(self.actors, parts, strict=True)]
        return sum(self._wait(calls), self.data.scored()).metrics()

    def validate(self) -> Values:
        """The validation split's figures under their val_ keys: the sampled protocol's, and with train.full_ranking
        (a sequence workload) the whole catalog's, which epochs are then chosen on."""
        values = validation_values(self.evaluate("validation"))
        if self.train.full_ranking != "off" and isinstance(self.data, TrainData):
            values |= {PREFIX + k: v for k, v in self.rank_catalog("validation").items()}
        return values

    def rank_catalog(self, split: str = "test") -> dict[str, float]:
        """The held-out items of `split` (the users `evaluate` samples) ranked among the whole catalog where its rows
        live: each device makes its users' states from rows read where they are, every device counts the item
        rows it is home to against all of them, and only those counts travel (shardflow.model.ranking); no worker
        holds the item table. full_hr_at_K and full_ndcg_at_K, seen items left out unless train.full_ranking is
        include-seen."""
        if split not in SPLITS:
            raise InputError(f"split {split!r}; accepted: {', '.join(SPLITS)}")
        targets = eval_targets(self.data, self.train.eval_users, self.train.seed, split)
        parts = self.data.sub_batches(targets, len(self.actors))
        include = self.train.full_ranking == "include-seen"
        made = self._wait([a.users_to_rank(p, include) for a, p in zip(self.actors, parts, strict=True) if p.size])
        zeros = np.zeros(targets.size, dtype=np.int64)
        if not made:  # no held-out item to rank
            return CatalogRanks(zeros, zeros, zeros.astype(bool)).metrics()
        users = UsersToRank.joined([u for u, _ in made])
        counted = self._wait([a.rank_home(users) for a in self.actors])
        return sum(counted, CatalogRanks(zeros, zeros, np.concatenate([m for _, m in made]))).metrics()

    def traffic(self) -> Traffic:
        """Bytes per kind, [sender, receiver], summed over every shard since the start."""
        return functools.reduce(operator.add, self._all("traffic"))

    def parameters(self) -> list[dict[str, Any]]:
        return self._all("parameters")

    def close(self) -> None:
        """Release every shard. Each device is stopped first and its actor's thread drained, at most
        CLOSE_WAIT_S: a shard released while a peer still sends to it (a call an interrupt left running,
        or one it cut off before it was counted as running) would make that peer's worker log a KeyError.
        Once a device was lost its peers are only stopped: a restore restarts them, and their calls may be
        blocked asking the lost one (a connect retried for comm.timeouts.connect) for all of CLOSE_WAIT_S."""
        self._closing = True
        actors, inflight, self.actors, self._inflight = self.actors, self._inflight, [], []
        futures, self._futures = self._futures, []
        if self.client.status == "running":
            # actors is empty where their start failed, while the futures are all there: pair what there is
            live = [a for a, f in zip(actors, futures, strict=False) if f.status == "finished"]
            if live:
                self._stop_and_wait(live, inflight)
            if futures:  # a closed client's scheduler holds nothing
                self.client.cancel(futures)

    def _stop_and_wait(self, actors: list[Any], inflight: list[Any]) -> None:
        """Stop every device (a call that reaches one later ends before sending anything), then wait for
        the calls known to run and for each actor's thread to finish whatever was queued on it."""
        deadline = time.monotonic() + CLOSE_WAIT_S
        self._until(deadline, self._each(actors, "stop"))
        if not self._device_lost:
            self._until(deadline, inflight + self._each(actors, "settled"))

    @staticmethod
    def _each(actors: list[Any], method: str) -> list[Any]:
        calls = []
        for a in actors:
            try:
                calls.append(getattr(a, method)())
            except Exception:  # an actor known lost: nothing runs there
                pass
        return calls

    @staticmethod
    def _until(deadline: float, calls: list[Any]) -> None:
        for call in calls:
            while time.monotonic() < deadline:
                try:
                    call.result(timeout=PROBE_S)
                    break
                except TimeoutError:
                    continue
                except Exception:  # stopped (EngineClosing), failed or lost: it is over either way
                    break

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
