"""The values the models pass around, named once: tensors by name, a user's state, and a scorer."""

from __future__ import annotations

from typing import Any, Protocol, TypeAlias

import torch

# name -> tensor: the dense parameters, a table's rows by table name, or their gradients.
Tensors: TypeAlias = dict[str, torch.Tensor]
# What user_state gives candidate_scores: (u,) for self-attention, (h, per_example) for the mean encoder.
UserState: TypeAlias = tuple[torch.Tensor, ...]


class Scorer(Protocol):
    """What forward_backward takes of either model's config (sequence.ModelConfig, dlrm.ClickConfig): a
    sub-batch's logits from its index (the model's own index type), and their summed loss."""

    def logits(self, dense: Tensors, rows: Tensors, index: Any, sparse: bool = False) -> torch.Tensor: ...

    def loss_sum(self, logit: torch.Tensor, index: Any) -> torch.Tensor: ...
