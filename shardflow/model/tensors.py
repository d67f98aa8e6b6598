"""The values the models pass around, named once: tensors by name and a user's state."""

from __future__ import annotations

from typing import TypeAlias

import torch

# name -> tensor: the dense parameters, a table's rows by table name, or their gradients.
Tensors: TypeAlias = dict[str, torch.Tensor]
# What user_state gives candidate_scores: (u,) for self-attention, (h, per_example) for the mean encoder.
UserState: TypeAlias = tuple[torch.Tensor, ...]
