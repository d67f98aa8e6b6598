"""The Dask layer: one actor per device carrying a shardflow.training.device.Device, and the engine.

Device d runs on the d-th worker (workers sorted by address); the engine holds the
actors' futures for as long as it lives, and `close` releases them. The actors only
carry messages: for each step the engine makes one call per device, and inside it the
devices exchange the protocol's rounds directly, one message per peer per round
(shardflow.training.protocol), each waiting in one place (`Mailbox.wait`) that also
checks its peers are alive. A step starts only when every update of the one before is
applied.
"""

from __future__ import annotations

import math
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from distributed import Client, wait
from distributed.client import FutureCancelledError, FuturesCancelledError

from shardflow.cluster import live_workers
from shardflow.errors import InputError, TrainingError, WorkerLost, WorkerOutOfMemory
from shardflow.dlrm import ClickConfig
from shardflow.model import ModelConfig
from shardflow.optim import OptimizerConfig
from shardflow.planner.plan import SINGLE, DevicePlan, ShardingPlan, TablePlan, row_bytes
from shardflow.planner.topology import Topology
from shardflow.planner.costmodel import check_dedup
from shardflow.training.batches import TrainData, check_batch, negative_seed
from shardflow.training.clicks import ClickData, config_record, load_training_data, read_record
from shardflow.training.device import Device
from shardflow.training.evaluate import eval_targets
from shardflow.training.protocol import TRAFFIC_KINDS, Message, PeerStopped, Round
from storage.checkpoint import (CHECKPOINT, EXPORT, EXPORT_CHUNK_ROWS, create_export, finish, write_arrays,
                                write_export_chunk)
from storage.checkpoint import read as read_checkpoint
from storage.staging import staged

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
STEPS_PER_CALL = 8


@dataclass(frozen=True)
class TrainConfig:
    batch_size: int = 4096
    dedup: str = "device"
    epochs: int = 1
    max_steps: int | None = None  # stop after this many steps in all (None: run every epoch)
    steps_per_epoch: int | None = None  # the first steps of each epoch's order (None: all of them)
    device: str = "cpu"
    seed: int = 0
    eval_users: int | None = 5000  # users evaluated (a seeded sample; None: all)
    eval_candidates: int = 100
    window: tuple[int, int] = (0, 0)  # (first segment trained on, first evaluated on): see TrainData.load and ClickData
    early_answers: bool = False  # answer the next step's requests while waiting (protocol.py: PREFETCH)

    def __post_init__(self) -> None:
        for name in ("batch_size", "epochs", "eval_candidates"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise InputError(f"{name} = {v!r}; accepted: an integer >= 1")
        for name in ("max_steps", "steps_per_epoch", "eval_users"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise InputError(f"{name} = {v!r}; accepted: an integer >= 1, or none")
        if self.eval_candidates < 2:
            raise InputError(f"eval_candidates = {self.eval_candidates}; accepted: >= 2 (the positive and a negative)")
        check_dedup(self.dedup)
        if not isinstance(self.early_answers, bool):
            raise InputError(f"early_answers = {self.early_answers!r}; accepted: true or false")


@dataclass
class TrainResult:
    steps: int = 0
    examples: int = 0
    seconds: float = 0.0
    epoch_loss: list = field(default_factory=list)  # mean BCE per epoch (per candidate)
    timings: dict = field(default_factory=dict)  # mean seconds per step: batch, each round, compute
    steady: dict = field(default_factory=lambda: {"steps": 0, "examples": 0, "seconds": 0.0})  # after warm-up

    @property
    def examples_per_s(self) -> float:
        """Over the steady-state steps (after the first WARMUP_STEPS), or all of them if there are no others."""
        if self.steady["seconds"] > 0:
            return self.steady["examples"] / self.steady["seconds"]
        return self.examples / self.seconds if self.seconds else 0.0


# A peer that has not answered for PROBE_S is asked whether it still exists: a call to an
# actor released meanwhile (its run ended or died) never returns in distributed 2026.8,
# and the waiting thread must not stay blocked (the worker's next actor would queue
# behind it). PEER_TIMEOUT_S bounds the wait even for a peer that exists but is stuck.
PROBE_S = 1.0
CLOSE_WAIT_S = 10.0  # how long closing waits for the devices' running calls to stop
PEER_TIMEOUT_S = 300.0


def _probe(peer) -> None:
    try:
        peer.alive
    except Exception as e:  # KeyError (actor released), OSError (worker gone), RuntimeError (lost)
        raise WorkerLost(f"a peer device is gone ({type(e).__name__}: {e})") from None


def answer(call, peer):
    """The result of `call` to the actor `peer`; WorkerLost once the peer is gone or silent too long."""
    deadline = time.monotonic() + PEER_TIMEOUT_S
    while True:
        try:
            return call.result(timeout=PROBE_S)
        except TimeoutError:
            _probe(peer)
            if time.monotonic() > deadline:
                raise WorkerLost(f"no answer from a peer device in {PEER_TIMEOUT_S:.0f} s") from None


class EngineClosing(TrainingError):
    """A device's call ended because its engine is closing (an interrupt, a failed run)."""


class Mailbox:
    """Messages delivered to one device (on the worker's event loop), taken by its step (on the actor's thread).

    Messages are filed by the engine's call tag, step and round: a message that arrives
    for a round or a step this device has not reached yet waits for it; those of a call
    that ended (a failed step) are dropped when the next call begins.
    """

    def __init__(self) -> None:
        self._ready = threading.Condition()
        self._box: dict[tuple[int, int, Round], list[Message]] = {}
        self._answered: set[tuple[int, int, int]] = set()  # (tag, step, sender) of REQUESTs answered early
        self._stopped = False

    def stop(self) -> None:
        """The engine is closing: every wait, now or later, ends with EngineClosing."""
        with self._ready:
            self._stopped = True
            self._ready.notify_all()

    def check_open(self) -> None:
        """EngineClosing once stopped: a call that reaches a device after its engine began closing sends nothing."""
        if self._stopped:
            raise EngineClosing("the engine is closing: the call was not started")

    def put(self, tag: int, message: Message) -> None:
        with self._ready:
            self._box.setdefault((tag, message.step, message.round), []).append(message)
            self._ready.notify_all()

    def forget_before(self, tag: int) -> None:
        with self._ready:
            self._box = {k: v for k, v in self._box.items() if k[0] >= tag}
            self._answered = {k for k in self._answered if k[0] >= tag}

    def wait(self, tag: int, step: int, round: Round, peers: dict[int, object], early=None,
             idle=None) -> list[Message]:
        """The round's message of `step` from every one of `peers` ({device: actor}), in device order.

        The only place a device waits for others: every PROBE_S it checks that each peer it
        still waits for exists, and gives up after PEER_TIMEOUT_S. Rather than wait it first
        hands the next step's REQUESTs not answered yet to `early(requests)` (they stay here
        for that step's REQUEST round), then calls `idle()`, work that returns whether it did
        any; both on this thread.
        """
        deadline = time.monotonic() + PEER_TIMEOUT_S
        key = (tag, step, round)
        with self._ready:
            while True:
                if self._stopped:
                    raise EngineClosing("the engine is closing: the step stopped here")
                got = self._box.get(key, [])
                if len(got) >= len(peers) or any(m.error is not None for m in got):
                    self._box.pop(key, None)
                    return sorted(got, key=lambda m: m.sender)
                asked = [m for m in self._box.get((tag, step + 1, Round.REQUEST), [])
                         if (tag, step + 1, m.sender) not in self._answered] if early is not None else []
                if asked:
                    self._answered.update((tag, step + 1, m.sender) for m in asked)
                    self._unlocked(early, asked)
                    continue
                if idle is not None and self._unlocked(idle):
                    continue
                if not self._ready.wait(timeout=PROBE_S):
                    missing = set(peers) - {m.sender for m in got}
                    for d in sorted(missing):
                        self._unlocked(_probe, peers[d])
                    if time.monotonic() > deadline:
                        raise WorkerLost(f"no {round.value} message from devices {sorted(missing)} in "
                                         f"{PEER_TIMEOUT_S:.0f} s")

    def _unlocked(self, work, *args):
        """work(*args) with the mailbox open to deliveries meanwhile (it reads rows, or asks a peer); its result."""
        self._ready.release()
        try:
            return work(*args)
        finally:
            self._ready.acquire()


class DeviceActor:
    """The Dask actor of one device: loads the training data, carries a Device and its messages."""

    alive = True  # an attribute, not a method: reading it remotely fails at once if the actor is gone

    def __init__(self, device: int, topology: Topology, tables: dict[str, DevicePlan], dataset: str,
                 config: ModelConfig | ClickConfig, optimizer: OptimizerConfig, *, batch_size: int, dedup: str,
                 array_device: str = "cpu", scaled_rows: dict[str, int] | None = None,
                 window: tuple[int, int] = (0, 0), early: bool = False) -> None:
        data = load_training_data(dataset, config.features, window)
        self.device = Device(device, topology, tables, data, config, optimizer, batch_size=batch_size, dedup=dedup,
                             array_device=array_device, scaled_rows=scaled_rows, early=early)
        self.index = device
        self.peers: list = []
        self.mail = Mailbox()

    def connect(self, peers: list) -> int:
        self.peers = peers
        return self.index

    # -- on the worker's event loop: messages and reads from other devices ----------------
    async def deliver(self, tag: int, message: Message) -> None:
        self.mail.put(tag, message)

    async def stop(self) -> None:
        """On the event loop, so it runs while the actor's thread is inside a step: that step ends at its next
        wait and sends no more messages of its own."""
        self.mail.stop()

    def settled(self) -> None:
        """Returns once every call queued before it on the actor's thread (one thread per worker) has ended."""

    async def read_rows(self, table: str, ids: np.ndarray, sender: int) -> np.ndarray:
        return self.device.serve_rows(table, ids, sender)

    async def read_dense(self, sender: int) -> dict:
        return self.device.serve_dense(sender)

    async def export_rows(self, table: str, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return self.device.export_rows(table, ids)

    # -- on the actor's thread -------------------------------------------------------------
    def steps(self, tag: int, epoch: int, first: int, count: int, step: int, seed: int) -> list[dict]:
        """Steps first..first+count-1 of `epoch` (global step numbers from `step`): every round's messages out
        to the peers, theirs in; this device's stats of each step.

        While it waits for the peers' gradients, the device builds the next step's batch and
        sends its requests: batch building and the first round of a step overlap the step before.
        With early answers (protocol.py: PREFETCH) it does so at its first wait instead, and
        answers the peers' requests for their next step whenever it waits.
        """
        self.mail.check_open()
        self.mail.forget_before(tag)
        peers = {d: a for d, a in enumerate(self.peers) if d != self.index}
        device, sent, stats = self.device, [], []
        current = step

        def answer_early(requests: list[Message]) -> None:  # the next step's requests, while this one waits
            sent.extend((m.sender, self.peers[m.sender].deliver(tag, device.protocol.answer_early(m)))
                        for m in requests)

        early = device.protocol.early
        ahead, deferred = None, None  # the step whose requests are out already; the error of preparing it

        def prepare(k: int) -> bool:
            """Prepare step k and send its requests, if that is still to do; whether it did."""
            nonlocal ahead, deferred
            if k >= count or ahead == k or deferred is not None:
                return False
            try:
                sent.extend(self._send(tag, device.prepare(epoch, first + k, step + k, seed)))
                ahead = k
            except Exception as e:  # this step's messages are out: finish it, fail the next
                deferred = e
            return True

        try:
            for k in range(count):
                current = step + k
                if deferred is not None:  # preparing this step failed: it fails now, the one before is applied
                    raise deferred
                out = device.start(epoch, first + k, step + k, seed)
                if ahead != k:
                    sent += self._send(tag, out)
                for round in device.rounds:
                    if round is Round.GRADIENTS:  # while the peers compute (with early answers, at any wait)
                        prepare(k + 1)
                    work = (answer_early, lambda k=k: prepare(k + 1)) if early and k + 1 < count else (None, None)
                    inbox = self.mail.wait(tag, step + k, round, peers, *work)
                    if round is Round.REPLY:  # a patch goes with the sender's early answer
                        patched = {m.sender: peers[m.sender] for m in inbox if m.patch}
                        for m in self.mail.wait(tag, step + k, Round.PREFETCH, patched) if patched else []:
                            device.protocol.take_early(m)
                    out = device.receive(round, inbox)
                    if out:
                        sent += self._send(tag, out)
                stats.append(device.finish())
                sent = self._settled(sent)
        except BaseException as e:
            device.abort()
            if not isinstance(e, WorkerLost):
                # Whatever round a peer waits for now (of this step, or the next one's requests if this
                # device failed while preparing it), it finds this device's error there.
                waits = [(current, r) for r in device.rounds] + [(current + 1, Round.REQUEST)]
                sent += [(p, self.peers[p].deliver(tag, Message(r, s_, self.index, error=str(e))))
                         for s_, r in waits for p in peers]
            for peer, call in sent:
                try:
                    answer(call, self.peers[peer])
                except Exception:  # the step failed already; its first error is the one to report
                    pass
            raise
        for peer, call in sent:
            answer(call, self.peers[peer])
        return stats

    def _settled(self, sent: list) -> list:
        """The deliveries not yet acknowledged; raises a delivery's error."""
        left = []
        for peer, call in sent:
            if call.done():
                call.result()
            else:
                left.append((peer, call))
        return left

    def clock(self) -> int:
        return self.device.clock

    def write_export(self, store: str, table: str, starts: list[int], chunk_rows: int) -> dict[str, str]:
        """Write chunks `starts` of `table`'s export (this device's share; no other writer touches them):
        rows and Adagrad sums from their homes, its own read directly, the next chunk's requested from
        the other homes while this one is written. {array chunk name: digest}."""
        self.mail.check_open()
        plan = self.device.protocol.tables[table]
        rows_total = plan.rows

        def request(start: int):
            ids = np.arange(start, min(start + chunk_rows, rows_total), dtype=np.int64)
            home = plan.home_of(ids)
            calls = [(home == d, d, self.peers[d].export_rows(table, ids[home == d]))
                     for d in np.unique(home).tolist() if d != self.index]
            return start, ids, home, calls

        digests: dict[str, str] = {}
        upcoming = request(starts[0]) if starts else None
        for i in range(len(starts)):
            start, ids, home, calls = upcoming
            upcoming = request(starts[i + 1]) if i + 1 < len(starts) else None
            rows = np.empty((ids.size, self.device.config.dim), dtype=np.float32)
            state = np.empty(ids.size, dtype=np.float32)
            mine = home == self.index
            if mine.any():
                rows[mine], state[mine] = self.device.export_rows(table, ids[mine])
            for sel, d, call in calls:
                rows[sel], state[sel] = answer(call, self.peers[d])
            digests.update(write_export_chunk(store, table, start, rows, state))
        return digests

    def _send(self, tag: int, out: dict[int, Message]) -> list:
        return [(peer, self.peers[peer].deliver(tag, m)) for peer, m in out.items()]

    def evaluate(self, targets: np.ndarray, candidates: int, seed: int) -> dict:
        self.mail.check_open()

        def rows(peer: int, table: str, ids: np.ndarray) -> np.ndarray:
            return answer(self.peers[peer].read_rows(table, ids, self.index), self.peers[peer])

        def dense() -> dict:
            return answer(self.peers[0].read_dense(self.index), self.peers[0])

        return self.device.evaluate(targets, candidates, seed, rows, dense)

    def save(self, path: str) -> dict:
        return self.device.save(path)

    def verify(self, path: str, digests: dict) -> None:
        self.device.verify(path, digests)

    def load(self, path: str, digests: dict, clock: int, dense_steps: int) -> None:
        self.device.load(path, digests, clock, dense_steps)

    def warm_start(self, model: str, rows: dict, dense_steps: int) -> None:
        self.device.warm_start(model, rows, dense_steps)

    def dense_parameters(self) -> tuple[dict, dict, int]:
        return self.device.dense_parameters()

    def traffic(self) -> dict:
        return self.device.traffic()

    def parameters(self) -> dict:
        return self.device.parameters()


def check_plan_matches(data: TrainData | ClickData, plan: ShardingPlan, topology: Topology) -> None:
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


# What a worker holds beside its shard's rows and Adagrad sums, as measured by bench/scale.py on tables of
# 10^5 to 5*10^7 rows and logs of up to 10^9 events (docs/benchmarks.md): its peak stayed within 1.3 x the
# plan's bytes + 1.1 GB, of which 0.56 GB is what importing torch's CUDA build and the engine costs any
# process, + 16 bytes a user of the log (the users' offsets, 8 bytes each, and what loading them takes).
# The examples a trainer holds (its parts of the blocks it reads: up to 150 MB of a sequence log's ids when
# that was measured, GBs for a click log's 40 columns) are counted on top, from the data (held_bytes).
WORKER_SCALE, WORKER_EXTRA_BYTES, WORKER_BYTES_PER_USER = 1.3, 1.1e9, 16


def worker_peak_bytes(shard_bytes, users: int = 0, held: int = 0) -> np.ndarray:
    """The resident memory a worker whose shard holds `shard_bytes` reaches, training a log of `users` users
    and holding `held` bytes of examples (the bound bench/scale.py measures)."""
    extra = WORKER_EXTRA_BYTES + WORKER_BYTES_PER_USER * users + held
    return np.ceil(WORKER_SCALE * np.asarray(shard_bytes, dtype=np.float64) + extra).astype(np.int64)


def check_worker_memory(plan: ShardingPlan, topology: Topology, dim: int, scaled_rows: dict[str, int] | None,
                        workers: dict[str, dict], users: int = 0, held: int = 0) -> np.ndarray:
    """Refuse, before any shard starts, a plan whose device would outgrow the memory limit of the worker that
    would hold it (the scheduler's figure; a worker without a limit takes any): its rows and optimiser state,
    and what a worker holds beside them (worker_peak_bytes). Returns the shard bytes per device."""
    need = plan.memory_bytes_per_device(topology, dim)
    if scaled_rows is not None:  # estimation: device 0 holds the scaled tables, the others nothing
        need = np.zeros(topology.devices, dtype=np.int64)
        need[0] = sum(scaled_rows.values()) * row_bytes(dim)
    peak = worker_peak_bytes(need, users, held)
    for d, (address, info) in enumerate(workers.items()):
        limit = info.get("memory_limit") or 0
        if limit and peak[d] > limit:
            raise InputError(
                f"device {d}'s shard needs {need[d] / 2**30:.2f} GiB for its rows and their Adagrad sums at dim {dim}, "
                f"and its worker about {peak[d] / 2**30:.2f} GiB in all ({WORKER_SCALE} x that + "
                f"{WORKER_EXTRA_BYTES / 1e9:.1f} GB for torch, batches and buffers + {WORKER_BYTES_PER_USER} bytes "
                f"for each of the log's {users:,} users + {held / 2**30:.2f} GiB for the examples a trainer holds, "
                f"as measured by bench/scale.py), "
                f"but its worker {address} may use {limit / 2**30:.2f} GiB; accepted: workers with more memory, a plan "
                f"over more devices, less memory_slack (fewer replicas) or a smaller dim"
            )
    return need


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
        model: ModelConfig | ClickConfig,
        optimizer: OptimizerConfig,
        train: TrainConfig,
        scaled_rows: dict[str, int] | None = None,
    ) -> None:
        self.client, self.topology, self.model, self.train, self.plan = client, topology, model, train, plan
        self.data = load_training_data(dataset, model.features, train.window)
        check_plan_matches(self.data, plan, topology)
        P = topology.devices
        check_batch(train.batch_size, P, self.data.targets)
        info = live_workers(client)
        workers = sorted(info)
        if len(workers) < P:
            raise InputError(f"the plan has {P} devices, the cluster {len(workers)} workers; accepted: >= {P} workers")
        self.need_bytes = check_worker_memory(plan, topology, model.dim, scaled_rows,
                                              {workers[d]: info[workers[d]] for d in range(P)},
                                              users=self.data.offset_users, held=self.data.held_bytes(P))
        resources = {"GPU": 1} if train.device == "cuda" else None
        run = uuid.uuid4().hex[:8]
        # The worker each device lives on, by address and by the worker's unique id: a
        # worker restarted by its nanny comes back as a different id without the shard.
        self.workers = {workers[d]: info[workers[d]]["id"] for d in range(P)}
        self._last_seen: dict[str, dict] = {}  # address -> the scheduler's last word on that worker
        self.actors, self._inflight = [], []  # the running actor calls close() waits for
        self._futures = [
            client.submit(
                DeviceActor,
                d,
                topology,
                plan.for_devices(P),
                str(dataset),
                model,
                optimizer,
                batch_size=train.batch_size,
                dedup=train.dedup,
                array_device=train.device,
                early=train.early_answers,
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
            try:
                self._wait_futures(self._futures)
                self.actors = [f.result() for f in self._futures]
            except (FutureCancelledError, FuturesCancelledError):
                # An actor's worker died while the actor was being made: a lost worker, not a failed run.
                self.check_workers(grace_s=LOSS_GRACE_S)
                raise
            self._wait([a.connect(self.actors) for a in self.actors])
        except BaseException:
            self.close()
            raise
        self.step_count = 0
        self._tag = 0  # numbers every step call, so a failed call's late messages are never taken for the next
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
                    self._lost(d, f"device {d}'s actor is {f.status}: its worker left the cluster, the shard is lost")
            for d, (address, wid) in enumerate(self.workers.items()):
                if now.get(address, {}).get("id") != wid:
                    self._lost(d, f"device {d}'s worker {address} left the cluster; its parameter shard is lost")
                self._last_seen[address] = now[address]
            if time.monotonic() >= deadline:
                return
            time.sleep(POLL_S)

    def _lost(self, device: int, what: str) -> None:
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

    def _wait(self, calls: list) -> list:
        """The results of actor calls, in order; WorkerLost as soon as a device's worker is gone.

        A call to an actor whose worker died may never return, so no wait here is unbounded.
        """
        self._inflight = list(calls)  # what close() waits for if this wait is cut short
        out = [self._result(call) for call in calls]
        self._inflight = []
        return out

    def _result(self, call):
        while True:
            try:
                return call.result(timeout=POLL_S)
            except TimeoutError:
                self.check_workers()
            except OSError:  # the worker could not be reached, or the method's own I/O error
                self.check_workers(grace_s=LOSS_GRACE_S)
                raise

    def _wait_futures(self, futures: list) -> None:
        while True:
            try:
                wait(futures, timeout=POLL_S)
                return
            except TimeoutError:
                self.check_workers()

    def step(self, epoch: int, step_in_epoch: int) -> list[dict]:
        """One synchronous step on every device; per-device stats (loss, examples, seconds per part)."""
        return self.steps(epoch, step_in_epoch, 1)[0]

    def steps(self, epoch: int, first: int, count: int) -> list[list[dict]]:
        """Steps first..first+count-1 of `epoch` in one call per device; per step, per-device stats.

        If a step fails, the steps before it stay applied (and counted) and the error is the
        failing device's own, not a peer's relay of it.
        """
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
            raise next((e for e in errors if not isinstance(e, PeerStopped)), errors[0])
        self.step_count += count
        return [list(per_step) for per_step in zip(*results)]

    def train_epoch(self, epoch: int, max_steps: int | None = None, on_step=None) -> dict:
        """Every step of `epoch` (at most `max_steps` and the config's steps_per_epoch); loss, examples,
        steps, seconds and the time split.

        `on_step(done, steps, loss, examples, seconds)`, if given, hears after every step
        how far the epoch is (the mean loss and the examples so far). The split is the
        slowest device's seconds per part: building the batch, each round (the wait for
        its messages included) and the forward and backward.
        """
        candidates = self.model.candidates
        caps = [c for c in (max_steps, self.train.steps_per_epoch) if c is not None]
        steps = min([self.data.steps_per_epoch(self.train.batch_size), *caps])
        parts: dict[str, float] = {}
        loss = examples = 0.0
        steady = {"steps": 0, "examples": 0, "seconds": 0.0}
        t0 = time.perf_counter()
        i = 0
        while i < steps:
            # The first steps alone (they are the warm-up), then several per call.
            count = 1 if self.step_count < WARMUP_STEPS else min(STEPS_PER_CALL, steps - i)
            ts = time.perf_counter()
            per_step = self.steps(epoch, i, count)
            took = time.perf_counter() - ts
            for stats in per_step:
                i += 1
                loss += sum(x["loss_sum"] for x in stats)
                n = sum(x["examples"] for x in stats)
                examples += n
                for k in stats[0]:
                    if k.endswith("_s"):
                        parts[k[:-2]] = parts.get(k[:-2], 0.0) + max(x[k] for x in stats)
                if self.step_count > WARMUP_STEPS:
                    steady["steps"] += 1
                    steady["examples"] += n
                    steady["seconds"] += took / count
                if on_step is not None:
                    on_step(i, steps, loss / (examples * candidates) if examples else float("nan"), int(examples),
                            time.perf_counter() - t0)
        return {
            "epoch": epoch,
            "steps": steps,
            "examples": int(examples),
            "loss": loss / (examples * candidates) if examples else float("nan"),
            "seconds": time.perf_counter() - t0,
            "parts": parts,
            "steady": steady,
        }

    def fit(self, start_epoch: int = 0) -> TrainResult:
        result = TrainResult()
        parts: dict[str, float] = {}
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
                parts[k] = parts.get(k, 0.0) + v
            for k, v in e["steady"].items():
                result.steady[k] += v
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
                "model": config_record(self.model),
                "batch_size": self.train.batch_size,
                "seed": self.train.seed,
            }, digests)

    def restore(self, path: str | Path) -> dict:
        """Load every shard from the complete checkpoint at `path`; its manifest."""
        m = read_checkpoint(path, CHECKPOINT)
        mine, theirs = config_record(self.model), read_record(m["model"])
        if theirs != mine or m["devices"] != self.topology.devices:
            raise InputError(
                f"{path}: checkpoint of model {theirs} on {m['devices']} devices; accepted: model {mine} "
                f"on {self.topology.devices} devices (the run's configuration)"
            )
        # Every shard's arrays verified before any is read in place: a damaged checkpoint changes nothing.
        self._wait([a.verify(str(path), m["arrays"]) for a in self.actors])
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
        mine, theirs = config_record(self.model), read_record(manifest["model"])
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

        Device d writes chunks d, d + P, d + 2P, ... of every table: it reads the rows it
        homes itself and asks the other homes for theirs, the next chunk's while it writes
        this one; no process holds more than two chunks of a table. Built beside `out` and
        swapped in when its manifest is written.
        """
        with staged(Path(out), overwrite=True) as stage:
            create_export(stage, {t.name: t.rows for t in self.plan.tables}, self.model.dim)
            P = len(self.actors)
            step = P * EXPORT_CHUNK_ROWS
            calls = [a.write_export(str(stage), t.name, list(range(d * EXPORT_CHUNK_ROWS, t.rows, step)),
                                    EXPORT_CHUNK_ROWS)
                     for t in self.plan.tables for d, a in enumerate(self.actors)]
            digests = {k: v for part in self._wait(calls) for k, v in part.items()}
            dense, dense_state, dense_steps = self._wait([self.actors[0].dense_parameters()])[0]
            digests.update(write_arrays(stage / "dense", dense, "dense"))
            digests.update(write_arrays(stage / "dense_opt", dense_state, "dense_opt"))
            manifest = finish(stage, EXPORT, {
                **info,
                "tables": {t.name: t.rows for t in self.plan.tables},
                "dim": self.model.dim,
                "model": config_record(self.model),
                "chunk_rows": EXPORT_CHUNK_ROWS,
                "dense_steps": dense_steps,
            }, digests)
        self.downloads += 1
        return manifest

    def evaluate(self) -> dict:
        """The model's metrics on a seeded sample of eval_users held-out examples: leave-last-out AUC (one
        sampled negative) and HR@10 (among eval_candidates) for sequences, AUC and log-loss for click logs."""
        targets = eval_targets(self.data, self.train.eval_users, self.train.seed)
        parts = self.data.sub_batches(targets, len(self.actors))  # each device's in the parts it reads
        seed = negative_seed(self.train.seed, -1)
        calls = [a.evaluate(p, self.train.eval_candidates, seed) for a, p in zip(self.actors, parts)]
        return self.data.eval_metrics(self.data.eval_merge(self._wait(calls)))

    def traffic(self) -> dict[str, np.ndarray]:
        """Bytes per kind, [sender, receiver], summed over every shard since the start."""
        per = self._all("traffic")
        return {k: sum(p[k] for p in per) for k in TRAFFIC_KINDS}

    def parameters(self) -> list[dict]:
        return self._all("parameters")

    def close(self) -> None:
        """Release every shard. Each device is stopped first and its actor's thread drained, at most
        CLOSE_WAIT_S: a shard released while a peer still sends to it (a call an interrupt left running,
        or one it cut off before it was counted as running) would make that peer's worker log a KeyError."""
        actors, inflight, self.actors, self._inflight = self.actors, self._inflight, [], []
        if self.client.status == "running":
            live = [a for a, f in zip(actors, self._futures) if f.status == "finished"]
            if live:
                self._stop_and_wait(live, inflight)
            if self._futures:  # a closed client's scheduler holds nothing
                self.client.cancel(self._futures)
        self._futures = []

    def _stop_and_wait(self, actors: list, inflight: list) -> None:
        """Stop every device (a call that reaches one later ends before sending anything), then wait for
        the calls known to run and for each actor's thread to finish whatever was queued on it."""
        deadline = time.monotonic() + CLOSE_WAIT_S
        self._until(deadline, self._each(actors, "stop"))
        self._until(deadline, inflight + self._each(actors, "settled"))

    @staticmethod
    def _each(actors: list, method: str) -> list:
        calls = []
        for a in actors:
            try:
                calls.append(getattr(a, method)())
            except Exception:  # an actor known lost: nothing runs there
                pass
        return calls

    @staticmethod
    def _until(deadline: float, calls: list) -> None:
        for call in calls:
            while time.monotonic() < deadline:
                try:
                    call.result(timeout=PROBE_S)
                    break
                except TimeoutError:
                    continue
                except Exception:  # stopped (EngineClosing), failed or lost: it is over either way
                    break

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
