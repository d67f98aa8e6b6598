"""The click-log DLRM (Naumov et al., 2019) in PyTorch, beside the sequence model of shardflow.model.sequence.

One example: the numeric columns x (Criteo's I1..I13; none in Avazu's layout) and one id
per categorical table, or for a table of token sequences (RecBole's token_seq: genres)
the ids the example holds. With b = bottom MLP(log(1 + max(x, 0))) of width dim (ReLU
after every layer) and e_1..e_T the examples' rows of the T tables (the mean of the rows
held for a table of token sequences, zero when it holds none):

    v = [b, e_1, ..., e_T]                 (n = T + 1 vectors; n = T without numeric columns)
    z = [b, <v_i, v_j> for i < j]          (every pairwise dot product, the DLRM "dot" interaction)
    logit = top MLP(z)                     (ReLU hidden layers, one output)
    loss = binary cross-entropy against the click label

A missing numeric value counts as 0. As in the sequence model, a trainer passes the
rows it pulled for its sub-batch and indices into them (ClickIndex; it and the config,
ClickConfig, are in shardflow.model.configs, which imports no PyTorch); the reference
passes whole tables and takes sparse gradients. Dense weights are stored [in, out].
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from shardflow.model.configs import FUSED, ClickConfig, ClickIndex
from shardflow.model.lookup import bag_mean, rows_at
from shardflow.model.tensors import Tensors


def logits(config: ClickConfig, dense: Tensors, rows: Tensors, index: ClickTensorIndex,
           sparse: bool = False) -> torch.Tensor:
    """Logits [E] of the DLRM."""
    head = []
    if config.numeric:
        b = index.numeric
        for i in range(len(config.bottom_layers)):
            b = torch.relu(torch.addmm(dense[f"bottom.{i}.bias"], b, dense[f"bottom.{i}.weight"]))
        head = [b]
    if index.fused is None:
        v = torch.stack([*head, *(table_vectors(rows[t], index.features[t], sparse) for t in config.features)],
                        dim=1)  # [E, n, dim]
    else:
        v = _fused_vectors(head, rows, index, sparse)
    n = v.shape[1]
    i, j = torch.triu_indices(n, n, offset=1, device=v.device)
    # The pairs i < j of the [E, n, n] dot products, taken from its flat view: an index_select, whose
    # backward is an index_add (1.7x faster than indexing [:, i, j] on CPU, forward and backward).
    pairs = _Gram.apply(v).flatten(1).index_select(1, i * n + j)
    z = torch.cat([*head, pairs], dim=1)
    top = len(config.top_layers)
    for k in range(top):
        z = torch.addmm(dense[f"top.{k}.bias"], z, dense[f"top.{k}.weight"])
        if k < top - 1:
            z = torch.relu(z)
    return z.squeeze(-1)


def _fused_vectors(head: list[torch.Tensor], rows: Tensors, index: ClickTensorIndex,
                   sparse: bool) -> torch.Tensor:
    """[E, n, dim] as `logits` stacks it, from rows fused into one tensor (rows[FUSED]): the tables of
    `index.fused` read by one gather, the others (bags, and tables not fused, from rows of their own) one by
    one, then put in the model's order."""
    assert index.fused is not None and index.order is not None  # logits calls it only then
    fused = rows_at(rows[FUSED], index.fused, sparse)  # [E, tables fused, dim]
    rest = [table_vectors(rows.get(t, rows[FUSED]), at, sparse) for t, at in index.features.items()]
    v = torch.cat([*(x[:, None] for x in head), fused, *(x[:, None] for x in rest)], dim=1)
    return v if index.order.numel() == 0 else v.index_select(1, index.order)


def loss_sum(logit: torch.Tensor, index: ClickTensorIndex) -> torch.Tensor:
    """The summed binary cross-entropy of logits [E] against the examples' labels."""
    return F.binary_cross_entropy_with_logits(logit, index.labels, reduction="sum")


class _Gram(torch.autograd.Function):
    """v v^T ([E, n, n]) of v [E, n, dim], its gradient by one batched product: (G + G^T) v.

    Autograd's backward of bmm(v, v^T) makes two products, one of them v^T G ([E, dim, n]), which MKL runs
    4x slower than G v on one CPU thread (torch 2.14: 1.06 against 0.28 ms at E 1,024, n 10, dim 64); the
    interaction's forward and backward went from 2.5 to 1.05 ms there."""

    @staticmethod
    def forward(ctx: Any, v: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(v)
        return torch.bmm(v, v.transpose(1, 2))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (v,) = ctx.saved_tensors
        return torch.bmm(grad + grad.transpose(1, 2), v)


def table_vectors(rows: torch.Tensor, at: torch.Tensor | Bags, sparse: bool) -> torch.Tensor:
    """[E, dim]: each example's row of a table, or the mean of the rows its token sequence holds (zero when
    it holds none). `sparse`: `rows` is the whole table (the reference) and its gradient sparse; otherwise
    a trainer's pulled rows (shardflow.model.lookup)."""
    if isinstance(at, Bags):
        return bag_mean(rows, at.ids, at.offsets, sparse)
    return rows_at(rows, at, sparse)


def tensor_index(index: ClickIndex, device: torch.device) -> ClickTensorIndex:
    """`index` as tensors on `device`, a table of token sequences as its Bags."""
    def tensor(v: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(v, dtype=np.int64)).to(device)

    return ClickTensorIndex(
        features={k: tensor(v) if v.ndim == 1 else Bags.of(v, tensor) for k, v in index.features.items()},
        numeric=torch.from_numpy(np.ascontiguousarray(index.numeric, dtype=np.float32)).to(device),
        labels=torch.from_numpy(np.ascontiguousarray(index.labels, dtype=np.float32)).to(device),
        fused=None if index.fused is None else tensor(index.fused),
        order=None if index.order is None else tensor(index.order),
    )


@dataclass(frozen=True)
class Bags:
    """The rows of a table of token sequences each example holds, as embedding_bag takes them: example e holds
    ids[offsets[e]:offsets[e + 1]] (the last to the end)."""

    ids: torch.Tensor
    offsets: torch.Tensor

    @classmethod
    def of(cls, padded: np.ndarray, tensor: Callable[[np.ndarray], torch.Tensor]) -> Bags:
        held = padded >= 0
        counts = held.sum(axis=1)
        return cls(tensor(padded[held]), tensor(np.cumsum(counts) - counts))


@dataclass
class ClickTensorIndex:
    features: dict[str, torch.Tensor | Bags]  # table -> int64 tensor [E], or its Bags
    numeric: torch.Tensor
    labels: torch.Tensor
    fused: torch.Tensor | None = None
    order: torch.Tensor | None = None
