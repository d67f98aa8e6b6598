"""Where a run's wall time went: its stages, booked one after another, so that they add up to the run."""

from __future__ import annotations

import time
from collections.abc import Callable


class StageClock:
    """Each `done(name)` books the time since the previous mark (or since the clock was made) to `name`; a name
    booked twice adds up. Nothing between two marks goes unbooked, so the stages add up to the time from the
    clock's start to its last mark, plus what `book` adds from before it (a start-up measured elsewhere).

    `between`, if given, is called at every mark, before the next stage starts (a run's stop check)."""

    def __init__(self, between: Callable[[], None] | None = None) -> None:
        self._last = time.monotonic()
        self._between = between
        self.seconds: dict[str, float] = {}

    def book(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + max(seconds, 0.0)

    def done(self, name: str) -> None:
        now = time.monotonic()
        self.book(name, now - self._last)
        self._last = now
        if self._between is not None:
            self._between()
