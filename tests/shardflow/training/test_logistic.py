"""The regression's fit matrix: its product with the weights is the regression's logits."""

from __future__ import annotations

import numpy as np
import torch

from shardflow.data.clicks import Clicks
from shardflow.training.logistic import Logistic, design


def test_the_fit_matrix_times_the_weights_is_the_regressions_logits():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 6, (40, 4))
    tokens[rng.random((40, 4)) < 0.4] = -1  # padding
    tokens[0] = -1  # holds none: contributes 0
    tokens[1] = [2, 2, 5, -1]  # a repeated token counts twice in the mean, as embedding_bag's does
    numeric = rng.normal(size=(40, 3)).astype(np.float32)
    numeric[rng.random((40, 3)) < 0.2] = np.nan  # missing: 0
    ex = Clicks(ids={"user": rng.integers(0, 9, 40), "genres": tokens}, numeric=numeric,
                labels=rng.integers(0, 2, 40).astype(np.float32))
    weights = torch.from_numpy(rng.normal(size=19))
    model = Logistic(weights={"user": weights[:9], "genres": weights[9:15]}, linear=weights[15:18], bias=weights[18:])
    x = design(ex, ("user", "genres"), [9, 6])
    assert x.shape == (40, 18)
    np.testing.assert_allclose(x @ weights[:18].numpy() + weights[18].item(), model.logits(ex).numpy(), rtol=1e-12)
