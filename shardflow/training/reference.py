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

from shardflow.data.batches import negative_seed
from shardflow.data.examples import EVAL_NEGATIVES
from shardflow.data.workload import Workload
from shardflow.model.configs import ClickConfig, ModelConfig, OptimizerConfig
from shardflow.model.forward import forward_backward, logits, on_device
from shardflow.model.metrics import Metrics
from shardflow.model.optim import DenseOptimizer, row_state_shape, row_update
from shardflow.model.sequence import init_rows
from shardflow.model.tensors import Tensors
from shardflow.training.validation import best_epoch, score, stop_now, validation_values


class ReferenceTrainer:
    def __init__(
        self,
        data: Workload,
        config: ModelConfig | ClickConfig,
        optimizer: OptimizerConfig,
        batch_size: int,
        seed: int,
        device: torch.device = torch.device("cpu"),
    ):
        self.data, self.config, self.optimizer = data, config, optimizer
        self.batch_size, self.seed, self.device = batch_size, seed, device
        self.tables = {t: torch.from_numpy(init_rows(t, np.arange(rows), config.dim, config.seed)).to(device)
                       for t, rows in data.rows.items()}
        width = row_state_shape(optimizer.rows, config.dim)
        self.row_state = {t: torch.zeros((rows, *width), dtype=torch.float32, device=device)
                          for t, rows in data.rows.items()}
        self.dense_tensors = {k: torch.from_numpy(v).to(device) for k, v in config.init_dense().items()}
        self.dense_optimizer = DenseOptimizer(optimizer, self.dense_tensors)

    def step(self, epoch: int, step_in_epoch: int) -> float:
        """One step on the global batch; returns its summed loss."""
        B = self.batch_size
        targets = self.data.batch(epoch, self.seed, step_in_epoch, B)
        ex = self.data.examples(targets, self.config, negative_seed(self.seed, epoch), step=step_in_epoch)
        index = on_device(self.data.table_index(ex, self.config), self.device)
        grads = forward_backward(self.config, self.dense_tensors, self.tables, index, B * self.config.loss_terms,
                                 sparse=True)
        for t, g in grads.rows.items():
            g = g.coalesce()
            row_update(self.optimizer, self.tables[t], self.row_state[t], g.indices()[0], g.values())
        self.dense_optimizer.step(grads.dense)
        return grads.loss_sum

    def train_epoch(self, epoch: int) -> None:
        for i in range(self.data.steps_per_epoch(self.batch_size)):
            self.step(epoch, i)

    def evaluate(self, targets: np.ndarray, negatives: int = EVAL_NEGATIVES, seed: int = 0) -> Metrics:
        """`targets` scored as the engine scores them (click logs: AUC and log-loss; sequences: against
        `negatives` sampled items each), in one piece."""
        ex = self.data.eval_examples(targets, self.config, seed, negatives)
        with torch.no_grad():
            logit = logits(self.config, self.dense_tensors, self.tables,
                                       on_device(self.data.table_index(ex, self.config), self.device), sparse=True)
        return self.data.scored.of(logit.cpu().numpy(), ex).metrics()

    def fit(self, epochs: int, patience: int) -> dict[int, float]:
        """Train up to `epochs` epochs, scoring the validation split after each; stop `patience` epochs after
        the best (shardflow.training.validation) and keep its parameters. Returns every epoch's score."""
        scores: dict[int, float] = {}
        kept: tuple[Tensors, ...] | None = None  # the best epoch's parameters
        for epoch in range(1, epochs + 1):
            self.train_epoch(epoch - 1)
            scores[epoch] = score(validation_values(self.evaluate(self.data.validation_targets)))
            if best_epoch(scores) == epoch:
                kept = self._copy()
            if stop_now(scores, patience):
                break
        if kept is not None:
            for now, then in zip(self._parameters(), kept, strict=True):
                for k, v in then.items():
                    now[k].copy_(v)
        return scores

    def _parameters(self) -> tuple[Tensors, Tensors, Tensors]:
        """The rows, their optimizer state and the dense weights (not the dense optimiser's state)."""
        return self.tables, self.row_state, self.dense_tensors

    def _copy(self) -> tuple[Tensors, ...]:
        return tuple({k: v.clone() for k, v in d.items()} for d in self._parameters())

    @property
    def weights(self) -> dict[str, np.ndarray]:
        return {t: w.cpu().numpy() for t, w in self.tables.items()}

    @property
    def state(self) -> dict[str, np.ndarray]:
        return {t: s.cpu().numpy() for t, s in self.row_state.items()}

    @property
    def dense(self) -> dict[str, np.ndarray]:
        return {k: v.cpu().numpy() for k, v in self.dense_tensors.items()}
