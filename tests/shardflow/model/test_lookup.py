"""The trainers' embedding lookups: the same rows and the same row gradients as torch's own embedding and
embedding_bag, for indices of any shape, repeated ids, empty bags and a strided incoming gradient."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shardflow.model.lookup import bag_mean, rows_at


def _grads(lookup, rows: torch.Tensor, at: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    leaf = rows.detach().requires_grad_(True)
    out = lookup(leaf, at)
    (g,) = torch.autograd.grad((out * weight).sum(), leaf)
    return out.detach(), g


@pytest.mark.parametrize("shape", [(7,), (3, 5), (2, 3, 4)])
def test_rows_and_gradients_match_embedding(shape: tuple[int, ...]) -> None:
    gen = torch.Generator().manual_seed(1)
    rows = torch.randn(6, 4, generator=gen, dtype=torch.float64)
    at = torch.randint(1, 6, shape, generator=gen)  # row 0 is never read
    at.view(-1)[:2] = 5  # a repeated id, whose gradients are summed
    weight = torch.randn(*shape, 4, generator=gen, dtype=torch.float64)
    ours, ours_grad = _grads(rows_at, rows, at, weight)
    theirs, theirs_grad = _grads(lambda r, a: F.embedding(a, r), rows, at, weight)
    assert ours.shape == (*shape, 4)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    torch.testing.assert_close(ours_grad, theirs_grad, rtol=1e-12, atol=1e-12)
    assert ours_grad[0].abs().sum() == 0


def test_a_strided_gradient_is_summed_as_a_contiguous_one() -> None:
    """Each table's vectors are a slice of the stacked [E, tables, dim] tensor's gradient in the DLRM."""
    gen = torch.Generator().manual_seed(2)
    rows, other = torch.randn(5, 3, generator=gen), torch.randn(5, 3, generator=gen)
    at = torch.tensor([4, 0, 4, 2])
    leaf = rows.clone().requires_grad_(True)
    stacked = torch.stack([rows_at(leaf, at), other[at]], dim=1)  # [4, 2, 3]
    weight = torch.randn(4, 2, 3, generator=gen)
    (g,) = torch.autograd.grad((stacked * weight).sum(), leaf)
    expected = torch.zeros(5, 3).index_add_(0, at, weight[:, 0, :].contiguous())
    torch.testing.assert_close(g, expected)


def test_sparse_lookups_keep_a_sparse_gradient() -> None:
    """The reference trainer's whole tables: the gradient stays sparse, as its optimiser takes it."""
    rows = torch.randn(5, 3).requires_grad_(True)
    (g,) = torch.autograd.grad(rows_at(rows, torch.tensor([1, 1, 3]), sparse=True).sum(), rows)
    assert g.is_sparse
    torch.testing.assert_close(g.to_dense()[1], torch.full((3,), 2.0))


def test_bag_means_and_their_gradients_match_embedding_bag() -> None:
    """Bags of 3, 0, 1 and 4 ids, then of 3, 1, 4 and 0 (an id repeated within a bag and across bags)."""
    gen = torch.Generator().manual_seed(3)
    rows = torch.randn(6, 4, generator=gen, dtype=torch.float64)
    ids = torch.tensor([5, 1, 5, 2, 5, 3, 1, 4])
    for offsets, empty in ((torch.tensor([0, 3, 3, 4]), 1), (torch.tensor([0, 3, 4, 8]), 3)):
        weight = torch.randn(4, 4, generator=gen, dtype=torch.float64)
        ours, ours_grad = _grads(lambda r, a, o=offsets: bag_mean(r, a, o), rows, ids, weight)
        theirs, theirs_grad = _grads(lambda r, a, o=offsets: F.embedding_bag(a, r, o, mode="mean"), rows, ids,
                                     weight)
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
        torch.testing.assert_close(ours_grad, theirs_grad, rtol=1e-12, atol=1e-12)
        assert ours[empty].abs().sum() == 0 and ours_grad[0].abs().sum() == 0 and ours_grad[5].abs().sum() > 0
