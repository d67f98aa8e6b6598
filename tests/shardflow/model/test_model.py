"""The PyTorch model against a plain per-candidate computation, its gradients against finite differences."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shardflow.errors import InputError
from shardflow.model.configs import ROW_LR, BatchIndex, ModelConfig, OptimizerConfig
from shardflow.model.forward import forward_backward, on_device
from shardflow.model.optim import DenseOptimizer, row_adagrad, row_adam
from shardflow.model.sequence import init_rows, scores
from shardflow.planner.sharding_plan import row_bytes
from support import bce_loss, numeric_gradient

CONFIG = ModelConfig(dim=4, mlp=(5, 3), history=3, negatives=2, features=("genre",), seed=3)
CPU = torch.device("cpu")


def _problem():
    rng = np.random.default_rng(0)
    dense = {k: torch.from_numpy(v.astype(np.float64)) for k, v in CONFIG.init_dense().items()}
    rows = {"item": torch.from_numpy(rng.normal(size=(6, 4))), "genre": torch.from_numpy(rng.normal(size=(3, 4)))}
    index = BatchIndex(
        item="item",
        history=np.array([[-1, 0, 1], [2, 3, 3], [-1, -1, 5]]),
        candidates=np.array([[2, 4, 5], [0, 1, 2], [3, 3, 0]]),
        features={"genre": np.array([0, 2, 2])},
    )
    return dense, rows, index


def _plain_logits(dense, rows, index) -> np.ndarray:
    """Every candidate on its own: z = [mean of history rows, t, h * t, genre row] through the MLP."""
    d = {k: v.numpy() for k, v in dense.items()}
    item, genre = rows["item"].numpy(), rows["genre"].numpy()
    out = np.zeros(index.candidates.shape)
    for e, hist in enumerate(index.history):
        h = item[hist[hist >= 0]].mean(axis=0)
        for c, cand in enumerate(index.candidates[e]):
            t = item[cand]
            z = np.concatenate([h, t, h * t, genre[index.features["genre"][e]]]) @ d["mlp.0.weight"] + d["mlp.0.bias"]
            z = np.maximum(z, 0) @ d["mlp.1.weight"] + d["mlp.1.bias"]
            out[e, c] = (np.maximum(z, 0) @ d["mlp.2.weight"] + d["mlp.2.bias"])[0]
    return out


def test_the_forward_is_the_plain_per_candidate_model_with_padding_masked():
    dense, rows, index = _problem()
    fast = scores(CONFIG, dense, rows, on_device(index, CPU)).numpy()
    np.testing.assert_allclose(fast, _plain_logits(dense, rows, index), rtol=1e-12, atol=1e-12)
    rows["item"][0] += 100.0  # row 0: example 0's history, example 1's first and example 2's last candidate
    after = scores(CONFIG, dense, rows, on_device(index, CPU)).numpy()
    np.testing.assert_array_equal(fast[2, :2], after[2, :2])
    assert not np.allclose(fast[0], after[0])


@pytest.mark.parametrize("which", ["dense", "item", "genre"])
def test_gradients_match_finite_differences(which):
    dense, rows, index = _problem()
    grads = forward_backward(CONFIG, dense, rows, on_device(index, CPU), norm=7)
    targets = dense if which == "dense" else {which: rows[which]}
    analytic = grads.dense if which == "dense" else {which: grads.rows[which]}
    for name, param in targets.items():
        numeric = numeric_gradient(param, lambda: bce_loss(CONFIG, dense, rows, index, 7))
        np.testing.assert_allclose(analytic[name].numpy(), numeric, rtol=1e-5, atol=1e-8, err_msg=name)
        assert np.abs(numeric).max() > 1e-4, f"{name}: a gradient this small checks nothing"


def test_sparse_gradients_of_whole_tables_equal_the_dense_ones():
    dense, rows, index = _problem()
    plain = forward_backward(CONFIG, dense, rows, on_device(index, CPU), norm=7)
    sparse = forward_backward(CONFIG, dense, rows, on_device(index, CPU), norm=7, sparse=True)
    for t in rows:
        assert sparse.rows[t].is_sparse
        np.testing.assert_allclose(sparse.rows[t].to_dense().numpy(), plain.rows[t].numpy(), rtol=1e-12, atol=1e-15)


def test_init_rows_depend_only_on_table_id_and_seed():
    a = init_rows("item", np.array([5, 9, 5]), 8, seed=1)
    assert a.dtype == np.float32 and a.shape == (3, 8)
    np.testing.assert_array_equal(a[0], a[2])
    np.testing.assert_array_equal(a[1], init_rows("item", np.array([9]), 8, seed=1)[0])
    assert not np.array_equal(a[1], init_rows("genre", np.array([9]), 8, seed=1)[0])
    assert not np.array_equal(a[1], init_rows("item", np.array([9]), 8, seed=2)[0])
    assert np.abs(a).max() <= 1 / np.sqrt(8)


def test_row_adagrad_and_dense_optimizers_descend():
    w = torch.ones((3, 2))
    state = torch.zeros(3)
    row_adagrad(OptimizerConfig(row_lr=0.1), w, state, torch.tensor([2, 0]), torch.tensor([[1.0, 1], [-2, 0]]))
    np.testing.assert_allclose(state.numpy(), [2.0, 0, 1.0])
    np.testing.assert_allclose(w.numpy(), [[1 + 0.1 * 2 / np.sqrt(2), 1], [1, 1], [0.9, 0.9]], rtol=1e-6)
    for kind in ("adam", "adagrad"):
        p = {"x": torch.tensor([3.0, -2.0])}
        opt = DenseOptimizer(OptimizerConfig(dense=kind, dense_lr=0.1), p)
        for _ in range(50):
            opt.step({"x": 2 * p["x"]})
        assert float((p["x"] ** 2).sum()) < 0.5 * 13.0, kind  # from 3² + 2²


def test_row_adam_updates_each_row_as_torch_adam_would_that_row_alone():
    """Rows read by different steps: each follows torch.optim.Adam over its own gradients, bias-corrected by its
    own count of updates."""
    config = OptimizerConfig(rows="adam", row_lr=0.01)
    rng = np.random.default_rng(0)
    w = torch.from_numpy(rng.normal(size=(4, 3)).astype(np.float32))
    state = torch.zeros((4, 2 * 3 + 1))
    alone = [torch.nn.Parameter(w[r].clone()) for r in range(4)]
    optims = [torch.optim.Adam([p], lr=0.01) for p in alone]
    for step in range(12):
        rows = [r for r in range(4) if (step + 1) % (r + 1) == 0]  # row r in every (r + 1)-th step
        grads = torch.from_numpy(rng.normal(size=(len(rows), 3)).astype(np.float32))
        row_adam(config, w, state, torch.tensor(rows), grads)
        for r, g in zip(rows, grads, strict=True):
            alone[r].grad = g.clone()
            optims[r].step()
    for r in range(4):
        np.testing.assert_allclose(w[r].numpy(), alone[r].detach().numpy(), rtol=1e-5, atol=1e-6)
    assert state[:, -1].tolist() == [12.0, 6.0, 4.0, 3.0]


def test_the_row_optimizer_sets_its_rate_and_what_a_row_costs_and_a_bad_name_is_refused():
    assert OptimizerConfig().row_lr == ROW_LR["adagrad"] == 0.05
    assert OptimizerConfig(rows="adam").row_lr == ROW_LR["adam"]
    assert OptimizerConfig(rows="adam", row_lr=0.1).row_lr == 0.1
    assert row_bytes(64) == 4 * 65 and row_bytes(64, "adam") == 4 * (64 + 129)
    with pytest.raises(InputError, match=r"row optimizer 'sgd'; accepted: adagrad, adam"):
        OptimizerConfig(rows="sgd")


@pytest.mark.parametrize("kind", ["adam", "adagrad"])
def test_a_dense_optimizer_reloaded_from_its_saved_state_continues_bitwise(kind):
    config = OptimizerConfig(dense=kind, dense_lr=0.05)
    grads = [{"x": torch.tensor([0.3 * i, -1.0 + i, 2.0])} for i in range(6)]
    p = {"x": torch.tensor([1.0, 2.0, -3.0])}
    opt = DenseOptimizer(config, p)
    for g in grads[:3]:
        opt.step(g)
    saved, steps, at = {k: v.clone() for k, v in opt.state.items()}, opt.t, p["x"].clone()
    assert sorted(saved) == (["x.m", "x.v"] if kind == "adam" else ["x.sum"])
    for g in grads[3:]:
        opt.step(g)
    q = {"x": at}
    again = DenseOptimizer(config, q)
    again.load(saved, steps)
    for g in grads[3:]:
        again.step(g)
    assert q["x"].numpy().tobytes() == p["x"].numpy().tobytes()


def test_initial_rows_do_not_depend_on_the_block_they_are_made_in(monkeypatch):
    import shardflow.model.sequence as model_module

    ids = np.random.default_rng(1).integers(0, 10**9, 1000)
    whole = model_module.init_rows("item", ids, 7, 3)
    monkeypatch.setattr(model_module, "INIT_BLOCK_VALUES", 50)  # 7 rows a block, the last one partial
    assert model_module.init_rows("item", ids, 7, 3).tobytes() == whole.tobytes()
    assert [model_module.init_rows("item", ids[i : i + 1], 7, 3).tobytes() for i in (0, 999)] == [
        whole[0:1].tobytes(), whole[999:1000].tobytes()]
    assert whole.dtype == np.float32 and np.abs(whole).max() <= 1 / np.sqrt(7)


def softmax_loss(config, dense: dict, rows: dict, index, norm: int) -> float:
    """The sampled-softmax loss apart from forward_backward: each positive's -log softmax over its example's
    candidates, in numpy, summed and divided by `norm`."""
    logit = scores(config, dense, rows, on_device(index, CPU)).numpy()
    top = logit.max(axis=1, keepdims=True)
    return float((np.log(np.exp(logit - top).sum(axis=1)) + top[:, 0] - logit[:, 0]).sum()) / norm


@pytest.mark.parametrize("which", ["dense", "item", "genre"])
def test_the_sampled_softmax_gradients_match_finite_differences_of_an_independent_loss(which):
    from dataclasses import replace

    config = replace(CONFIG, loss="sampled-softmax")
    dense, rows, index = _problem()
    grads = forward_backward(config, dense, rows, on_device(index, CPU), norm=3)
    assert config.loss_terms == 1 and CONFIG.loss_terms == CONFIG.candidates == 3
    assert np.isclose(grads.loss_sum, 3 * softmax_loss(config, dense, rows, index, 3), rtol=1e-12)
    targets = dense if which == "dense" else {which: rows[which]}
    analytic = grads.dense if which == "dense" else {which: grads.rows[which]}
    for name, param in targets.items():
        numeric = numeric_gradient(param, lambda: softmax_loss(config, dense, rows, index, 3))
        np.testing.assert_allclose(analytic[name].numpy(), numeric, rtol=1e-5, atol=1e-8, err_msg=name)
        if name == "mlp.2.bias":  # it shifts every candidate's logit alike: a softmax does not move
            assert analytic[name].abs().max() < 1e-12
        else:
            assert np.abs(numeric).max() > 1e-4, f"{name}: a gradient this small checks nothing"


def gbce_loss(config, dense: dict, rows: dict, index, norm: int, beta: float) -> float:
    """gSASRec's gBCE apart from forward_backward, in numpy: -(beta log s(positive) + sum log(1 - s(negative))),
    of logits less log K."""
    logit = scores(config, dense, rows, on_device(index, CPU)).numpy() - np.log(config.negatives)
    sigmoid = 1.0 / (1.0 + np.exp(-logit))
    return float(-(beta * np.log(sigmoid[:, 0]).sum() + np.log(1.0 - sigmoid[:, 1:]).sum())) / norm


def test_gbce_weights_the_positive_by_the_sampling_rate_and_calibration():
    """gSASRec's eq. 11: beta = a (t (1 - 1/a) + 1/a), a = negatives / (items - 1): 1 at t 0 (BCE), a at t 1."""
    from shardflow.model.sequence import gbce_beta

    assert gbce_beta(256, 12_102, 0.0) == 1.0
    assert np.isclose(gbce_beta(256, 12_102, 1.0), 256 / 12_101)
    assert np.isclose(gbce_beta(2, 6, 0.75), 0.4 * (0.75 * (1 - 2.5) + 2.5))  # 0.55
    assert gbce_beta(10, 6, 0.75) == 1.0  # as many negatives as items: a is 1, every t is BCE
    with pytest.raises(InputError, match=r"gbce over a table of 1 rows; accepted: at least 2 rows"):
        gbce_beta(2, 1, 0.75)


@pytest.mark.parametrize("which", ["dense", "item", "genre"])
def test_the_gbce_gradients_match_finite_differences_of_an_independent_loss(which):
    from dataclasses import replace

    config = replace(CONFIG, loss="gbce", gbce_t=0.75)
    dense, rows, index = _problem()
    index = replace(index, catalog=6)
    grads = forward_backward(config, dense, rows, on_device(index, CPU), norm=9)
    assert config.loss_terms == config.candidates == 3
    assert np.isclose(grads.loss_sum, 9 * gbce_loss(config, dense, rows, index, 9, 0.55), rtol=1e-12)
    targets = dense if which == "dense" else {which: rows[which]}
    analytic = grads.dense if which == "dense" else {which: grads.rows[which]}
    for name, param in targets.items():
        numeric = numeric_gradient(param, lambda: gbce_loss(config, dense, rows, index, 9, 0.55))
        np.testing.assert_allclose(analytic[name].numpy(), numeric, rtol=1e-5, atol=1e-8, err_msg=name)
        assert np.abs(numeric).max() > 1e-4, f"{name}: a gradient this small checks nothing"


def test_gbce_at_t_0_is_bce_of_the_logits_less_log_k():
    from dataclasses import replace

    dense, rows, index = _problem()
    index = replace(index, catalog=6)
    shifted = {**dense, "mlp.2.bias": dense["mlp.2.bias"] - np.log(CONFIG.negatives)}  # the last layer's intercept
    bce = forward_backward(CONFIG, shifted, rows, on_device(index, CPU), norm=9)
    gbce = forward_backward(replace(CONFIG, loss="gbce", gbce_t=0.0), dense, rows, on_device(index, CPU), norm=9)
    calibrated = forward_backward(replace(CONFIG, loss="gbce", gbce_t=0.75), dense, rows, on_device(index, CPU), norm=9)
    assert np.isclose(gbce.loss_sum, bce.loss_sum, rtol=1e-12)
    np.testing.assert_allclose(gbce.rows["item"].numpy(), bce.rows["item"].numpy(), rtol=1e-12, atol=1e-15)
    assert calibrated.loss_sum < bce.loss_sum  # the positive's term weighted by 0.55


def test_an_unknown_loss_or_calibration_is_refused():
    from dataclasses import replace

    with pytest.raises(InputError, match=r"model loss = 'hinge'; accepted: bce, sampled-softmax, gbce$"):
        replace(CONFIG, loss="hinge")
    with pytest.raises(InputError, match=r"model gbce_t = 1.5; accepted: a number in \[0, 1\]$"):
        replace(CONFIG, loss="gbce", gbce_t=1.5)


def test_a_model_trained_with_another_loss_warm_starts_one_of_this_loss():
    """The loss shapes no parameter and no optimiser slot: a version may change it and start from the last."""
    from dataclasses import replace

    from shardflow.data.clicks import shape_differences, warm_start_record

    bce = warm_start_record(CONFIG, "adam", "adagrad")
    softmax = warm_start_record(replace(CONFIG, loss="sampled-softmax"), "adam", "adagrad")
    assert bce["loss"] == "bce" and softmax["loss"] == "sampled-softmax"
    assert shape_differences(softmax, bce) == [] and shape_differences(softmax, {**bce, "dim": 8}) == ["dim"]
