"""The threading rule of shardflow.training.transport, as DeviceActor enforces it."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from shardflow.errors import TrainingError
from shardflow.training.actor import DeviceActor


class _Served:
    def serve_rows(self, table, ids, sender):
        return np.zeros((ids.size, 2), dtype=np.float32)

    def serve_dense(self, sender):
        return {}

    def export_rows(self, table, ids):
        return np.zeros((ids.size, 2), dtype=np.float32), np.zeros(ids.size, dtype=np.float32)


def _actor(stepping: bool) -> DeviceActor:
    actor = DeviceActor.__new__(DeviceActor)  # the rule only: no data, no cluster
    actor.index, actor.device, actor._stepping = 1, _Served(), stepping
    return actor


@pytest.mark.parametrize("read, args", [("read_rows", ("items", np.arange(3), 0)), ("read_dense", (0,)),
                                        ("export_rows", ("items", np.arange(3)))])
def test_a_peer_reads_rows_between_steps_and_is_refused_during_one(read, args):
    assert asyncio.run(getattr(_actor(False), read)(*args)) is not None
    with pytest.raises(TrainingError, match=rf"device 1: {read} while a step updates the shard"):
        asyncio.run(getattr(_actor(True), read)(*args))
