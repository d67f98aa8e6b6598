"""The single-process reference trainer: whole tables in one process, the same global batches.

What the distributed engine must reproduce under any plan: it shares the model, the
optimizers, the batch order and the initial values, and differs only in where rows live
and in which order partial gradients are added.
"""

from __future__ import annotations

import numpy as np

from shardflow.model import ModelConfig, forward_backward, init_dense, init_rows
from shardflow.optim import DenseOptimizer, OptimizerConfig, row_adagrad
from shardflow.training.batches import TrainData, lookups, negative_seed


class ReferenceTrainer:
    def __init__(self, data: TrainData, config: ModelConfig, optimizer: OptimizerConfig, batch_size: int, seed: int):
        self.data, self.config, self.optimizer = data, config, optimizer
        self.batch_size, self.seed = batch_size, seed
        self.weights = {t: init_rows(t, np.arange(rows), config.dim, config.seed) for t, rows in data.rows.items()}
        self.state = {t: np.zeros(rows, dtype=np.float32) for t, rows in data.rows.items()}
        self.dense = init_dense(config)
        self.dense_optimizer = DenseOptimizer(np, optimizer, self.dense)
        self._order: tuple[int, np.ndarray] | None = None

    def step(self, epoch: int, step_in_epoch: int) -> float:
        """One step on the global batch; returns its summed loss."""
        if self._order is None or self._order[0] != epoch:
            self._order = (epoch, self.data.epoch_order(epoch, self.seed))
        B = self.batch_size
        targets = self._order[1][step_in_epoch * B : (step_in_epoch + 1) * B]
        ex = self.data.examples(targets, self.config, negative_seed(self.seed, epoch))
        need = lookups(ex, self.data, self.config, "device")
        rows = {t: self.weights[t][ids] for t, ids in need.fetch.items()}
        grads = forward_backward(
            np, self.config, self.dense, rows, need.index, self.data.item, B * (1 + self.config.negatives)
        )
        for t, ids in need.fetch.items():
            row_adagrad(np, self.optimizer, self.weights[t], self.state[t], ids, grads.rows[t])
        self.dense_optimizer.step(self.dense, grads.dense)
        return grads.loss_sum
