"""Optimizers in PyTorch: row-wise Adagrad or per-row Adam for embedding rows, Adam or Adagrad for dense
parameters.

A row's optimizer state lives beside the row, wherever the row lives. Row-wise Adagrad keeps
one float per row:
    G_r += mean(g_r ** 2);  w_r -= lr * g_r / (sqrt(G_r) + eps)
Per-row Adam keeps 2·dim + 1 floats: the moments m_r and v_r and the count c_r of the row's
own updates, which its bias correction uses (each row is the Adam of its own, as if it were
a parameter alone; a row not read by a step is not touched, so a step costs what its rows do):
    c_r += 1;  m_r = b1·m_r + (1 - b1)·g_r;  v_r = b2·v_r + (1 - b2)·g_r²
    w_r -= lr · (m_r / (1 - b1^c_r)) / (sqrt(v_r / (1 - b2^c_r)) + eps)
The count is a float32: exact to 2^24 updates of a row, where 1 - b^c is 1 to float precision.
Every operation is elementwise per row in a fixed order, so two copies of a row that
start equal and apply the same gradient stay bitwise equal, whatever other rows are
updated beside them.

The dense optimizer is torch.optim's Adam (with bias correction) or Adagrad; its state
is exposed under the names the exports hold (`<param>.m`, `<param>.v`, `<param>.sum`)
so a model version carries it over to the next. Their config (OptimizerConfig, the default
rates) is in shardflow.model.configs, which imports no PyTorch.
"""

from __future__ import annotations

import torch

from shardflow.model.configs import DENSE_SLOTS, OptimizerConfig
from shardflow.planner.sharding_plan import row_state_floats


def row_state_shape(rows: str, dim: int) -> tuple[int, ...]:
    """The shape of one row's state in a state tensor [rows, ...]: a scalar for Adagrad."""
    return () if rows == "adagrad" else (row_state_floats(rows, dim),)


def row_update(config: OptimizerConfig, weights: torch.Tensor, state: torch.Tensor, local: torch.Tensor,
               grads: torch.Tensor) -> None:
    """Update rows `local` (distinct) of `weights` [rows, dim] and their `state` in place, by config.rows."""
    (row_adagrad if config.rows == "adagrad" else row_adam)(config, weights, state, local, grads)


@torch.no_grad()
def row_adagrad(config: OptimizerConfig, weights: torch.Tensor, state: torch.Tensor, local: torch.Tensor,
                grads: torch.Tensor) -> None:
    """Update rows `local` (distinct) of `weights` [rows, dim] and `state` [rows] in place.

    By index_add_, not a gather and a scatter back: `local` is distinct, so each row gets one addition (the same
    sums, bitwise, and deterministic on CUDA too) in fewer kernels."""
    state.index_add_(0, local, (grads * grads).mean(dim=1))
    acc = state[local]
    weights.index_add_(0, local, config.row_rate * grads / (acc.sqrt()[:, None] + config.eps), alpha=-1)


@torch.no_grad()
def row_adam(config: OptimizerConfig, weights: torch.Tensor, state: torch.Tensor, local: torch.Tensor,
             grads: torch.Tensor) -> None:
    """Update rows `local` (distinct) of `weights` [rows, dim] and `state` [rows, 2·dim + 1] in place."""
    D, b1, b2 = weights.shape[1], config.beta1, config.beta2
    held = state[local]
    m = b1 * held[:, :D] + (1 - b1) * grads
    v = b2 * held[:, D : 2 * D] + (1 - b2) * grads * grads
    count = held[:, 2 * D :] + 1
    state[local] = torch.cat([m, v, count], dim=1)
    m_hat = m / (1 - torch.pow(b1, count))
    v_hat = v / (1 - torch.pow(b2, count))
    weights[local] -= config.row_rate * m_hat / (v_hat.sqrt() + config.eps)


class DenseOptimizer:
    """torch.optim.Adam or Adagrad over a dict of float32 tensors; gradients passed by name."""

    def __init__(self, config: OptimizerConfig, params: dict[str, torch.Tensor]) -> None:
        self.config, self.params = config, params
        self._opt: torch.optim.Optimizer
        if config.dense == "adam":
            self._opt = torch.optim.Adam(list(params.values()), lr=config.dense_lr,
                                         betas=(config.beta1, config.beta2), eps=config.eps)
        else:
            self._opt = torch.optim.Adagrad(list(params.values()), lr=config.dense_lr, eps=config.eps)
        self.t = 0
        for p in params.values():  # zero state now, so it can be saved before the first step
            self._opt.state[p] = self._fresh(p)

    def _fresh(self, p: torch.Tensor) -> dict[str, torch.Tensor]:
        slots = {torch_name: torch.zeros_like(p) for torch_name in DENSE_SLOTS[self.config.dense].values()}
        return {"step": torch.tensor(float(self.t)), **slots}

    @torch.no_grad()
    def step(self, grads: dict[str, torch.Tensor]) -> None:
        for name, p in self.params.items():
            p.grad = grads[name]
        self._opt.step()
        for p in self.params.values():
            p.grad = None
        self.t += 1

    @property
    def state(self) -> dict[str, torch.Tensor]:
        """`<param>.<slot>` -> tensor, as exports and checkpoints store it."""
        return {f"{name}.{slot}": self._opt.state[p][torch_name]
                for name, p in self.params.items() for slot, torch_name in DENSE_SLOTS[self.config.dense].items()}

    def load(self, state: dict[str, torch.Tensor], steps: int) -> None:
        """Take the state saved by `state` after `steps` steps."""
        self.t = steps
        for name, p in self.params.items():
            entry = self._fresh(p)
            for slot, torch_name in DENSE_SLOTS[self.config.dense].items():
                entry[torch_name] = state[f"{name}.{slot}"].to(p.device, torch.float32).clone()
            self._opt.state[p] = entry
