"""All devices of a step in one process, round by round: the tests' driver, and `shardflow train`'s without a
cluster (training.run.in_process)."""

from __future__ import annotations

from collections.abc import Callable

from shardflow.training.device import Device, StepStats
from shardflow.training.messages import Message, Round


class InProcess:
    """Runs the protocol of every device in this process, round by round: the tests' cluster-free driver.

    `devices` are objects with `start(...) -> outbox` and `receive(round, inbox)` (a
    shardflow.training.device.Device); their messages go straight from outbox to inbox.
    """

    def __init__(self, devices: list[Device]) -> None:
        self.devices = devices

    def step(self, *start_args: int) -> list[StepStats]:
        """One step on every device (`start_args` go to each device's `start`); each device's StepStats."""
        return self.run([start_args])[0]

    def run(self, starts: list[tuple[int, ...]],
            early_at: Callable[[int], Round | None] = lambda i: Round.GRADIENTS) -> list[list[StepStats]]:
        """Consecutive steps (`starts[i]` go to each device's `start` and `prepare`) as the engine runs
        them: once step i's rows are in, every device prepares step i+1 and sends its requests, and
        the homes answer them early just before the messages of round `early_at(i)` of step i are
        handled (None, or a round the step does not have: once step i has ended). Per step, each
        device's stats."""
        stats = []
        try:
            for i, args in enumerate(starts):
                outboxes, asked, at = [d.start(*args) for d in self.devices], None, early_at(i)
                for round in self.devices[0].rounds:
                    if asked is not None and round is at:
                        self._answer_early(asked)
                        asked = None
                    inboxes = [[out[r] for out in outboxes if r in out] for r in range(len(self.devices))]
                    outboxes = [d.receive(round, inbox) for d, inbox in zip(self.devices, inboxes, strict=True)]
                    if round is Round.REPLY and i + 1 < len(starts):
                        epoch, step_in_epoch, step, seed = starts[i + 1]
                        asked = [d.prepare(epoch, step_in_epoch, step, seed) for d in self.devices]
                if asked is not None:
                    self._answer_early(asked)
                stats.append([d.finish() for d in self.devices])
        except BaseException:
            for d in self.devices:
                d.abort()
            raise
        return stats

    def _answer_early(self, outboxes: list[dict[int, Message]]) -> None:
        for sender, out in enumerate(outboxes):
            for home, request in out.items():
                if self.devices[home].early:
                    self.devices[sender].take_early(self.devices[home].answer_early(request))
