"""The Dask actor that hosts one device: it loads the device's training data, carries its messages to and
from its peers and answers their reads.

Device d runs on the d-th worker (workers sorted by address). For each engine call a
device runs one or more steps (StepCall); inside it the devices exchange the protocol's
rounds directly, one message per peer per round (shardflow.training.protocol): by calls
to the peers' actors (transport `actor`: shardflow.training.transport), or over the
devices' gloo group (transport `collective`: shardflow.training.collective). Reads
outside a step (evaluation, exports) are actor calls either way.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np
from distributed import get_worker
from distributed.comm.addressing import get_address_host
from torch.distributed import TCPStore

from shardflow.data.clicks import load_training_data
from shardflow.errors import TrainingError, WorkerLost
from shardflow.model.configs import ClickConfig, ModelConfig, OptimizerConfig
from shardflow.model.metrics import Scored
from shardflow.model.optim import row_state_shape
from shardflow.model.ranking import CatalogRanks, UsersToRank
from shardflow.planner.sharding_plan import DevicePlan
from shardflow.planner.topology import Topology
from shardflow.training.collective import Link, open_rendezvous
from shardflow.training.device import Arrays, Built, Device, Digests, StepStats
from shardflow.training.messages import Message, Round, Traffic
from shardflow.training.transport import Mailbox, answer
from storage.checkpoint import write_export_chunk


class DeviceActor:
    """The Dask actor of one device: loads the training data, carries a Device and its messages."""

    alive = True  # an attribute, not a method: reading it remotely fails at once if the actor is gone

    def __init__(self, device: int, topology: Topology, tables: dict[str, DevicePlan], dataset: str,
                 config: ModelConfig | ClickConfig, optimizer: OptimizerConfig, *, batch_size: int, dedup: str,
                 array_device: str = "cpu", scaled_rows: dict[str, int] | None = None,
                 window: tuple[int, int] = (0, 0), early: bool = False, validation: bool = False,
                 build_ahead: bool = False) -> None:
        data = load_training_data(dataset, config.features, window, validation=validation)
        self.device = Device(device, topology, tables, data, config, optimizer, batch_size=batch_size, dedup=dedup,
                             array_device=array_device, scaled_rows=scaled_rows, early=early)
        self.index, self.row_state = device, row_state_shape(optimizer.rows, config.dim)
        self.peers: list[Any] = []  # every device's actor handle, this one's included
        self.mail = Mailbox()
        self.link: Link | None = None  # the devices' gloo group (transport collective, several devices)
        self._rendezvous: tuple[TCPStore, int] | None = None  # device 0: the store the group meets at
        self._stepping = False  # inside a call to steps (the actor's thread writes the shard)
        self.build_ahead = build_ahead  # the next step's batch built on a thread of its own (Building)

    def connect(self, peers: list[Any]) -> int:
        self.peers = peers
        return self.index

    @staticmethod
    def _host() -> str:
        return get_address_host(get_worker().address)

    def open_rendezvous(self) -> tuple[str, int]:
        """(Device 0) open the store the devices' group meets at, on this worker's host: (host, port)."""
        if self._rendezvous is None:
            self._rendezvous = open_rendezvous(self._host())
        return self._host(), self._rendezvous[1]

    def join(self, host: str, port: int, generation: int) -> None:
        """Join the devices' gloo group `generation` at the store on host:port, leaving the one before."""
        if self.link is not None:
            self.link.close()
        self.link = None
        self.link = Link(self.index, len(self.peers), self._host(), host, port, generation)

    # -- on the worker's event loop: messages and reads from other devices ----------------
    async def deliver(self, tag: int, message: Message) -> None:
        self.mail.put(tag, message)

    async def stop(self) -> None:
        """On the event loop, so it runs while the actor's thread is inside a step: that step ends at its next
        wait and sends no more messages of its own."""
        self.mail.stop()
        if self.link is not None:  # its waits end at their next wake-up; its threads once their waits end
            self.link.close()

    def settled(self) -> None:
        """Returns once every call queued before it on the actor's thread (one thread per worker) has ended."""

    async def read_rows(self, table: str, ids: np.ndarray, sender: int) -> np.ndarray:
        self._check_not_stepping("read_rows")
        return self.device.serve_rows(table, ids, sender)

    async def read_dense(self, sender: int) -> Arrays:
        self._check_not_stepping("read_dense")
        return self.device.serve_dense(sender)

    async def export_rows(self, table: str, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        self._check_not_stepping("export_rows")
        return self.device.export_rows(table, ids)

    def _check_not_stepping(self, read: str) -> None:
        """The threading rule (shardflow.training.transport): rows are read for a peer only between steps."""
        if self._stepping:
            raise TrainingError(f"device {self.index}: {read} while a step updates the shard (the engine makes "
                                "one kind of call at a time)")

    # -- on the actor's thread -------------------------------------------------------------
    def steps(self, tag: int, epoch: int, first: int, count: int, step: int, seed: int) -> list[StepStats]:
        """Steps first..first+count-1 of `epoch` (global step numbers from `step`): every round's messages out
        to the peers, theirs in; this device's stats of each step (StepCall)."""
        self.mail.check_open()
        self.mail.forget_before(tag)
        self._stepping = True
        try:
            return StepCall(self, tag, epoch, first, step, seed).run(count)
        finally:
            self._stepping = False

    def clock(self) -> int:
        return self.device.clock

    def write_export(self, store: str, table: str, starts: list[int], chunk_rows: int) -> dict[str, str]:
        """Write chunks `starts` of `table`'s export (this device's share; no other writer touches them):
        rows and Adagrad sums from their homes, its own read directly, the next chunk's requested from
        the other homes while this one is written. {array chunk name: digest}."""
        self.mail.check_open()
        plan = self.device.table_plan(table)
        rows_total = plan.rows

        def request(start: int) -> tuple[int, np.ndarray, np.ndarray, list[tuple[np.ndarray, int, Any]]]:
            ids = np.arange(start, min(start + chunk_rows, rows_total), dtype=np.int64)
            home = plan.home_of(ids)
            calls = [(home == d, d, self.peers[d].export_rows(table, ids[home == d]))
                     for d in np.unique(home).tolist() if d != self.index]
            return start, ids, home, calls

        digests: dict[str, str] = {}
        upcoming = request(starts[0]) if starts else None
        for i in range(len(starts)):
            assert upcoming is not None  # one request per start
            start, ids, home, calls = upcoming
            upcoming = request(starts[i + 1]) if i + 1 < len(starts) else None
            rows = np.empty((ids.size, self.device.config.dim), dtype=np.float32)
            state = np.empty((ids.size, *self.row_state), dtype=np.float32)
            mine = home == self.index
            if mine.any():
                rows[mine], state[mine] = self.device.export_rows(table, ids[mine])
            for sel, d, call in calls:
                rows[sel], state[sel] = answer(call, self.peers[d])
            digests.update(write_export_chunk(store, table, start, rows, state))
        return digests

    def evaluate(self, targets: np.ndarray, negatives: int, seed: int) -> Scored:
        self.mail.check_open()
        return self.device.evaluate(targets, negatives, seed, self._remote_rows, self._remote_dense)

    def users_to_rank(self, targets: np.ndarray, include_seen: bool) -> tuple[UsersToRank, np.ndarray]:
        self.mail.check_open()
        return self.device.users_to_rank(targets, include_seen, self._remote_rows, self._remote_dense)

    def rank_home(self, users: UsersToRank) -> CatalogRanks:
        self.mail.check_open()
        return self.device.rank_home(users, self._remote_dense)

    def _remote_rows(self, peer: int, table: str, ids: np.ndarray) -> np.ndarray:
        return answer(self.peers[peer].read_rows(table, ids, self.index), self.peers[peer])

    def _remote_dense(self) -> Arrays:
        return answer(self.peers[0].read_dense(self.index), self.peers[0])

    def save(self, path: str) -> dict[str, Any]:
        return self.device.save(path)

    def verify(self, path: str, digests: Digests, shard: int) -> None:
        self.device.verify(path, digests, shard)

    def restore(self, path: str, digests: Digests, shards_before: int, clock: int, dense_steps: int) -> bool:
        return self.device.restore(path, digests, shards_before, clock, dense_steps)

    def warm_start(self, model: str, rows: dict[str, int], dense_steps: int) -> None:
        self.device.warm_start(model, rows, dense_steps)

    def dense_parameters(self) -> tuple[Arrays, Arrays, int]:
        return self.device.dense_parameters()

    def traffic(self) -> Traffic:
        return self.device.traffic()

    def parameters(self) -> dict[str, Any]:
        return self.device.parameters()


class StepCall:
    """One engine call to `steps` on one device: its steps in order, each step's rounds, and the deliveries still
    in flight.

    While it waits for the peers' gradients, the device builds the next step's batch and
    sends its requests: batch building and the first round of a step overlap the step before.
    With early answers (protocol.py: PREFETCH) it does so at its first wait instead, and
    answers the peers' requests for their next step whenever it waits. With build_ahead the
    next step's batch is built on a thread of its own from the start of this step (Building),
    and only its requests are made then.
    """

    def __init__(self, actor: DeviceActor, tag: int, epoch: int, first: int, step: int, seed: int) -> None:
        self.actor, self.device, self.tag = actor, actor.device, tag
        self.epoch, self.first, self.step, self.seed = epoch, first, step, seed
        self.peers = {d: a for d, a in enumerate(actor.peers) if d != actor.index}
        self.link = actor.link if self.peers else None  # transport collective: the devices' group
        self.sent: list[tuple[int, Any]] = []  # [(peer, delivery call)] not yet acknowledged
        self.ahead: int | None = None  # the step (of this call) whose requests are out already
        self.deferred: BaseException | None = None  # the error of preparing it
        self.current = step  # the global step running
        self.building: tuple[int, Building] | None = None  # build_ahead: (k, step k's batch being built)

    def run(self, count: int) -> list[StepStats]:
        stats = []
        try:
            for k in range(count):
                stats.append(self._one(k, count))
                self._acknowledged()
        except BaseException as e:
            if self.building is not None:  # its thread reads the data: it ends before anything else may
                self.building[1].wait()
            self._fail(e)
            raise
        for peer, call in self.sent:
            answer(call, self.actor.peers[peer])
        return stats

    def _one(self, k: int, count: int) -> StepStats:
        """Step k of this call: its requests (unless out already), then every round in order."""
        device = self.device
        self.current = self.step + k
        if self.deferred is not None:  # preparing this step failed: it fails now, the one before is applied
            raise self.deferred
        out = device.start(self.epoch, self.first + k, self.step + k, self.seed)
        if self.ahead != k:
            self.sent += self._send(out)
        more = k + 1 < count
        if self.actor.build_ahead and more:
            self.building = (k + 1, Building(device.build, self.epoch, self.first + k + 1, self.seed))
        for round in device.rounds:
            if round is Round.GRADIENTS:  # while the peers compute (with early answers, at any wait)
                self._prepare(k + 1, count)
            work = (self._answer_early, lambda: self._prepare(k + 1, count)) if device.early and more \
                else (None, None)
            linked = {d: self.peers[d] for d in device.round_peers[round]}
            inbox = self._wait(self.step + k, round, linked, work)
            if round is Round.REPLY:  # a patch goes with the sender's early answer
                patched = {m.sender: self.peers[m.sender] for m in inbox if m.patch}
                for m in self.actor.mail.wait(self.tag, self.step + k, Round.PREFETCH, patched) if patched else []:
                    device.take_early(m)
            out = device.receive(round, inbox)
            if out:
                self.sent += self._send(out)
        return device.finish()

    def _wait(self, step: int, round: Round, linked: dict[int, Any],
              work: tuple[Callable[[list[Message]], None] | None, Callable[[], bool] | None]) -> list[Message]:
        """The round's message of `step` from each of `linked` ({device: actor}), in device order; with
        the collective transport, up to the first that carries a peer's error."""
        if self.link is None:
            return self.actor.mail.wait(self.tag, step, round, linked, *work)
        inbox = []
        for d in sorted(linked):
            m = self.link.receive(d, round, linked[d])
            inbox.append(m)
            if m.error is not None:
                break
            if m.step != step:
                raise TrainingError(f"device {self.actor.index}: device {d}'s {round.value} message is of step "
                                    f"{m.step}, not {step}; the devices' group is out of step")
        return inbox

    def _prepare(self, k: int, count: int) -> bool:
        """Prepare step k and send its requests, if that is still to do; whether it did."""
        if k >= count or self.ahead == k or self.deferred is not None:
            return False
        try:
            built = None
            if self.building is not None and self.building[0] == k:
                building, self.building = self.building[1], None
                built = building.result()
            self.sent += self._send(self.device.prepare(self.epoch, self.first + k, self.step + k, self.seed,
                                                        built))
            self.ahead = k
        except Exception as e:  # this step's messages are out: finish it, fail the next
            self.deferred = e
        return True

    def _answer_early(self, requests: list[Message]) -> None:
        """The peers' requests of the next step, answered while this one waits."""
        self.sent.extend((m.sender, self.actor.peers[m.sender].deliver(self.tag, self.device.answer_early(m)))
                         for m in requests)

    def _send(self, out: dict[int, Message]) -> list[tuple[int, Any]]:
        """Deliver each of `out`'s messages to its peer: [(peer, the delivery's call)] (none with the collective
        transport: its sends end in the background)."""
        if self.link is not None:
            for peer, m in out.items():
                self.link.send(peer, m)
            return []
        return [(peer, self.actor.peers[peer].deliver(self.tag, m)) for peer, m in out.items()]

    def _acknowledged(self) -> None:
        """Keep only the deliveries not yet acknowledged; raises a delivery's error."""
        left = []
        for peer, call in self.sent:
            if call.done():
                call.result()
            else:
                left.append((peer, call))
        self.sent = left

    def _fail(self, e: BaseException) -> None:
        """Abort the step; unless a peer is lost, tell every peer (whatever round it waits for now: of this step,
        or the next one's requests if this device failed while preparing it), then drain the deliveries."""
        self.device.abort()
        index, peers = self.actor.index, self.actor.peers
        waits = [(self.current, r) for r in self.device.rounds] + [(self.current + 1, Round.REQUEST)]
        if self.link is not None:  # its streams are out of step now: the engine forms the group again
            self.link.broken = True
            for s, r in waits:  # a peer waiting on one of this device's streams stops at once
                for p in self.peers:
                    self.link.send(p, Message(r, s, index, error=str(e)))
            return
        if not isinstance(e, WorkerLost):
            self.sent += [(p, peers[p].deliver(self.tag, Message(r, s, index, error=str(e))))
                          for s, r in waits for p in self.peers]
        for peer, call in self.sent:
            try:
                answer(call, peers[peer])
            except Exception:  # the step failed already; its first error is the one to report
                pass


class Building:
    """A step's batch (Device.build) built on a thread of its own: on a GPU device the host would otherwise
    build it only once the GPU's work of the step before is done (docs/training.md: building ahead)."""

    def __init__(self, build: Callable[..., Built], *args: int) -> None:
        self._built: Built | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(build, args), name="shardflow-build", daemon=True)
        self._thread.start()

    def _run(self, build: Callable[..., Built], args: tuple[int, ...]) -> None:
        try:
            self._built = build(*args)
        except BaseException as e:  # raised on the device's thread, by result()
            self._error = e

    def wait(self) -> None:
        self._thread.join()

    def result(self) -> Built:
        self.wait()
        if self._error is not None:
            raise self._error
        assert self._built is not None  # _run sets one of the two
        return self._built
