"""Embedding lookups, one function for both models (and one for bags, the means of token sequences): the
reference's whole tables with sparse gradients, or a trainer's pulled rows with a dense gradient taken by one
index_add.

On CPU, autograd's backward of `F.embedding` and of `index_select` costs 100–175 µs per lookup of 1,024 rows of
dim 64 on one thread (torch 2.14: a sort, or a scatter_add over an expanded index), where `index_add_` into
zeros takes 23–42 µs (tables of 2–1,682 rows) from a contiguous gradient. A trainer makes one lookup per table
per step: on MovieLens' nine tables, a 1-device step's forward and backward went from 9.1 to 7.1 ms. On CUDA
the lookups stay `F.embedding`'s, whose backward is deterministic where `index_add_`'s atomics are not.

The same holds for the mean of a bag, whose dense backward in `F.embedding_bag` sorts the ids: dividing each
bag's gradient by its count, selecting it per id and adding it up by one index_add took a bundled-log batch's
history (4,096 bags, 30,700 ids into 17,370 pulled rows of dim 64) from 5.66 to 4.54 ms forward and backward
(one CPU thread, medians of 25 alternated rounds; minima 3.82 and 2.88).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


class _Gather(torch.autograd.Function):
    """rows[at] ([*at.shape, dim]); the gradient of `rows` summed by one index_add (same shape as `rows`)."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(at)
        ctx.rows = rows.shape
        return rows.index_select(0, at.reshape(-1)).view(*at.shape, rows.shape[1])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (at,) = ctx.saved_tensors
        out = grad.new_zeros(ctx.rows)
        # A strided source (a slice of the stacked vectors' gradient) sends index_add_ down a scatter_add 4-5x
        # slower than copying it first (200 against 41-59 µs for 1,024 rows of dim 64).
        out.index_add_(0, at.reshape(-1), grad.reshape(-1, ctx.rows[1]).contiguous())
        return out, None


class _BagMean(torch.autograd.Function):
    """The mean of rows[ids[offsets[e]:offsets[e + 1]]] for each bag e ([bags, dim]; zero for an empty bag); the
    gradient of `rows` by one index_add."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, ids: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(ids, offsets)
        ctx.rows = rows.shape
        return F.embedding_bag(ids, rows, offsets, mode="mean")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        ids, offsets = ctx.saved_tensors
        counts = torch.diff(offsets, append=offsets.new_tensor([ids.numel()]))
        bag = torch.repeat_interleave(torch.arange(offsets.numel(), device=ids.device), counts)
        share = grad / counts.clamp(min=1).to(grad.dtype)[:, None]
        out = grad.new_zeros(ctx.rows)
        out.index_add_(0, ids, share.index_select(0, bag))
        return out, None, None


def bag_mean(rows: torch.Tensor, ids: torch.Tensor, offsets: torch.Tensor, sparse: bool = False) -> torch.Tensor:
    """Each bag's mean row ([bags, dim]): bag e holds ids[offsets[e]:offsets[e + 1]] (the last to the end), an
    empty one gives zero. `sparse` as in rows_at."""
    if sparse or rows.device.type != "cpu":
        return F.embedding_bag(ids, rows, offsets, mode="mean", sparse=sparse)
    return _BagMean.apply(rows, ids, offsets)


def rows_at(rows: torch.Tensor, at: torch.Tensor, sparse: bool = False) -> torch.Tensor:
    """The rows of `rows` at `at` ([*at.shape, dim]). `sparse`: `rows` is a whole table (the reference)
    and its gradient a sparse tensor; otherwise a trainer's pulled rows, whose gradient is dense."""
    if sparse or rows.device.type != "cpu":
        return F.embedding(at, rows, sparse=sparse)
    return _Gather.apply(rows, at)

