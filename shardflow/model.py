"""The sequence DLRM: forward and backward written out by hand against an array module.

One example: a history window of up to L items (PAD-masked), candidates = the positive
and K sampled negatives, and optionally one id per categorical feature table (the
target event's). With h the mean of the history rows and t a candidate's row:

    z = [h, t, h * t, f_1, ..., f_F]  ->  MLP (ReLU hidden layers)  ->  logit
    loss = binary cross-entropy (label 1 for the positive, 0 for negatives)

The item table is shared by history and candidates. A trainer never holds whole tables:
it passes the rows it pulled for its sub-batch and indices into them (BatchIndex), and
gets back gradients for exactly those rows. Losses are summed and divided by `norm`,
the number of candidates in the whole global batch, so the gradients of sub-batches add
up to the gradient of the global batch's mean loss.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field

import numpy as np

from shardflow.arrays import scatter_add, sparse_matrix
from shardflow.errors import InputError
from shardflow.examples import splitmix64


@dataclass(frozen=True)
class ModelConfig:
    dim: int = 64
    mlp: tuple[int, ...] = (64, 32)
    history: int = 20
    negatives: int = 4
    features: tuple[str, ...] = ()  # categorical feature tables, in input order
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("dim", "history"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise InputError(f"model {name} = {v!r}; accepted: an integer >= 1")
        if isinstance(self.negatives, bool) or not isinstance(self.negatives, int) or self.negatives < 1:
            raise InputError(f"model negatives = {self.negatives!r}; accepted: an integer >= 1")
        if any(isinstance(w, bool) or not isinstance(w, int) or w < 1 for w in self.mlp):
            raise InputError(f"model mlp widths = {list(self.mlp)}; accepted: integers >= 1")

    @property
    def input_width(self) -> int:
        return (3 + len(self.features)) * self.dim

    @property
    def layers(self) -> list[tuple[int, int]]:
        widths = [self.input_width, *self.mlp, 1]
        return list(zip(widths[:-1], widths[1:]))

    def dense_names(self) -> list[str]:
        return [f"mlp.{i}.{p}" for i in range(len(self.layers)) for p in ("weight", "bias")]


def init_dense(config: ModelConfig) -> dict[str, np.ndarray]:
    """Glorot-uniform weights, zero biases, from the config's seed."""
    rng = np.random.default_rng(config.seed)
    params = {}
    for i, (fan_in, fan_out) in enumerate(config.layers):
        a = np.sqrt(6.0 / (fan_in + fan_out))
        params[f"mlp.{i}.weight"] = rng.uniform(-a, a, size=(fan_in, fan_out)).astype(np.float32)
        params[f"mlp.{i}.bias"] = np.zeros(fan_out, dtype=np.float32)
    return params


INIT_BLOCK_VALUES = 1 << 20  # values initialised at a time (8 MB per 64-bit temporary)


def init_rows(table: str, ids: np.ndarray, dim: int, seed: int) -> np.ndarray:
    """Initial rows of `ids`, uniform in ±1/sqrt(dim): a hash of (seed, table, id, column).

    Any process gets the same row for the same id, so shards, replicas and the
    reference trainer start identical without exchanging anything.
    """
    ids = np.asarray(ids, dtype=np.uint64)
    with np.errstate(over="ignore"):
        key = splitmix64(np.full(1, np.uint64((seed << 32) ^ zlib.crc32(table.encode())), dtype=np.uint64))
    columns = np.arange(dim, dtype=np.uint64)
    out = np.empty((ids.size, dim), dtype=np.float32)
    step = max(1, INIT_BLOCK_VALUES // max(dim, 1))  # 64-bit temporaries for one block only, not the table
    for start in range(0, ids.size, step):
        counter = ids[start : start + step, None] * np.uint64(dim) + columns
        with np.errstate(over="ignore"):
            bits = splitmix64(counter ^ key)
        unit = (bits >> np.uint64(40)).astype(np.float64) / float(1 << 24)  # [0, 1)
        out[start : start + step] = (2.0 * unit - 1.0) / np.sqrt(dim)
    return out


@dataclass
class BatchIndex:
    """Where each lookup of a sub-batch finds its row among the rows the trainer holds."""

    history: np.ndarray  # [E, L] row index into the item rows, -1 where padded
    candidates: np.ndarray  # [E, 1 + K] row index into the item rows; column 0 is the positive
    features: dict[str, np.ndarray] = field(default_factory=dict)  # name -> [E] row index

    def on(self, xp) -> "BatchIndex":
        """The same index as arrays of `xp` (a no-op for numpy)."""
        if xp is np:
            return self
        return BatchIndex(
            xp.asarray(self.history), xp.asarray(self.candidates), {k: xp.asarray(v) for k, v in self.features.items()}
        )


@dataclass
class Gradients:
    loss_sum: float  # summed BCE of the sub-batch (not divided by norm)
    dense: dict  # name -> array like the parameter
    rows: dict  # table -> [rows held, dim], the gradient of every held row


def _forward(xp, config: ModelConfig, dense: dict, rows: dict, index: BatchIndex, item: str):
    D = config.dim
    E, C = index.candidates.shape
    table = rows[item]
    valid = index.history >= 0
    count = valid.sum(axis=1)
    if E and int(count.min()) == 0:
        raise InputError("an example without any history item; accepted: targets after their user's first event")
    # Mean pooling as one sparse product: pool[e, r] = (times row r is in e's history) / count[e].
    example = xp.nonzero(valid)[0]
    weight = (1.0 / count.astype(table.dtype))[example]
    pool = sparse_matrix(xp, weight, example, index.history[valid], (E, table.shape[0]))
    h = pool @ table
    t = table[index.candidates]
    feats = [rows[name][index.features[name]] for name in config.features]
    # The first layer split by input block: h and the features are the same for every
    # candidate of an example, so their product is taken once per example, not per candidate.
    w0 = dense["mlp.0.weight"]
    per_example = h @ w0[:D] + dense["mlp.0.bias"]
    for k, f in enumerate(feats):
        per_example = per_example + f @ w0[(3 + k) * D : (4 + k) * D]
    pair = xp.concatenate([t, h[:, None, :] * t], axis=2).reshape(E * C, 2 * D)
    z = (pair @ w0[D : 3 * D]).reshape(E, C, -1) + per_example[:, None, :]
    z = z.reshape(E * C, -1)
    acts = [None]
    n = len(config.layers)
    for i in range(1, n):
        z = xp.maximum(z, 0)
        acts.append(z)
        z = z @ dense[f"mlp.{i}.weight"] + dense[f"mlp.{i}.bias"]
    return z.reshape(E, C), (pool, h, t, feats, pair, acts)


def scores(xp, config: ModelConfig, dense: dict, rows: dict, index: BatchIndex, item: str):
    """Logits [E, 1 + K] of every candidate."""
    return _forward(xp, config, dense, rows, index, item)[0]


def forward_backward(
    xp, config: ModelConfig, dense: dict, rows: dict, index: BatchIndex, item: str, norm: int
) -> Gradients:
    """Loss and gradients of a sub-batch; `rows` maps table -> the rows the trainer holds."""
    D = config.dim
    E, C = index.candidates.shape
    logit, (pool, h, t, feats, pair, acts) = _forward(xp, config, dense, rows, index, item)
    label = xp.zeros((E, C), dtype=logit.dtype)
    label[:, 0] = 1.0
    loss_sum = float((xp.logaddexp(0, logit) - label * logit).sum())
    g = ((xp.exp(-xp.logaddexp(0, -logit)) - label) / logit.dtype.type(norm)).reshape(E * C, 1)

    grads: dict = {}
    n = len(config.layers)
    for i in reversed(range(1, n)):
        grads[f"mlp.{i}.weight"] = acts[i].T @ g
        grads[f"mlp.{i}.bias"] = g.sum(axis=0)
        g = (g @ dense[f"mlp.{i}.weight"].T) * (acts[i] > 0)
    w0 = dense["mlp.0.weight"]
    g_example = g.reshape(E, C, -1).sum(axis=1)
    grads["mlp.0.weight"] = xp.concatenate(
        [h.T @ g_example, pair.T @ g] + [f.T @ g_example for f in feats], axis=0
    )
    grads["mlp.0.bias"] = g.sum(axis=0)
    d_pair = (g @ w0[D : 3 * D].T).reshape(E, C, 2 * D)
    d_t, d_ht = d_pair[..., :D], d_pair[..., D:]
    dh = g_example @ w0[:D].T + (d_ht * t).sum(axis=1)
    dt = d_t + d_ht * h[:, None, :]

    row_grads = {name: xp.zeros_like(r) for name, r in rows.items()}
    row_grads[item] += pool.T @ dh
    scatter_add(xp, row_grads[item], index.candidates.reshape(-1), dt.reshape(E * C, D))
    for k, name in enumerate(config.features):
        scatter_add(xp, row_grads[name], index.features[name], g_example @ w0[(3 + k) * D : (4 + k) * D].T)
    return Gradients(loss_sum=loss_sum, dense=grads, rows=row_grads)
