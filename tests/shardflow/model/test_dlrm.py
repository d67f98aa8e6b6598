"""The click-log DLRM against a plain per-example computation, its gradients against finite differences."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shardflow.errors import InputError
from shardflow.model.configs import ClickConfig, ClickIndex, numeric_input
from shardflow.model.forward import forward_backward, logits, on_device
from support import numeric_gradient

CPU = torch.device("cpu")
WITH_NUMERIC = ClickConfig(dim=3, bottom=(4,), mlp=(5,), features=("a", "b"), numeric=("I1", "I2"), seed=2)
WITHOUT = ClickConfig(dim=3, mlp=(4, 2), features=("a", "b", "c"), seed=5)
# "g" a table of token sequences (genres): up to 3 ids an example, -1 padding; one example holds none, one a repeat.
# Seed 7: no example's bottom MLP output sits at ReLU's kink (seed 3 leaves two examples' hidden units all 0).
WITH_SEQUENCE = ClickConfig(dim=3, bottom=(4,), mlp=(5,), features=("a", "g"), numeric=("I1", "I2"), seed=7)
SEQUENCE = np.array([[0, 2, -1], [-1, -1, -1], [1, 1, 3], [4, -1, -1]])


def _problem(config):
    rng = np.random.default_rng(1)
    dense = {k: torch.from_numpy(v.astype(np.float64)) for k, v in config.init_dense().items()}
    rows = {t: torch.from_numpy(rng.normal(size=(4 + k, config.dim))) for k, t in enumerate(config.features)}
    raw = np.array([[3.0, np.nan], [0.0, 120.0], [-2.0, 7.0], [1.0, 1.0]], dtype=np.float32)[:, : len(config.numeric)]
    index = ClickIndex(
        features={t: SEQUENCE if t == "g" else np.array([0, 3, 1, 3]) for t in config.features},
        numeric=numeric_input(raw).astype(np.float64),
        labels=np.array([1.0, 0.0, 0.0, 1.0]),
    )
    return dense, rows, index


def _tensor_index(index):
    on = on_device(index, CPU)
    on.numeric, on.labels = on.numeric.double(), on.labels.double()
    return on


def row_or_mean(table: np.ndarray, at) -> np.ndarray:
    """An example's row, or for a token sequence the mean of the rows it holds (zero when none)."""
    if np.ndim(at) == 0:
        return table[at]
    held = [table[i] for i in at if i >= 0]
    return np.mean(held, axis=0) if held else np.zeros(table.shape[1])


def _plain_logits(config, dense, rows, index) -> np.ndarray:
    """Each example on its own: the bottom MLP, every pairwise dot product i < j, the top MLP."""
    d = {k: v.numpy() for k, v in dense.items()}
    out = []
    for e in range(index.labels.size):
        vectors, head = [row_or_mean(rows[t].numpy(), index.features[t][e]) for t in config.features], []
        if config.numeric:
            b = index.numeric[e]
            for i in range(len(config.bottom_layers)):
                b = np.maximum(b @ d[f"bottom.{i}.weight"] + d[f"bottom.{i}.bias"], 0)
            vectors, head = [b, *vectors], [b]
        pairs = [vectors[i] @ vectors[j] for i in range(len(vectors)) for j in range(i + 1, len(vectors))]
        z = np.concatenate([*head, pairs])
        for k in range(len(config.top_layers)):
            z = z @ d[f"top.{k}.weight"] + d[f"top.{k}.bias"]
            if k < len(config.top_layers) - 1:
                z = np.maximum(z, 0)
        out.append(z[0])
    return np.array(out)


@pytest.mark.parametrize("config", [WITH_NUMERIC, WITHOUT, WITH_SEQUENCE],
                         ids=["numeric", "categorical-only", "token-sequence"])
def test_the_forward_is_the_plain_per_example_model(config):
    dense, rows, index = _problem(config)
    fast = logits(config, dense, rows, _tensor_index(index)).numpy()
    np.testing.assert_allclose(fast, _plain_logits(config, dense, rows, index), rtol=1e-12, atol=1e-12)
    assert fast.shape == (4,) and np.ptp(fast) > 0


def test_layer_shapes_follow_the_tables_and_the_numeric_columns():
    shapes = WITH_NUMERIC.dense_shapes()
    assert shapes["bottom.0.weight"] == (2, 4) and shapes["bottom.1.weight"] == (4, 3)
    assert shapes["top.0.weight"] == (3 + 3, 5)  # b and the 3 pairs of [b, a, b]
    assert WITHOUT.dense_shapes()["top.0.weight"] == (3, 4) and not WITHOUT.bottom_layers  # 3 pairs of [a, b, c]
    assert list(WITH_NUMERIC.init_dense()) == list(shapes)


def _loss(config, dense, rows, index) -> float:
    logit = logits(config, dense, rows, _tensor_index(index)).numpy()
    return float((np.logaddexp(0, logit) - index.labels * logit).sum()) / 9


@pytest.mark.parametrize("config, which", [(WITH_NUMERIC, "dense"), (WITH_NUMERIC, "a"), (WITH_NUMERIC, "b"),
                                           (WITH_SEQUENCE, "dense"), (WITH_SEQUENCE, "g")])
def test_gradients_match_finite_differences(config, which):
    dense, rows, index = _problem(config)
    grads = forward_backward(config, dense, rows, _tensor_index(index), norm=9)
    targets = dense if which == "dense" else {which: rows[which]}
    analytic = grads.dense if which == "dense" else {which: grads.rows[which]}
    for name, param in targets.items():
        numeric = numeric_gradient(param, lambda: _loss(config, dense, rows, index))
        np.testing.assert_allclose(analytic[name].numpy(), numeric, rtol=1e-5, atol=1e-8, err_msg=name)
    assert grads.loss_sum == pytest.approx(_loss(config, dense, rows, index) * 9, rel=1e-12)


def test_numeric_input_is_log1p_of_the_non_negative_part_with_missing_as_zero():
    np.testing.assert_allclose(numeric_input(np.array([np.nan, -3.0, 0.0, np.e - 1])), [0, 0, 0, 1], rtol=1e-6)


@pytest.mark.parametrize("bad, fragment", [
    ({"dim": 0}, "dim = 0"), ({"bottom": (4, 0)}, "bottom widths = [4, 0]"), ({"features": ()}, "at least one table"),
])
def test_bad_configs_are_refused_by_name(bad, fragment):
    with pytest.raises(InputError, match=fragment.replace("[", r"\[").replace("]", r"\]")):
        ClickConfig(**{"features": ("a",), **bad})


@pytest.mark.parametrize("config", [WITH_NUMERIC, WITH_SEQUENCE], ids=["numeric", "token-sequence"])
def test_sparse_gradients_of_whole_tables_equal_the_dense_ones(config):
    dense, rows, index = _problem(config)
    plain = forward_backward(config, dense, rows, _tensor_index(index), norm=9)
    sparse = forward_backward(config, dense, rows, _tensor_index(index), norm=9, sparse=True)
    for t in rows:
        assert sparse.rows[t].is_sparse and not plain.rows[t].is_sparse
        np.testing.assert_allclose(sparse.rows[t].to_dense().numpy(), plain.rows[t].numpy(), rtol=1e-12, atol=1e-15)
    assert sparse.loss_sum == plain.loss_sum
