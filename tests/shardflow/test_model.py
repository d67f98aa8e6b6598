"""The hand-written backward against central finite differences, in float64."""

from __future__ import annotations

import numpy as np
import pytest

from shardflow.model import BatchIndex, ModelConfig, forward_backward, init_dense, init_rows, scores
from shardflow.optim import DenseOptimizer, OptimizerConfig, row_adagrad

CONFIG = ModelConfig(dim=4, mlp=(5, 3), history=3, negatives=2, features=("genre",), seed=3)


def _problem():
    rng = np.random.default_rng(0)
    dense = {k: v.astype(np.float64) for k, v in init_dense(CONFIG).items()}
    rows = {
        "item": rng.normal(size=(6, 4)),
        "genre": rng.normal(size=(3, 4)),
    }
    index = BatchIndex(
        history=np.array([[-1, 0, 1], [2, 3, 3], [-1, -1, 5]]),
        candidates=np.array([[2, 4, 5], [0, 1, 2], [3, 3, 0]]),
        features={"genre": np.array([0, 2, 2])},
    )
    return dense, rows, index


def _loss(dense, rows, index) -> float:
    return forward_backward(np, CONFIG, dense, rows, index, "item", norm=7).loss_sum / 7


@pytest.mark.parametrize("which", ["dense", "item", "genre"])
def test_gradients_match_finite_differences(which):
    dense, rows, index = _problem()
    grads = forward_backward(np, CONFIG, dense, rows, index, "item", norm=7)
    targets = dense if which == "dense" else {which: rows[which]}
    analytic = grads.dense if which == "dense" else {which: grads.rows[which]}
    eps = 1e-6
    for name, param in targets.items():
        numeric = np.zeros_like(param)
        for i in np.ndindex(param.shape):
            keep = param[i]
            param[i] = keep + eps
            up = _loss(dense, rows, index)
            param[i] = keep - eps
            down = _loss(dense, rows, index)
            param[i] = keep
            numeric[i] = (up - down) / (2 * eps)
        np.testing.assert_allclose(analytic[name], numeric, rtol=1e-5, atol=1e-8, err_msg=name)
        assert np.abs(numeric).max() > 1e-4, f"{name}: a gradient this small checks nothing"


def test_padding_is_masked_and_scores_are_the_forward():
    dense, rows, index = _problem()
    before = scores(np, CONFIG, dense, rows, index, "item")
    rows["item"][0] += 100.0  # row 0 is read only by example 0's history and example 1's candidate
    after = scores(np, CONFIG, dense, rows, index, "item")
    np.testing.assert_array_equal(before[2, :2], after[2, :2])  # example 2 never reads row 0 except candidate 2
    assert not np.allclose(before[0], after[0])


def test_init_rows_depend_only_on_table_id_and_seed():
    a = init_rows("item", np.array([5, 9, 5]), 8, seed=1)
    assert a.dtype == np.float32 and a.shape == (3, 8)
    np.testing.assert_array_equal(a[0], a[2])
    np.testing.assert_array_equal(a[1], init_rows("item", np.array([9]), 8, seed=1)[0])
    assert not np.array_equal(a[1], init_rows("genre", np.array([9]), 8, seed=1)[0])
    assert not np.array_equal(a[1], init_rows("item", np.array([9]), 8, seed=2)[0])
    assert np.abs(a).max() <= 1 / np.sqrt(8)


def test_row_adagrad_and_dense_optimizers_descend():
    w = np.ones((3, 2), dtype=np.float32)
    state = np.zeros(3, dtype=np.float32)
    row_adagrad(np, OptimizerConfig(row_lr=0.1), w, state, np.array([2, 0]), np.array([[1, 1], [-2, 0]], np.float32))
    np.testing.assert_allclose(state, [2.0, 0, 1.0])
    np.testing.assert_allclose(w, [[1 + 0.1 * 2 / np.sqrt(2), 1], [1, 1], [0.9, 0.9]], rtol=1e-6)
    for kind in ("adam", "adagrad"):
        p = {"x": np.array([3.0, -2.0], dtype=np.float32)}
        opt = DenseOptimizer(np, OptimizerConfig(dense=kind, dense_lr=0.1), p)
        for _ in range(50):
            opt.step(p, {"x": 2 * p["x"]})
        assert float((p["x"] ** 2).sum()) < 0.5 * 13.0, kind  # from 3² + 2²


def test_initial_rows_do_not_depend_on_the_block_they_are_made_in(monkeypatch):
    import shardflow.model as model_module

    ids = np.random.default_rng(1).integers(0, 10**9, 1000)
    whole = model_module.init_rows("item", ids, 7, 3)
    monkeypatch.setattr(model_module, "INIT_BLOCK_VALUES", 50)  # 7 rows a block, the last one partial
    assert model_module.init_rows("item", ids, 7, 3).tobytes() == whole.tobytes()
    assert [model_module.init_rows("item", ids[i : i + 1], 7, 3).tobytes() for i in (0, 999)] == [
        whole[0:1].tobytes(), whole[999:1000].tobytes()]
    assert whole.dtype == np.float32 and np.abs(whole).max() <= 1 / np.sqrt(7)
