"""The sequence DLRM in PyTorch: one code path for CPU and CUDA, gradients by autograd.

One example: a history window of up to L items (PAD-masked), candidates = the positive
and K sampled negatives, and optionally one id per categorical feature table (the
target event's). The encoder (`encoder`) turns the history into the user's state:

    mean            h = the mean of the history rows; with t a candidate's row,
                    z = [h, t, h * t, f_1, ..., f_F]  ->  MLP (ReLU hidden layers)  ->  logit
    self-attention  u = SASRec's causal self-attention blocks over the window (shardflow.model.attention)
                    plus the feature rows; logit = u · t (the MLP is not used)

    loss  bce              binary cross-entropy of every candidate (label 1 for the positive, 0 for
                           the negatives): 1 + K terms an example (SASRec's)
          sampled-softmax  cross-entropy of the positive against its candidates, softmax over the
                           positive and the K negatives: one term an example (SASRec+SS, eSASRec).
                           The negatives are uniform over the rows, so the logQ correction of a
                           popularity-sampled softmax is a constant and left out.
          gbce             gSASRec's generalised BCE (Petrov & Macdonald, RecSys 2023): BCE with the
                           positive's term weighted by beta = a (t (1 - 1/a) + 1/a), a = K / (items - 1)
                           the negatives' sampling rate and t (`gbce_t`) the calibration (t 1: the
                           probabilities of a model trained on every item); 1 + K terms an example. Its
                           logits are taken less log K, the prior log-odds of the positive among its
                           1 + K candidates: the dot-product scorer has no intercept to learn it, and
                           without it the item rows spend their first epochs pushing every score down.

The item table is shared by history and candidates; while training, `item_dropout` of each item row's units
are dropped once a step, the same for every read of the row in that step (held_items). A trainer never holds
whole tables: it passes the rows it pulled for its sub-batch and indices into them (BatchIndex; it and
the config, ModelConfig, are in shardflow.model.configs, which imports no PyTorch), and
gets back gradients for exactly those rows (a dense [rows pulled, dim] tensor: the rows
pulled are already the sparse slice). The single-process reference passes whole tables
instead and takes sparse gradients (`sparse=True`), as an EmbeddingBag with sparse
gradients would. Losses are summed and divided by `norm`, the number of candidates in
the whole global batch, so the gradients of sub-batches add up to the gradient of the
global batch's mean loss.

Dense weights are stored [in, out] (x @ W + b), as the exports have always held them.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from shardflow.errors import InputError
from shardflow.hashing import splitmix64
from shardflow.model.attention import dropout, encode
from shardflow.model.configs import BatchIndex, ModelConfig
from shardflow.model.lookup import bag_mean, rows_at
from shardflow.model.tensors import Tensors, UserState

ITEM_SITE = 1 << 16  # the item rows' dropout site, past every site of the encoder's blocks


def loss_sum(config: ModelConfig, logit: torch.Tensor, index: TensorIndex) -> torch.Tensor:
    """The summed loss of logits [E, 1 + K] whose column 0 is the positive, by config.loss."""
    if config.loss == "bce":
        label = torch.zeros_like(logit)
        label[:, 0] = 1.0
        return F.binary_cross_entropy_with_logits(logit, label, reduction="sum")
    if config.loss == "gbce":
        beta = gbce_beta(config.negatives, index.catalog, config.gbce_t)
        prior = logit - math.log(config.negatives)
        return -(beta * F.logsigmoid(prior[:, 0]).sum() + F.logsigmoid(-prior[:, 1:]).sum())
    positive = torch.zeros(logit.shape[0], dtype=torch.long, device=logit.device)
    return F.cross_entropy(logit, positive, reduction="sum")


def gbce_beta(negatives: int, items: int, t: float) -> float:
    """gBCE's weight of the positive's term: negatives drawn uniformly from the `items` - 1 items other than the
    positive at rate a = negatives / (items - 1), beta = a (t (1 - 1/a) + 1/a) (gSASRec, eq. 11); 1 at t 0."""
    if items < 2:
        raise InputError(f"gbce over a table of {items} rows; accepted: at least 2 rows")
    a = min(negatives / (items - 1), 1.0)
    return a * (t * (1.0 - 1.0 / a) + 1.0 / a)


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


def tensor_index(index: BatchIndex, device: torch.device) -> TensorIndex:
    """`index` as tensors on `device`, history flattened into bags (one per example)."""
    valid = index.history >= 0
    count = valid.sum(axis=1)
    if count.size and int(count.min()) == 0:
        raise InputError("an example without any history item; accepted: targets after their user's first event")
    offsets = np.zeros(count.size, dtype=np.int64)
    np.cumsum(count[:-1], out=offsets[1:])
    def put(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)).to(device)

    return TensorIndex(
        item=index.item, history=put(index.history[valid]), offsets=put(offsets), candidates=put(index.candidates),
        features={k: put(v) for k, v in index.features.items()}, window=put(index.history), keys=index.keys,
        catalog=index.catalog, item_ids=index.item_ids, step_key=index.step_key,
    )


@dataclass
class TensorIndex:
    item: str
    history: torch.Tensor  # [valid lookups] row index, example by example
    offsets: torch.Tensor  # [E] where each example's history starts in `history`
    candidates: torch.Tensor  # [E, 1 + K]
    features: Tensors
    window: torch.Tensor  # [E, L] row index, -1 where padded (the self-attention encoder's input)
    keys: np.ndarray | None  # uint64 [E], dropout keys of training examples
    catalog: int  # the item table's rows (BatchIndex.catalog)
    item_ids: np.ndarray | None = None  # BatchIndex.item_ids
    step_key: int | None = None  # BatchIndex.step_key


def scores(config: ModelConfig, dense: Tensors, rows: Tensors, index: TensorIndex,
           sparse: bool = False) -> torch.Tensor:
    """Logits [E, 1 + K] of every candidate."""
    rows = held_items(config, rows, index, sparse)
    state = user_state(config, dense, rows, index, sparse)
    candidates = rows_at(rows[index.item], index.candidates, sparse and index.item_ids is None)
    return candidate_scores(config, dense, state, candidates)


def held_items(config: ModelConfig, rows: Tensors, index: TensorIndex, sparse: bool) -> Tensors:
    """`rows` with the item table as the rows a training step's item lookups index, `item_dropout` of each row's
    units dropped (the rest scaled by 1 / (1 - rate)) by a mask of (the step's key, the row's id).

    One mask per row and step, read by the history and the candidates alike: RecTools 0.13's SASRec drops units
    of the whole item table once a step (`IdEmbeddingsItemNet`). Masks keyed by the row's id, not by where a
    trainer holds it, drop the same units under every plan and device count. The reference (`sparse`: whole
    tables) first takes the rows the step reads (BatchIndex.item_ids) from the whole table, as a trainer pulls
    them; a trainer's rows are those already."""
    ids, table = index.item_ids, rows[index.item]
    if ids is None:
        return rows
    if sparse:
        table = rows_at(table, torch.from_numpy(ids.astype(np.int64)).to(table.device), sparse=True)
    if index.step_key is not None and config.item_dropout:
        with np.errstate(over="ignore"):
            keys = splitmix64(ids.astype(np.uint64) ^ np.uint64(index.step_key))
        table = dropout(table, keys, ITEM_SITE, config.item_dropout, config.seed)
    return {**rows, index.item: table}


def user_state(config: ModelConfig, dense: Tensors, rows: Tensors, index: TensorIndex,
               sparse: bool = False) -> UserState:
    """What each example's candidates are scored against: the self-attention encoder's state with the feature
    rows added (u [E, D],), or the mean encoder's history mean h [E, D] and its first layer's per-example term
    (h and the features are the same for every candidate of an example, so their product is taken once)."""
    D = config.dim
    table, whole = rows[index.item], sparse and index.item_ids is None
    if config.attention:
        u = encode(config, dense, table, index.window, index.keys, whole)
        for name in config.features:
            u = u + rows_at(rows[name], index.features[name], sparse)
        return (u,)
    h = bag_mean(table, index.history, index.offsets, whole)
    w0 = dense["mlp.0.weight"]
    per_example = torch.addmm(dense["mlp.0.bias"], h, w0[:D])
    for k, name in enumerate(config.features):
        f = rows_at(rows[name], index.features[name], sparse)
        per_example = per_example + f @ w0[(3 + k) * D : (4 + k) * D]
    return h, per_example


def candidate_scores(config: ModelConfig, dense: Tensors, state: UserState, t: torch.Tensor) -> torch.Tensor:
    """Logits [E, C] of candidate rows `t`: [E, C, D], each example's own, or [C, D], the same C for every
    example (a block of the whole catalog: shardflow.model.ranking; computed in place, not differentiable)."""
    if config.attention:
        (u,) = state
        return u @ t.T if t.dim() == 2 else torch.bmm(t, u[:, :, None]).squeeze(-1)
    D = config.dim
    h, per_example = state
    w0 = dense["mlp.0.weight"]
    if t.dim() == 2:
        return _shared_candidate_scores(config, dense, h, per_example, t)
    z = torch.cat([t, h[:, None, :] * t], dim=2) @ w0[D : 3 * D] + per_example[:, None, :]
    for i in range(1, len(config.layers)):
        z = torch.relu(z) @ dense[f"mlp.{i}.weight"] + dense[f"mlp.{i}.bias"]
    return z.squeeze(-1)


def _shared_candidate_scores(config: ModelConfig, dense: Tensors, h: torch.Tensor, per_example: torch.Tensor,
                             t: torch.Tensor) -> torch.Tensor:
    """The mean encoder's logits [E, C] of the same C rows for every example: [t, h * t] @ w0[D:3D] is t @ (w0[D:2D]
    + diag(h) w0[2D:3D]), one [D, width] matrix per example; every later step in place. A block of scores is
    memory-bound: in place and in tiles of 32 users × 512 rows (shardflow.model.ranking), 5.3 M (user, item)
    pairs a second on one core here, against 1.5 M out of place at 128 × 2,048 (dim 64, MLP 64-32)."""
    D = config.dim
    w0 = dense["mlp.0.weight"]
    z = torch.matmul(t, w0[D : 2 * D][None] + h[:, :, None] * w0[2 * D : 3 * D][None])  # [E, C, width]
    z.add_(per_example[:, None, :])
    E, C = z.shape[:2]
    for i in range(1, len(config.layers)):
        z = torch.addmm(dense[f"mlp.{i}.bias"], z.relu_().view(E * C, -1), dense[f"mlp.{i}.weight"])
    return z.view(E, C)
