"""The single-process reference trainer: whole tables in one process, the same global batches.

What the distributed engine must reproduce under any plan: it shares the model, the
optimizers, the batch order and the initial values, and differs only in where rows live
and in which order partial gradients are added. It reads whole tables, so its embedding
gradients are sparse (as an EmbeddingBag's with sparse=True): only the rows the batch
read are updated.
"""

from __future__ import annotations

import numpy as np
import torch

from shardflow.model.dlrm import ClickConfig
from shardflow.model.sequence import ModelConfig, forward_backward, init_rows
from shardflow.model.optim import DenseOptimizer, OptimizerConfig, row_adagrad
from shardflow.data.batches import TrainData, negative_seed
from shardflow.data.clicks import ClickData


class ReferenceTrainer:
    def __init__(
        self,
        data: TrainData | ClickData,
        config: ModelConfig | ClickConfig,
        optimizer: OptimizerConfig,
        batch_size: int,
        seed: int,
    ):
        self.data, self.config, self.optimizer = data, config, optimizer
        self.batch_size, self.seed = batch_size, seed
        self.tables = {t: torch.from_numpy(init_rows(t, np.arange(rows), config.dim, config.seed))
                       for t, rows in data.rows.items()}
        self.sums = {t: torch.zeros(rows, dtype=torch.float32) for t, rows in data.rows.items()}
        self.dense_tensors = {k: torch.from_numpy(v) for k, v in config.init_dense().items()}
        self.dense_optimizer = DenseOptimizer(optimizer, self.dense_tensors)

    def step(self, epoch: int, step_in_epoch: int) -> float:
        """One step on the global batch; returns its summed loss."""
        B = self.batch_size
        targets = self.data.batch(epoch, self.seed, step_in_epoch, B)
        ex = self.data.examples(targets, self.config, negative_seed(self.seed, epoch))
        index = self.data.table_index(ex, self.config).on(torch.device("cpu"))
        grads = forward_backward(self.config, self.dense_tensors, self.tables, index, B * self.config.candidates,
                                 sparse=True)
        for t, g in grads.rows.items():
            g = g.coalesce()
            row_adagrad(self.optimizer, self.tables[t], self.sums[t], g.indices()[0], g.values())
        self.dense_optimizer.step(grads.dense)
        return grads.loss_sum

    @property
    def weights(self) -> dict[str, np.ndarray]:
        return {t: w.numpy() for t, w in self.tables.items()}

    @property
    def state(self) -> dict[str, np.ndarray]:
        return {t: s.numpy() for t, s in self.sums.items()}

    @property
    def dense(self) -> dict[str, np.ndarray]:
        return {k: v.numpy() for k, v in self.dense_tensors.items()}
