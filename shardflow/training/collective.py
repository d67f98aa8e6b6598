"""The collective transport: a step's round messages go between the devices' workers over a torch.distributed
gloo process group, not through Dask actor calls.

Dask still places one device per worker, starts, watches and restarts them and carries
every call outside a step (evaluation, exports, checkpoints, metrics); only the messages
of the protocol's rounds (shardflow.training.protocol) take this path. The engine forms
the group once its actors exist: device 0 opens the rendezvous (a TCPStore on a socket
bound to its worker's own host, so a local cluster listens on loopback only), every
device joins it, and gloo connects every pair over the workers' host addresses. A device
with no peers forms no group and exchanges nothing.

Each pair of devices has one ordered stream per round (the gloo tag is the round's
number): a message is its pickled bytes behind their length. The rounds of a plan are the
same on every device, so each stream carries one message per step, in step order. A gloo
send leaves only once its receiver has posted a receive for it, so a device posts a
stream's next receive as it takes a message: a message sent before its receiver waits for
it (the next step's requests, a faster peer's rows) is in already, not a round trip of the
two devices' gloo loops away. That receive holds as many bytes as the stream's largest
message so far (`Stream`: at least FIRST_BYTES, at most POSTED_BYTES; a gloo receive takes
fewer bytes than its buffer holds), which both ends know, so the sender sends what fits in
one piece and only the rest of a longer message in a second, which leaves once the
receiver waits for it.

Waits are bounded as the actor transport's are (shardflow.training.transport): a gloo
wait cannot be interrupted, so it runs on the link's own waiter thread while the
device's thread watches for the engine closing and, every PROBE_S, asks the peer's actor
whether it still exists. A peer whose process ends closes its sockets and the wait fails
at once (WorkerLost).

A step that fails leaves the streams out of step (its error messages are sent on every
round's stream to every peer and never all received), so the engine forms a new group
(`Link.generation`) before the next call; a restore makes new actors and a new group.
"""

from __future__ import annotations

import datetime
import io
import pickle
import queue
import socket
import struct
import threading
import time
from typing import Any

import torch
from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore

from shardflow.errors import WorkerLost
from shardflow.training.messages import Message, Round
from shardflow.training.transport import PEER_TIMEOUT_S, PROBE_S, EngineClosing, probe

TAGS = {r: i for i, r in enumerate(Round)}
LENGTH = struct.Struct("<q")  # a message's first bytes: the length of its pickled bytes
# A stream's first message's first piece, its length included: one send and one receive carry a round's usual
# message (the MovieLens DLRM's 9 tables on 2 devices: 40-90 kB). A separate length message cost one more wait on
# the peer: a 70 kB round trip between two processes took 1.14-1.25 ms that way, 0.71-0.72 ms in one piece.
FIRST_BYTES = 1 << 18
# The most a stream's posted receive holds (each stream has one posted): a longer message's rest leaves only once
# its receiver waits for it. Up to this size a message travels whole while its receiver still computes: the bundled
# log's 1.5 MB replies and gradients on 2 devices, each in two pieces, kept each device waiting 3.4-5.0 ms a step
# (means) per round for messages sent milliseconds before; posted whole, 1.5-3.5 ms.
POSTED_BYTES = 1 << 24
RENDEZVOUS_TIMEOUT_S = 120.0  # how long joining waits for every device to join


class Stream:
    """How many bytes a stream's next posted receive holds: the largest message the stream has carried, to the
    next power of two, within [FIRST_BYTES, POSTED_BYTES]. Its sender and its receiver each keep one and see the
    same messages, so they agree on every piece's length without a word about it."""

    def __init__(self) -> None:
        self.posted = FIRST_BYTES

    def carried(self, length: int) -> None:
        """A message of `length` bytes (its length's own bytes included) went through."""
        if length > self.posted:
            self.posted = min(POSTED_BYTES, 1 << (length - 1).bit_length())


def open_rendezvous(host: str) -> tuple[TCPStore, int]:
    """The store every device of a group meets at, listening on `host` only (not every interface); its port."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.bind((host, 0))
    listener.listen(128)
    port = listener.getsockname()[1]
    store = TCPStore(host, port, None, True, datetime.timedelta(seconds=RENDEZVOUS_TIMEOUT_S),
                     wait_for_workers=False, master_listen_fd=listener.detach())
    return store, port


class _Waiter:
    """A thread that waits on gloo works in turn (a gloo wait cannot be interrupted, nor retried after a
    timeout), so the device's own thread can watch the engine and the peers meanwhile."""

    def __init__(self, name: str) -> None:
        self._todo: queue.Queue[tuple[Any, threading.Event | None, list[Exception]]] = queue.Queue()
        self._closed = False
        self._pending = 0  # works submitted and not yet ended
        self._ended = threading.Condition()
        threading.Thread(target=self._run, name=f"shardflow-collective-{name}", daemon=True).start()

    def _run(self) -> None:
        while True:
            work, done, failed = self._todo.get()
            if work is None or self._closed:  # closed: what is left would never end (its group is left)
                return
            try:
                work.wait()
            except Exception as e:  # gloo: the peer closed the connection, or the group's timeout passed
                failed.append(e)
            if done is not None:
                done.set()
            with self._ended:
                self._pending -= 1
                self._ended.notify_all()

    def submit(self, work: Any, done: threading.Event | None = None) -> list[Exception]:
        """Wait for `work` after those before it; `done` is set once it ended; the list holds its error."""
        failed: list[Exception] = []
        with self._ended:
            self._pending += 1
        self._todo.put((work, done, failed))
        return failed

    def ended(self, timeout_s: float) -> bool:
        """Whether every work submitted has ended, waiting up to `timeout_s` for it."""
        with self._ended:
            return self._ended.wait_for(lambda: self._pending == 0, timeout_s)

    def close(self) -> None:
        self._closed = True
        self._todo.put((None, None, []))


class Link:
    """One device's end of a group: sends and receives the rounds' messages; see the module's description."""

    def __init__(self, rank: int, world: int, own_host: str, store_host: str, port: int, generation: int,
                 timeout_s: float = PEER_TIMEOUT_S) -> None:
        store = TCPStore(store_host, port, None, False, datetime.timedelta(seconds=RENDEZVOUS_TIMEOUT_S))
        # torch's stubs name the options class `Options` and give the gloo group no send or recv; at run time
        # the class is `_Options` and the group has both.
        options = ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        options._timeout = datetime.timedelta(seconds=timeout_s)
        options._devices = [ProcessGroupGloo.create_device(hostname=own_host)]
        self.group: Any = ProcessGroupGloo(PrefixStore(f"group-{generation}", store), rank, world, options)
        self._store = store
        self.rank, self.generation, self.timeout_s = rank, generation, timeout_s
        self._receiving = _Waiter("receive")  # the device's thread waits while it waits
        self._sending = _Waiter("send")  # in the background: a send ends once its peer takes it
        self._wake = threading.Event()
        self.stopped = False
        self.broken = False  # a wait was given up: the streams are out of step, the group must be formed again
        self._posted: dict[tuple[int, int], tuple[torch.Tensor, Any]] = {}  # (peer, tag) -> its next receive
        self._out: dict[tuple[int, int], Stream] = {}  # (peer, tag): the streams this device sends on
        self._in: dict[tuple[int, int], Stream] = {}  # and those it receives on

    def send(self, peer: int, message: Message) -> None:
        buffer = io.BytesIO()
        buffer.write(bytes(LENGTH.size))
        pickle.dump(message, buffer, protocol=pickle.HIGHEST_PROTOCOL)
        view = buffer.getbuffer()
        LENGTH.pack_into(view, 0, len(view) - LENGTH.size)
        data = torch.frombuffer(view, dtype=torch.uint8)
        tag = TAGS[message.round]
        stream = self._out.setdefault((peer, tag), Stream())
        for piece in (data[: stream.posted], data[stream.posted :]):
            if piece.numel():
                self._sending.submit(SendWork(self.group.send([piece], peer, tag), (data, view, buffer)))
        stream.carried(len(view))

    def receive(self, peer: int, round: Round, actor: Any) -> Message:
        """The next message of `round`'s stream from `peer` (whose Dask actor is `actor`)."""
        tag = TAGS[round]
        posted = self._posted.pop((peer, tag), None)
        first, work = posted if posted is not None else self._post(peer, tag)
        self._wait(work, peer, actor)
        end = LENGTH.size + LENGTH.unpack_from(first.numpy().data)[0]
        data, rest, held = first, None, first.numel()
        if end > held:
            data = torch.empty(end, dtype=torch.uint8)
            data[:held] = first
            rest = self.group.recv([data[held:]], peer, tag)
        self._in[(peer, tag)].carried(end)
        # gloo matches a stream's receives in the order they are posted: this message's rest first, then the next.
        try:
            self._posted[(peer, tag)] = self._post(peer, tag)
        except RuntimeError:  # the peer's connection closed after its message (a failed peer's last word): the
            pass  # message is still given back; the stream's next receive, posted then, meets the closed connection
        if rest is not None:
            self._wait(rest, peer, actor)
        message: Message = pickle.loads(data.numpy()[LENGTH.size : end].data)
        return message

    def sent(self, timeout_s: float) -> bool:
        """Whether every message sent so far has left this device (its peer took it in), waiting up to
        `timeout_s`."""
        return self._sending.ended(timeout_s)

    def _post(self, peer: int, tag: int) -> tuple[torch.Tensor, Any]:
        """A receive of the first piece of the stream's next message, posted now: its buffer and its work."""
        first = torch.empty(self._in.setdefault((peer, tag), Stream()).posted, dtype=torch.uint8)
        return first, self.group.recv([first], peer, tag)

    def _wait(self, work: Any, peer: int, actor: Any) -> None:
        if self.broken:
            raise WorkerLost("the devices' group was left out of step by a failed step; it is formed again first")
        done = self._wake = threading.Event()
        failed = self._receiving.submit(work, done)
        deadline = time.monotonic() + self.timeout_s
        while not done.wait(PROBE_S):
            if self.stopped:
                break
            self._unless_probe_fails(actor)
            if time.monotonic() > deadline:
                self.broken = True
                raise WorkerLost(f"no message from device {peer} in {self.timeout_s:.0f} s")
        if self.stopped:
            self.broken = True
            raise EngineClosing("the engine is closing: the step stopped here")
        if failed:
            self.broken = True
            raise WorkerLost(f"device {peer}'s connection failed ({failed[0]})")

    def _unless_probe_fails(self, actor: Any) -> None:
        try:
            probe(actor)
        except WorkerLost:
            self.broken = True
            raise

    def stop(self) -> None:
        """The engine is closing: a wait now or later ends with EngineClosing (from any thread)."""
        self.stopped = True
        self._wake.set()

    def close(self) -> None:
        self.stop()
        self._receiving.close()
        self._sending.close()


class SendWork:
    """A send under way and what it reads (kept alive until the send ends)."""

    def __init__(self, work: Any, holds: object) -> None:
        self.work, self.holds = work, holds

    def wait(self) -> None:
        self.work.wait()
