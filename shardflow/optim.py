"""Optimizers: row-wise Adagrad for embedding rows, Adam or Adagrad for dense parameters.

Row-wise Adagrad keeps one float per row, beside the row, wherever the row lives:
    G_r += mean(g_r ** 2);  w_r -= lr * g_r / (sqrt(G_r) + eps)
Every operation is elementwise in a fixed order, so two copies of a row that start equal
and apply the same gradient stay bitwise equal.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

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


def row_adagrad(xp, config: OptimizerConfig, weights, state, local, grads) -> None:
    """Update rows `local` (distinct) of `weights` [rows, dim] and `state` [rows] in place."""
    g = grads.astype(np.float32, copy=False)
    acc = state[local] + (g * g).mean(axis=1)
    state[local] = acc
    weights[local] -= np.float32(config.row_lr) * g / (xp.sqrt(acc)[:, None] + np.float32(config.eps))


class DenseOptimizer:
    """Adam (with bias correction) or Adagrad over a dict of float32 arrays; state by name."""

    def __init__(self, xp, config: OptimizerConfig, params: dict) -> None:
        self.xp, self.config, self.t = xp, config, 0
        self.state = {f"{k}.{s}": xp.zeros_like(v) for k, v in params.items() for s in self._slots()}

    def _slots(self) -> tuple[str, ...]:
        return ("m", "v") if self.config.dense == "adam" else ("sum",)

    def step(self, params: dict, grads: dict) -> None:
        c, xp = self.config, self.xp
        self.t += 1
        lr, eps = np.float32(c.dense_lr), np.float32(c.eps)
        for name, p in params.items():
            g = grads[name]
            if c.dense == "adagrad":
                s = self.state[f"{name}.sum"]
                s += g * g
                p -= lr * g / (xp.sqrt(s) + eps)
                continue
            m, v = self.state[f"{name}.m"], self.state[f"{name}.v"]
            m *= np.float32(c.beta1)
            m += np.float32(1 - c.beta1) * g
            v *= np.float32(c.beta2)
            v += np.float32(1 - c.beta2) * g * g
            m_hat = m / np.float32(1 - c.beta1**self.t)
            v_hat = v / np.float32(1 - c.beta2**self.t)
            p -= lr * m_hat / (xp.sqrt(v_hat) + eps)
