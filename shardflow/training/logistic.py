"""Logistic regression over a click log's features: the baseline the DLRM must beat.

One weight per (table, row) (a table of token sequences, genres: the mean of the weights of
the rows an example holds), one per numeric input (the DLRM's, log(1 + max(x, 0)), 0 where
missing) and a bias; the mean log-loss plus L2 (`l2` / 2 times the squared weights, bias
aside), fitted to convergence by full-batch L-BFGS in float64 on the training rows. Nothing
is seeded: the optimum is unique, so one fit stands for every seed. With a validation split
the L2 weight is chosen on it (`choose_l2`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from scipy import sparse

from shardflow.data.clicks import ClickData, Clicks
from shardflow.model.configs import ClickConfig, numeric_input
from shardflow.model.dlrm import Bags, table_vectors
from shardflow.model.metrics import Metrics, ScoredRows, log_loss

L2 = 1e-3
L2_GRID = (1e-3, 1e-4, 3e-5, 1e-5, 3e-6)  # choose_l2's choices


@dataclass(frozen=True)
class Logistic:
    weights: dict[str, torch.Tensor]  # table -> float64 tensor [rows]
    linear: torch.Tensor  # float64 [numeric columns]
    bias: torch.Tensor  # float64 [1]

    def logits(self, ex: Clicks) -> torch.Tensor:
        x = torch.from_numpy(numeric_input(ex.numeric)).double()
        return self.bias + x @ self.linear + sum(row_weights(w, ex.ids[t]) for t, w in self.weights.items())

    def evaluate(self, data: ClickData, targets: np.ndarray, config: ClickConfig) -> Metrics:
        """AUC and log-loss on the rows `targets`."""
        ex = data.examples(targets, config)
        with torch.no_grad():
            z = self.logits(ex).numpy()
        return ScoredRows(z.reshape(-1), ex.labels).metrics()


def row_weights(weights: torch.Tensor, ids: np.ndarray) -> torch.Tensor:
    """[E]: each example's weight of a table, or the mean of the weights of the rows its token sequence holds
    ([E, width], -1 padding; 0 when it holds none): the DLRM's pooling (table_vectors) of one-wide rows."""
    at = torch.from_numpy(ids) if ids.ndim == 1 else Bags.of(ids, torch.from_numpy)
    return table_vectors(weights[:, None], at, sparse=False)[:, 0]


def fit_logistic(data: ClickData, config: ClickConfig, l2: float = L2) -> Logistic:
    """The regression fitted on `data`'s training rows (every feature and numeric column of `config`)."""
    train = data.examples(data.train_targets(), config)
    sizes = [data.rows[t] for t in config.features] + [len(config.numeric)]
    x = design(train, config.features, sizes[:-1])
    xt = x.T.tocsr()
    theta, bias = torch.zeros(sum(sizes), dtype=torch.float64), torch.zeros(1, dtype=torch.float64)
    y = torch.from_numpy(train.labels).double()
    # Tolerances past which the held-out AUC and log-loss no longer move in their 5th digit (MovieLens-100k).
    opt = torch.optim.LBFGS([theta, bias], max_iter=500, tolerance_grad=1e-7, tolerance_change=1e-9,
                            line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:  # the loss and, by hand, its gradient: X^T (p - y) / E + l2 theta, sum(p - y) / E
        logits = torch.from_numpy(x @ theta.numpy()) + bias
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, y) + 0.5 * l2 * theta.dot(theta)
        residual = (torch.sigmoid(logits) - y) / len(y)
        theta.grad, bias.grad = torch.from_numpy(xt @ residual.numpy()) + l2 * theta, residual.sum()[None]
        return loss

    opt.step(closure)
    *tables, linear = torch.split(theta.detach(), sizes)
    return Logistic(weights=dict(zip(config.features, tables, strict=True)), linear=linear, bias=bias.detach())


def design(ex: Clicks, features: tuple[str, ...], rows: list[int]) -> sparse.csr_array:
    """[E, sum(rows) + numeric columns], sparse: the regression's logits, bias aside, are this times the weights
    of every table (in `features` order, table t's `rows[t]` of them) and the numeric weights, one after
    another. A row lookup is a 1; a token sequence's rows each 1 / its length (the mean, as row_weights takes);
    then the numeric inputs. Built once per fit, it and its transpose are all an L-BFGS step needs: on
    MovieLens-100k choose_l2 took 1.5-2.5 s so, 17.3 s with autograd through embedding lookups, to the same fit."""
    at, cols, values, offset = [], [], [], 0
    for t, n in zip(features, rows, strict=True):
        ids = ex.ids[t] if ex.ids[t].ndim == 2 else ex.ids[t][:, None]  # a row lookup: a sequence of one
        held = ids >= 0
        example, slot = np.nonzero(held)
        at.append(example)
        cols.append(offset + ids[example, slot])
        values.append(1.0 / held.sum(axis=1)[example])
        offset += n
    numeric = numeric_input(ex.numeric).astype(np.float64)
    at.append(np.repeat(np.arange(len(ex)), numeric.shape[1]))
    cols.append(offset + np.tile(np.arange(numeric.shape[1]), len(ex)))
    values.append(numeric.ravel())
    shape = (len(ex), offset + numeric.shape[1])
    return sparse.csr_array((np.concatenate(values), (np.concatenate(at), np.concatenate(cols))), shape=shape)


def choose_l2(data: ClickData, config: ClickConfig, grid: tuple[float, ...] = L2_GRID) -> tuple[float, Logistic]:
    """The L2 weight of `grid` (strongest first) whose fit has the least log-loss on the validation split
    (data loaded with validation=True), walking down until that loss rises, and that fit: the regression
    tuned as the DLRM's epochs are, never on the test rows."""
    best, least = None, float("inf")
    for l2 in grid:
        fitted = fit_logistic(data, config, l2)
        loss = fitted.evaluate(data, data.validation_targets, config).logloss
        if loss is None or loss >= least:
            break
        best, least = (l2, fitted), loss
    if best is None:
        raise ValueError(f"no L2 weight of {grid} fits with a finite validation log-loss")
    return best


def constant_logloss(data: ClickData, config: ClickConfig) -> float:
    """The held-out log-loss of predicting the training rows' click rate for every row."""
    rate = float(data.examples(data.train_targets(), config).labels.mean())
    labels = data.examples(data.eval_targets, config).labels
    return log_loss(np.full(labels.size, np.log(rate / (1 - rate))), labels)
