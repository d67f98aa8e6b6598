"""A sub-batch through either model: its index as tensors on a device, its logits, and its loss and gradients.

The engine, the reference trainer and the evaluation hold one model's config (shardflow.model.configs: a
ModelConfig or a ClickConfig) and that model's index of a sub-batch (a BatchIndex or a ClickIndex); this module
hands each to its model's arithmetic (shardflow.model.sequence, shardflow.model.dlrm), so nothing above it asks
which model runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from shardflow.model import dlrm, sequence
from shardflow.model.configs import BatchIndex, ClickConfig, ClickIndex, ModelConfig
from shardflow.model.tensors import Tensors

Config = ModelConfig | ClickConfig


def on_device(index: BatchIndex | ClickIndex, device: torch.device) -> Any:
    """The sub-batch's index as tensors on `device` (sequence.TensorIndex or dlrm.ClickTensorIndex)."""
    if isinstance(index, ClickIndex):
        return dlrm.tensor_index(index, device)
    return sequence.tensor_index(index, device)


def logits(config: Config, dense: Tensors, rows: Tensors, index: Any, sparse: bool = False) -> torch.Tensor:
    """Logits of the sub-batch whose index (on_device's) is `index`: [E, 1 + K] for the sequence model, [E] for
    the DLRM. `rows` maps table -> the rows the trainer holds (`sparse`: whole tables, sparse gradients)."""
    if isinstance(config, ClickConfig):
        return dlrm.logits(config, dense, rows, index, sparse)
    return sequence.scores(config, dense, rows, index, sparse)


def loss_sum(config: Config, logit: torch.Tensor, index: Any) -> torch.Tensor:
    """The summed loss of `logits`' logits."""
    if isinstance(config, ClickConfig):
        return dlrm.loss_sum(logit, index)
    return sequence.loss_sum(config, logit, index)


@dataclass
class Gradients:
    loss_sum: float  # summed loss of the sub-batch (not divided by norm)
    dense: Tensors  # name -> tensor like the parameter
    rows: Tensors  # table -> gradient of the rows passed ([rows, dim], or sparse with sparse=True)


def forward_backward(config: Config, dense: Tensors, rows: Tensors, index: Any, norm: int,
                     sparse: bool = False) -> Gradients:
    """Loss and gradients of a sub-batch of either model; `rows` maps table -> the rows the trainer holds.

    Neither `dense` nor `rows` is modified: autograd runs on detached leaves of them.
    """
    leaves_dense = {k: v.detach().requires_grad_(True) for k, v in dense.items()}
    leaves_rows = {k: v.detach().requires_grad_(True) for k, v in rows.items()}
    logit = logits(config, leaves_dense, leaves_rows, index, sparse)
    total = loss_sum(config, logit, index)
    grads = torch.autograd.grad(total / norm, [*leaves_dense.values(), *leaves_rows.values()])
    n = len(leaves_dense)
    return Gradients(
        loss_sum=float(total.detach()),
        dense=dict(zip(leaves_dense, grads[:n], strict=True)),
        rows=dict(zip(leaves_rows, grads[n:], strict=True)),
    )
