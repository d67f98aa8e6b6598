"""The parameter shard of one device: its rows, their optimizer state and versions.

A plain class (the Dask actor that carries it is shardflow.training.device). It stores
only the rows the plan gives its device, each with its row-wise Adagrad state and a
version (the step after whose update the row was last written), plus, on device 0, the
dense parameters and their optimizer. Callers speak global ids; a RowLayout turns them
into local rows.

Gradients arrive as contributions from senders (trainers, or replicas passing partial
sums) and wait in `pending` until the step's owner applies them; summing is always in
sender order, so a run is deterministic. Every call that moves data counts the bytes it
receives and sends in `traffic[kind][sender, receiver]`.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np

from shardflow.arrays import scatter_add, to_device, to_host
from shardflow.errors import InputError
from shardflow.model import ModelConfig, init_dense, init_rows
from shardflow.optim import DenseOptimizer, OptimizerConfig, row_adagrad

TRAFFIC_KINDS = ("lookup", "sync", "dense", "eval")


@dataclass(frozen=True)
class RowLayout:
    """The global ids a shard stores for one table, in local-row order, or a modulus.

    `stored` comes from the shard map. Estimation mode stores a scaled table instead:
    `modulus` rows, global id i living at local row i % modulus.
    """

    table: str
    stored: np.ndarray | None = None
    modulus: int | None = None

    def __post_init__(self) -> None:
        if (self.stored is None) == (self.modulus is None):
            raise ValueError("a RowLayout has either stored ids or a modulus")
        if self.stored is not None:
            order = np.argsort(self.stored, kind="stable")
            object.__setattr__(self, "_order", order)
            object.__setattr__(self, "_sorted", self.stored[order])

    @property
    def rows(self) -> int:
        return int(self.stored.size if self.stored is not None else self.modulus)

    @property
    def init_ids(self) -> np.ndarray:
        """The ids whose initial values the local rows take."""
        return self.stored if self.stored is not None else np.arange(self.modulus, dtype=np.int64)

    def local(self, ids: np.ndarray) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64)
        if self.modulus is not None:
            return ids % self.modulus
        k = np.searchsorted(self._sorted, ids)
        k_safe = np.minimum(k, max(self._sorted.size - 1, 0))
        missing = (k >= self._sorted.size) | (self._sorted[k_safe] != ids) if ids.size else np.zeros(0, bool)
        if missing.any():
            raise InputError(f"table '{self.table}': id {int(ids[missing][0])} is not stored on this shard")
        return self._order[k_safe]


class ParameterShard:
    def __init__(
        self,
        device: int,
        devices: int,
        layouts: dict[str, RowLayout],
        config: ModelConfig,
        optimizer: OptimizerConfig,
        xp=np,
        holds_dense: bool = False,
    ) -> None:
        self.device, self.devices, self.layouts = device, devices, layouts
        self.config, self.optimizer, self.xp = config, optimizer, xp
        self.weights = {t: to_device(xp, init_rows(t, lay.init_ids, config.dim, config.seed)) for t, lay in layouts.items()}
        self.state = {t: xp.zeros(lay.rows, dtype=np.float32) for t, lay in layouts.items()}
        self.version = {t: np.zeros(lay.rows, dtype=np.int64) for t, lay in layouts.items()}
        self.pending: dict[str, list] = {t: [] for t in layouts}
        self._lock = threading.Lock()  # pushes arrive on the event loop while the actor thread takes
        self.traffic = {k: np.zeros((devices, devices)) for k in TRAFFIC_KINDS}
        self.clock = 0  # steps whose updates this shard has applied
        self.dense = None
        if holds_dense:
            self.dense = {k: to_device(xp, v) for k, v in init_dense(config).items()}
            self.dense_optimizer = DenseOptimizer(xp, optimizer, self.dense)
            self.dense_pending: list = []

    # -- reads -------------------------------------------------------------------------
    def _check_clock(self, step: int) -> None:
        if step != self.clock:
            raise RuntimeError(f"shard {self.device}: asked for step {step}, holds parameters after step {self.clock}")

    def read(self, table: str, ids: np.ndarray, step: int):
        """Rows of `ids` as of the start of `step` (no traffic: the caller is on this device)."""
        self._check_clock(step)
        return self.weights[table][to_device(self.xp, self.layouts[table].local(ids))]

    def serve(self, table: str, ids: np.ndarray, sender: int, step: int, kind: str = "lookup") -> np.ndarray:
        rows = to_host(self.read(table, ids, step))
        self.traffic[kind][sender, self.device] += ids.nbytes
        self.traffic[kind][self.device, sender] += rows.nbytes
        return rows

    def serve_dense(self, sender: int, step: int, kind: str = "dense") -> dict:
        self._check_clock(step)
        params = {k: to_host(v) for k, v in self.dense.items()}
        if sender != self.device:
            self.traffic[kind][self.device, sender] += sum(v.nbytes for v in params.values())
        return params

    # -- gradients ---------------------------------------------------------------------
    def accept(self, table: str, ids: np.ndarray, grads, sender: int, kind: str = "lookup") -> None:
        if sender != self.device:
            self.traffic[kind][sender, self.device] += ids.nbytes + grads.nbytes
        entry = (sender, np.asarray(ids, dtype=np.int64), to_device(self.xp, grads))
        with self._lock:
            self.pending[table].append(entry)

    def accept_dense(self, grads: dict, sender: int) -> None:
        if sender != self.device:
            self.traffic["dense"][sender, self.device] += sum(v.nbytes for v in grads.values())
        entry = (sender, {k: to_device(self.xp, v) for k, v in grads.items()})
        with self._lock:
            self.dense_pending.append(entry)

    def take(self, table: str, select) -> tuple[np.ndarray, object]:
        """Remove the pending contributions for ids where `select(ids)` is true; (distinct ids, summed grads)."""
        kept, taken = [], []
        with self._lock:
            for sender, ids, grads in self.pending[table]:
                mask = select(ids)
                if mask.any():
                    taken.append((sender, ids[mask], grads[to_device(self.xp, np.flatnonzero(mask))]))
                if not mask.all():
                    kept.append((sender, ids[~mask], grads[to_device(self.xp, np.flatnonzero(~mask))]))
            self.pending[table] = kept
        xp = self.xp
        if not taken:
            return np.zeros(0, dtype=np.int64), xp.zeros((0, self.config.dim), dtype=np.float32)
        taken.sort(key=lambda c: c[0])  # stable: a sender's contributions keep their order
        ids = np.concatenate([c[1] for c in taken])
        distinct, where = np.unique(ids, return_inverse=True)
        total = xp.zeros((distinct.size, self.config.dim), dtype=np.float32)
        scatter_add(xp, total, to_device(xp, where), xp.concatenate([c[2] for c in taken]))
        return distinct, total

    def apply(self, table: str, ids: np.ndarray, grads, step: int) -> None:
        """The owner's update of rows `ids` (distinct) with their summed gradients."""
        xp = self.xp
        local = self.layouts[table].local(ids)
        grads = to_device(xp, grads)
        if self.layouts[table].modulus is not None:  # estimation: several ids share a scaled row
            local, where = np.unique(local, return_inverse=True)
            summed = xp.zeros((local.size, self.config.dim), dtype=np.float32)
            scatter_add(xp, summed, to_device(xp, where), grads)
            grads = summed
        row_adagrad(xp, self.optimizer, self.weights[table], self.state[table], to_device(xp, local), grads)
        self.version[table][local] = step + 1

    def apply_dense(self, step: int) -> None:
        with self._lock:
            contributions = sorted(self.dense_pending, key=lambda c: c[0])
            self.dense_pending = []
        total = {k: v.copy() for k, v in contributions[0][1].items()}
        for _, grads in contributions[1:]:
            for k in total:
                total[k] += grads[k]
        self.dense_optimizer.step(self.dense, total)

    def finish_step(self, step: int) -> None:
        self._check_clock(step)
        left = {t: len(p) for t, p in self.pending.items() if p}
        if left or (self.dense is not None and self.dense_pending):
            raise RuntimeError(f"shard {self.device}: step {step} ends with unapplied gradients {left}")
        self.clock = step + 1

    def discard(self) -> None:
        """Drop a failed step's pending gradients; applied parameters are untouched."""
        self.pending = {t: [] for t in self.pending}
        if self.dense is not None:
            self.dense_pending = []
