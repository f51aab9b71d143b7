"""Loss aggregation modes and their global normalisers."""

from __future__ import annotations

import pytest
import torch

from meshrl.algorithms import LOSS_AGG_MODES, GlobalNorm, aggregate_loss

# Two valid responses (3 and 1 tokens) and one fully masked response.
TOKEN_LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 0.0], [7.0, 7.0, 7.0]])
MASK = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]])


def test_global_norm_from_mask() -> None:
    norm = GlobalNorm.from_mask(MASK)
    assert norm == GlobalNorm(num_tokens=4, num_seqs=2, max_len=3)
    assert GlobalNorm.from_mask(MASK, max_len=5).max_len == 5


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", (1 + 2 + 3 + 4) / 4),
        ("token-sum", 1 + 2 + 3 + 4),
        ("seq-mean-token-sum", (6 + 4) / 2),
        ("seq-mean-token-mean", (2 + 4) / 2),
        ("seq-mean-token-sum-norm", 10 / (2 * 3)),
    ],
)
def test_aggregation_modes_hand_computed(mode: str, expected: float) -> None:
    assert float(aggregate_loss(TOKEN_LOSS, MASK, mode, GlobalNorm.from_mask(MASK))) == pytest.approx(expected)


def test_seq_mean_token_sum_norm_uses_the_given_max_len() -> None:
    norm = GlobalNorm.from_mask(MASK, max_len=5)
    assert float(aggregate_loss(TOKEN_LOSS, MASK, "seq-mean-token-sum-norm", norm)) == pytest.approx(1.0)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_masked_tokens_change_neither_value_nor_gradient(mode: str) -> None:
    norm = GlobalNorm.from_mask(MASK)
    clean = TOKEN_LOSS.clone().requires_grad_(True)
    dirty = TOKEN_LOSS.masked_fill(MASK == 0, float("nan")).requires_grad_(True)
    clean_loss = aggregate_loss(clean, MASK, mode, norm)
    dirty_loss = aggregate_loss(dirty, MASK, mode, norm)
    assert torch.equal(clean_loss, dirty_loss)
    (clean_grad,) = torch.autograd.grad(clean_loss, clean)
    (dirty_grad,) = torch.autograd.grad(dirty_loss, dirty)
    assert torch.equal(clean_grad, dirty_grad)
    assert torch.all(clean_grad[MASK == 0] == 0)


def test_unknown_mode_suggests_the_closest() -> None:
    with pytest.raises(ValueError, match="Did you mean 'seq-mean-token-mean'"):
        aggregate_loss(TOKEN_LOSS, MASK, "seq-mean-tokens-mean", GlobalNorm.from_mask(MASK))


def test_global_norm_rejects_a_batch_without_valid_tokens() -> None:
    with pytest.raises(ValueError, match="no valid token"):
        GlobalNorm.from_mask(torch.zeros(2, 3))
