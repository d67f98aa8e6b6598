"""The self-attentive sequence encoder (SASRec: Kang & McAuley, ICDM 2018), as dense parameters.

An example's history window x_1..x_L (left-padded, x_L the most recent item) becomes:

    e_i = item row(x_i) * sqrt(dim) + P_i               learned positions; dropout; padded positions zeroed
    per block b = 1..blocks:
        q   = LN(e)                                      (queries only, as the paper's code normalises them)
        a   = causal multi-head attention(q, e, e)       position i attends to j <= i, never to padding;
                                                         dropout on the attention weights; no key bias
                                                         (it shifts a query's scores alike: softmax cancels it)
        e   = LN(q + a)
        e   = e + dropout(W2 · relu(dropout(W1 · e)))    point-wise feed-forward, residual; padding zeroed
    u = LN(e_L) + sum of the target event's feature rows
    logit(candidate t) = u · item row(t)                 the shared item table scores the next item

Training is the paper's objective, one target at a time: every training example is one position
of a user's sequence (its target) with the window before it, scored against the positive and
sampled negatives with binary cross-entropy. The paper computes all positions of a sequence in
one pass; here each position is its own example, so sub-batches split anywhere, and an example
reads one state, its last position's: the last block computes only that position's query,
attention and feed-forward (the earlier blocks, and every block's keys and values, all positions).

Dropout is a function of the example, not of the process: a training example carries a 64-bit
key (shardflow.data.examples), and a dropout site's keep-mask for it is
frac(U[a] + U[b]) >= rate, with U a table of MASK_BANK seeded uniform rows and a, b picked by a
hash of (key, site). So every trainer, and the single-process reference, drops the same units
of an example whichever sub-batch it falls in, and the distributed model stays exact.
Evaluation examples carry no key: no dropout.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

from shardflow.hashing import splitmix64
from shardflow.model.lookup import rows_at
from shardflow.model.tensors import Tensors

if TYPE_CHECKING:
    from shardflow.model.configs import ModelConfig

MASK_BANK = 1024  # rows of seeded uniforms a dropout mask is drawn from (two per example and site)
NORM_EPS = 1e-8  # the paper's code's layer-norm epsilon


@lru_cache(maxsize=8)
def _bank(seed: int, width: int, device: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(int(splitmix64(np.array([seed ^ 0x5A5A], dtype=np.uint64))[0] >> np.uint64(1)))
    return torch.rand((MASK_BANK, width), generator=g).to(device)


def dropout(x: torch.Tensor, keys: np.ndarray | None, site: int, rate: float, seed: int,
            whole: tuple[int, ...] | None = None) -> torch.Tensor:
    """x [E, ...] with each example's units dropped (and the rest scaled by 1 / (1 - rate)) by its key. `whole`:
    x is the last position (x [E, ..., 1, W]) of an example's units shaped `whole` ([..., L, W]), and is dropped
    as that position of the whole would be."""
    if keys is None or rate == 0.0 or x.shape[0] == 0:
        return x
    bank = _bank(seed, math.prod(whole or x.shape[1:]), str(x.device))
    if whole is not None:
        bank = bank[:, _last_position(whole, x.device)]
    with np.errstate(over="ignore"):
        mixed = splitmix64(keys.astype(np.uint64) ^ splitmix64(np.array([site], dtype=np.uint64)))
        picks = np.stack([mixed, splitmix64(mixed)]) % np.uint64(MASK_BANK)
    a, b = (torch.from_numpy(p.astype(np.int64)).to(x.device) for p in picks)
    keep = torch.frac(bank[a] + bank[b]) >= rate
    return x * keep.view(x.shape).to(x.dtype) / (1.0 - rate)


def _last_position(whole: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Where the units of the last position (axis -2) of a [..., L, W] shape sit among its flattened units."""
    L, W = whole[-2:]
    lead = torch.arange(math.prod(whole[:-2]), device=device)[:, None] * (L * W)
    return (lead + (L - 1) * W + torch.arange(W, device=device)[None]).reshape(-1)


def _norm(x: torch.Tensor, dense: Tensors, name: str) -> torch.Tensor:
    return F.layer_norm(x, x.shape[-1:], dense[f"{name}.weight"], dense[f"{name}.bias"], NORM_EPS)


def _linear(x: torch.Tensor, dense: Tensors, name: str) -> torch.Tensor:
    return x @ dense[f"{name}.weight"] + dense[f"{name}.bias"]


def encode(config: ModelConfig, dense: Tensors, items: torch.Tensor, window: torch.Tensor, keys: np.ndarray | None,
           sparse: bool) -> torch.Tensor:
    """The user's state [E, dim] after the most recent item of each window ([E, L] row index, -1 padding).

    Only the last position's state is read, so the last block computes its queries, attention and feed-forward
    at that position alone (every position is a key and value): a [1, L] attention, not [L, L], and 1 / L of
    the block's projections. Its dropout masks are the last position's of the whole block's (dropout `whole`)."""
    E, L = window.shape
    D, H, rate = config.dim, config.heads, config.dropout
    valid = window >= 0
    e = rows_at(items, window.clamp(min=0), sparse) * math.sqrt(D) + dense["attention.position"]
    site = 0

    def drop(t: torch.Tensor, whole: tuple[int, ...] | None) -> torch.Tensor:
        nonlocal site
        site += 1
        return dropout(t, keys, site, rate, config.seed, whole)

    e = drop(e, None) * valid[..., None]
    # Position i attends to j <= i that is not padding, and always to itself (a padded query then has a
    # finite softmax; its output is zeroed and no real position attends to it).
    causal = torch.ones(L, L, dtype=torch.bool, device=window.device).tril()
    allowed = (causal[None] & valid[:, None, :]) | torch.eye(L, dtype=torch.bool, device=window.device)[None]
    blocked = ~allowed[:, None]  # [E, 1, L, L]
    for b in range(config.blocks):
        p = f"attention.{b}"
        last = b == config.blocks - 1
        n = 1 if last else L  # the positions whose state this block computes: the last n
        q = _norm(e[:, L - n :], dense, f"{p}.norm1")

        def split(t: torch.Tensor) -> torch.Tensor:  # [E, H, positions, D/H]
            return t.view(E, t.shape[1], H, D // H).transpose(1, 2)

        Q, K, V = split(_linear(q, dense, f"{p}.query")), split(e @ dense[f"{p}.key.weight"]), \
            split(_linear(e, dense, f"{p}.value"))
        scores = (Q @ K.transpose(2, 3) / math.sqrt(D // H)).masked_fill(blocked[:, :, L - n :], float("-inf"))
        weights = drop(torch.softmax(scores, -1), (H, L, L) if last else None)
        a = (weights @ V).transpose(1, 2).reshape(E, n, D)
        e = _norm(q + _linear(a, dense, f"{p}.out"), dense, f"{p}.norm2")
        whole = (L, D) if last else None
        e = e + drop(_linear(torch.relu(drop(_linear(e, dense, f"{p}.ffn1"), whole)), dense, f"{p}.ffn2"), whole)
        e = e * valid[:, L - n :, None]
    return _norm(e[:, -1], dense, "attention.norm")
