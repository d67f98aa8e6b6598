"""A version's training window: the training targets from one part of the log on.

Each night's version trains on the parts since the window's first (a warm start saw the
ones before). A user's held-out events belong to the window in which the user's next
events arrived: they were never trained on by the version that held them out.
"""

from __future__ import annotations

import numpy as np

from shardflow.data.examples import target_positions
from storage.dataset import Dataset


def held_events(validation: bool) -> int:
    """How many of each user's last events training leaves out: the test event, and the validation one."""
    return 2 if validation else 1


def window_key(segment: np.ndarray, targets: np.ndarray, held: int = 1) -> np.ndarray:
    """The part that puts each training target in a window: its own, or that of one of the `held` events
    after it if that is newer.

    `segment` holds the part of every event (indexed like `targets`, and `held` past each).
    A user's last `held` events before a window were held out by the version that saw them
    (test, and validation with one), never trained on: each joins the window in which the
    user's events after it arrived.
    """
    return np.asarray(np.max(np.stack([segment[targets + j] for j in range(held + 1)]), axis=0))


def window_targets(ds: Dataset, offsets: np.ndarray, start: int, stop: int, first: int,
                   segments: np.ndarray | None = None, held: int = 1) -> np.ndarray:
    """The training targets in events start:stop (user order) of a window from part `first`; `segments`,
    if read already, are the parts of events start .. stop (`held` past the range, for window_key)."""
    targets = target_positions(offsets, "train", start, stop, held)
    if first == 0:
        return targets
    stop = min(stop, int(offsets[-1]))
    segments = ds.event_segments(start, min(stop + held, int(offsets[-1]))) if segments is None else segments
    return targets[window_key(segments, targets - start, held) >= first]
