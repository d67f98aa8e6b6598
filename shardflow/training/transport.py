"""How the devices' messages travel: a device's mailbox, and waits on peers that may be gone.

Each device is a Dask actor (shardflow.training.actor). A peer's message arrives on the
worker's event loop and is filed in the receiving device's Mailbox; the device's step,
on the actor's thread, takes it from there. Every wait on a peer is bounded: a peer
that has not answered for PROBE_S is asked whether it still exists.

The threading rule: each device has two threads, the actor's (its calls: steps,
evaluate, export, save, load) and the worker's event loop (peers' deliveries and
reads). The Mailbox is the only state both write, under its lock. The event loop's
reads of a device's rows for a peer (`read_rows`, `read_dense`, `export_rows`) come
only while evaluate or export runs, never while a call to `steps` is updating the
shard: the engine makes one kind of call at a time, and DeviceActor checks it (a read
during steps is refused with a TrainingError).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from shardflow.errors import TrainingError, WorkerLost
from shardflow.training.messages import Message, Round

# A peer that has not answered for PROBE_S is asked whether it still exists: a call to an
# actor released meanwhile (its run ended or died) never returns in distributed 2026.8,
# and the waiting thread must not stay blocked (the worker's next actor would queue
# behind it). PEER_TIMEOUT_S bounds the wait even for a peer that exists but is stuck.
PROBE_S = 1.0
CLOSE_WAIT_S = 10.0  # how long closing waits for the devices' running calls to stop
PEER_TIMEOUT_S = 300.0


def probe(peer: Any) -> None:
    try:
        _ = peer.alive  # an attribute read is a round trip to the actor
    except Exception as e:  # KeyError (actor released), OSError (worker gone), RuntimeError (lost)
        raise WorkerLost(f"a peer device is gone ({type(e).__name__}: {e})") from None


def answer(call: Any, peer: Any) -> Any:
    """The result of `call` to the actor `peer`; WorkerLost once the peer is gone or silent too long."""
    deadline = time.monotonic() + PEER_TIMEOUT_S
    while True:
        try:
            return call.result(timeout=PROBE_S)
        except TimeoutError:
            probe(peer)
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

    def wait(self, tag: int, step: int, round: Round, peers: dict[int, Any],
             early: Callable[[list[Message]], object] | None = None,
             idle: Callable[[], bool] | None = None) -> list[Message]:
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
                if asked and early is not None:
                    self._answered.update((tag, step + 1, m.sender) for m in asked)
                    self._unlocked(early, asked)
                    continue
                if idle is not None and self._unlocked(idle):
                    continue
                if not self._ready.wait(timeout=PROBE_S):
                    missing = set(peers) - {m.sender for m in got}
                    for d in sorted(missing):
                        self._unlocked(probe, peers[d])
                    if time.monotonic() > deadline:
                        raise WorkerLost(f"no {round.value} message from devices {sorted(missing)} in "
                                         f"{PEER_TIMEOUT_S:.0f} s")

    def _unlocked(self, work: Callable[..., Any], *args: Any) -> Any:
        """work(*args) with the mailbox open to deliveries meanwhile (it reads rows, or asks a peer); its result."""
        self._ready.release()
        try:
            return work(*args)
        finally:
            self._ready.acquire()
