"""What training reads of either workload's data, typed once: `TrainData` (sequences, shardflow.data.batches)
and `ClickData` (click logs, shardflow.data.clicks) both are a `Workload`.

Each workload pairs its data with its own model config (configs.ModelConfig, configs.ClickConfig) and its own
examples and index types; a run holds one pair. A type checker cannot pair two unions, so the config, the
examples and the index are Any here, as in shardflow.model.forward.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from shardflow.data.batches import Lookups
from shardflow.model.metrics import RankCounts, ScoredRows
from storage.dataset import Dataset


class Workload(Protocol):
    @property
    def dataset(self) -> Dataset: ...

    @property
    def targets(self) -> int:
        """Training targets (examples) in the window."""

    @property
    def rows(self) -> dict[str, int]:
        """Table -> its rows."""

    @property
    def scored(self) -> type[RankCounts] | type[ScoredRows]:
        """What its scored held-out examples add up to."""

    @property
    def offset_users(self) -> int: ...

    @property
    def eval_targets(self) -> np.ndarray: ...

    @property
    def validation_targets(self) -> np.ndarray: ...

    def train_targets(self) -> np.ndarray: ...

    def steps_per_epoch(self, batch_size: int) -> int: ...

    def read_in_parts(self, parts: int) -> None: ...

    def held_bytes(self, trainers: int) -> int: ...

    def batch(self, epoch: int, seed: int, step_in_epoch: int, batch_size: int) -> np.ndarray: ...

    def sub_batches(self, batch: np.ndarray, trainers: int) -> list[np.ndarray]: ...

    def examples(self, targets: np.ndarray, config: Any, seed: int, negatives: int | None = None,
                 step: int | None = None) -> Any: ...

    def eval_examples(self, targets: np.ndarray, config: Any, seed: int, negatives: int) -> Any: ...

    def lookups(self, ex: Any, config: Any, dedup: str) -> Lookups: ...

    def table_index(self, ex: Any, config: Any) -> Any: ...
