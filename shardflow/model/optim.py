"""Optimizers in PyTorch: row-wise Adagrad for embedding rows, Adam or Adagrad for dense parameters.

Row-wise Adagrad keeps one float per row, beside the row, wherever the row lives:
    G_r += mean(g_r ** 2);  w_r -= lr * g_r / (sqrt(G_r) + eps)
Every operation is elementwise per row in a fixed order, so two copies of a row that
start equal and apply the same gradient stay bitwise equal, whatever other rows are
updated beside them.

The dense optimizer is torch.optim's Adam (with bias correction) or Adagrad; its state
is exposed under the names the exports hold (`<param>.m`, `<param>.v`, `<param>.sum`)
so a model version carries it over to the next.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from shardflow.errors import InputError

DENSE_OPTIMIZERS = ("adam", "adagrad")


@dataclass(frozen=True)
class OptimizerConfig:
    row_lr: float = 0.05
    dense: str = "adam"
    dense_lr: float = 1e-3
    eps: float = 1e-8
    beta1: float = 0.9
    beta2: float = 0.999

    def __post_init__(self) -> None:
        if self.dense not in DENSE_OPTIMIZERS:
            raise InputError(f"dense optimizer {self.dense!r}; accepted: {', '.join(DENSE_OPTIMIZERS)}")
        for name in ("row_lr", "dense_lr", "eps"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and np.isfinite(v) and v > 0):
                raise InputError(f"optimizer {name} = {v!r}; accepted: a finite number > 0")
        for name in ("beta1", "beta2"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and 0 <= v < 1):
                raise InputError(f"optimizer {name} = {v!r}; accepted: 0 <= value < 1")


@torch.no_grad()
def row_adagrad(config: OptimizerConfig, weights: torch.Tensor, state: torch.Tensor, local: torch.Tensor,
                grads: torch.Tensor) -> None:
    """Update rows `local` (distinct) of `weights` [rows, dim] and `state` [rows] in place."""
    acc = state[local] + (grads * grads).mean(dim=1)
    state[local] = acc
    weights[local] -= config.row_lr * grads / (acc.sqrt()[:, None] + config.eps)


# The state torch.optim keeps per parameter, by the name an export stores it under.
_SLOTS = {"adam": {"m": "exp_avg", "v": "exp_avg_sq"}, "adagrad": {"sum": "sum"}}


class DenseOptimizer:
    """torch.optim.Adam or Adagrad over a dict of float32 tensors; gradients passed by name."""

    def __init__(self, config: OptimizerConfig, params: dict[str, torch.Tensor]) -> None:
        self.config, self.params = config, params
        if config.dense == "adam":
            self._opt = torch.optim.Adam(list(params.values()), lr=config.dense_lr,
                                         betas=(config.beta1, config.beta2), eps=config.eps)
        else:
            self._opt = torch.optim.Adagrad(list(params.values()), lr=config.dense_lr, eps=config.eps)
        self.t = 0
        for p in params.values():  # zero state now, so it can be saved before the first step
            self._opt.state[p] = self._fresh(p)

    def _fresh(self, p: torch.Tensor) -> dict:
        slots = {torch_name: torch.zeros_like(p) for torch_name in _SLOTS[self.config.dense].values()}
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
                for name, p in self.params.items() for slot, torch_name in _SLOTS[self.config.dense].items()}

    def load(self, state: dict[str, torch.Tensor], steps: int) -> None:
        """Take the state saved by `state` after `steps` steps."""
        self.t = steps
        for name, p in self.params.items():
            entry = self._fresh(p)
            for slot, torch_name in _SLOTS[self.config.dense].items():
                entry[torch_name] = state[f"{name}.{slot}"].to(p.device, torch.float32).clone()
            self._opt.state[p] = entry
