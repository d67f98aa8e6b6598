"""Users' states for ranking the whole catalog, made STATE_USERS users at a time.

A user's state (shardflow.model.sequence.user_state) is what every catalog row is scored
against. Self-attention's activations grow with the users encoded at once (history 20,
dim 64: about 230 MB for 4,096 users), while the states themselves are dim floats a user. So
the held-out users of an evaluation (shardflow.training.evaluate) and a block of a night's
lists (shardflow.training.recommend) are encoded a slice at a time, each slice reading only
the rows its own lookups need, and the states joined.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import numpy as np
import torch

from shardflow.data.batches import Lookups
from shardflow.model.configs import ModelConfig
from shardflow.model.forward import on_device
from shardflow.model.sequence import user_state
from shardflow.model.tensors import Tensors, UserState

# users whose states one pass of the encoder makes: 512 at a time, a block of 4,096 users' lists peaked at 210 MB
# over the process, against 309 MB in one pass (self-attention, history 20, dim 64, 10^5 items)
STATE_USERS = 512


def slices(users: int) -> list[slice]:
    """The slices of `users` users encoded one pass each (one, empty, for no user)."""
    return [slice(s, s + STATE_USERS) for s in range(0, max(users, 1), STATE_USERS)]


def states(config: ModelConfig, dense: Tensors, needs: Iterable[Lookups],
           rows_of: Callable[[dict[str, np.ndarray]], Tensors],
           device: torch.device) -> Iterator[tuple[UserState, Tensors, Lookups]]:
    """Per slice, in order: its users' states computed on `device` without gradients, the rows its lookups read
    (`rows_of({table: ids})`: from an export, or where a device's shards hold them) and the lookups, placed on
    `device`."""
    for need in needs:
        rows = rows_of(need.fetch)
        placed = Lookups(need.fetch, on_device(need.index, device))
        with torch.no_grad():
            state = user_state(config, dense, rows, placed.index)
        yield state, rows, placed


def joined(parts: Iterable[UserState]) -> UserState:
    """The slices' states as one, on the host."""
    return tuple(torch.cat([x.cpu() for x in xs]) for xs in zip(*parts, strict=True))
