"""Policy losses, value loss and entropy: hand-computed per-token values and gradients."""

from __future__ import annotations

import math

import pytest
import torch

from meshrl.algorithms import (
    POLICY_LOSSES,
    GlobalNorm,
    aggregate_loss,
    cispo,
    entropy_from_logits,
    gspo,
    policy_gradient,
    value_loss,
    vanilla,
)


def leaf(values: list[float]) -> torch.Tensor:
    return torch.tensor([values], requires_grad=True)


def gradient(loss: torch.Tensor, wrt: torch.Tensor) -> list[float]:
    (grad,) = torch.autograd.grad(loss.sum(), wrt)
    return grad[0].tolist()


def test_vanilla_ppo_clip_and_dual_clip_hand_computed() -> None:
    # Tokens: ratio 1 (A=1); 1.5 clipped to 1.2 (A=1); 0.5 unclipped (A=1); 0.5 clipped to 0.8 (A=-1);
    # 4 with A=-1: the clip gives 4, the dual clip caps it at c·|A| = 3.
    ratios = [1.0, 1.5, 0.5, 0.5, 4.0]
    log_prob = leaf([math.log(r) for r in ratios])
    old_log_prob = torch.zeros(1, 5)
    advantages = torch.tensor([[1.0, 1.0, 1.0, -1.0, -1.0]])
    out = vanilla(log_prob, old_log_prob, advantages, torch.ones(1, 5))
    assert out.loss[0].tolist() == pytest.approx([-1.0, -1.2, -0.5, 0.8, 3.0])
    assert out.metrics["clipfrac"][0].tolist() == [0, 1, 0, 1, 0]
    assert out.metrics["clipfrac_lower"][0].tolist() == [0, 0, 0, 0, 1]
    assert out.metrics["ppo_kl"][0].tolist() == pytest.approx([-math.log(r) for r in ratios])
    # dL/dlogπ = −A·ρ where the unclipped term is active, 0 where a clip is.
    assert gradient(out.loss, log_prob) == pytest.approx([-1.0, 0.0, -0.5, 0.0, 0.0])
    # Diagnostics aggregate like the loss: the clip fraction over the 4 valid tokens of a mask.
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    clipfrac = aggregate_loss(out.metrics["clipfrac"], mask, "token-mean", GlobalNorm.from_mask(mask))
    assert float(clipfrac) == 0.5


def literal_ppo(ratio: torch.Tensor, advantages: torch.Tensor, low: float, high: float, c: float) -> dict:
    """PPO's surrogate and verl's diagnostics written exactly as in the papers (max, then min for A < 0)."""
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - low, 1 + high)
    clip_loss = torch.maximum(unclipped, clipped)
    dual = -advantages * c
    return {
        "loss": torch.where(advantages < 0, torch.minimum(clip_loss, dual), clip_loss),
        "clipfrac": clipped > unclipped,
        "clipfrac_lower": (advantages < 0) & (clip_loss > dual),
    }


def test_vanilla_matches_the_literal_max_min_form_in_value_gradient_and_diagnostics() -> None:
    generator = torch.Generator().manual_seed(7)
    old_log_prob = -3 * torch.rand(64, 32, generator=generator)
    current = old_log_prob + 0.8 * torch.randn(64, 32, generator=generator)  # ratios from ~0.1 to ~10
    advantages = torch.randn(64, 32, generator=generator)
    advantages[:, :4] = 0.0
    log_prob = current.clone().requires_grad_(True)
    out = vanilla(log_prob, old_log_prob, advantages, torch.ones(64, 32), clip_ratio_low=0.2, clip_ratio_high=0.28)
    reference_input = current.clone().requires_grad_(True)
    reference = literal_ppo(torch.exp(reference_input - old_log_prob), advantages, 0.2, 0.28, 3.0)
    torch.testing.assert_close(out.loss, reference["loss"])
    (grad,) = torch.autograd.grad(out.loss.sum(), log_prob)
    (reference_grad,) = torch.autograd.grad(reference["loss"].sum(), reference_input)
    torch.testing.assert_close(grad, reference_grad)
    assert torch.equal(out.metrics["clipfrac"], reference["clipfrac"])
    assert torch.equal(out.metrics["clipfrac_lower"], reference["clipfrac_lower"])
    assert 0 < int(reference["clipfrac"].sum()) and 0 < int(reference["clipfrac_lower"].sum())


def test_vanilla_clip_higher_widens_only_the_upper_bound() -> None:
    log_prob = leaf([math.log(1.25), math.log(0.75)])
    advantages = torch.tensor([[1.0, -1.0]])
    symmetric = vanilla(log_prob, torch.zeros(1, 2), advantages, torch.ones(1, 2))
    higher = vanilla(log_prob, torch.zeros(1, 2), advantages, torch.ones(1, 2), clip_ratio_high=0.28)
    assert symmetric.loss[0].tolist() == pytest.approx([-1.2, 0.8])
    assert higher.loss[0].tolist() == pytest.approx([-1.25, 0.8])


def test_vanilla_is_the_plain_policy_gradient_on_policy() -> None:
    # At ρ = 1 nothing is clipped: the gradient is −A, as REINFORCE's.
    log_prob = leaf([-0.3, -1.2, -2.0])
    advantages = torch.tensor([[0.5, -2.0, 1.0]])
    ppo = vanilla(log_prob, log_prob.detach(), advantages, torch.ones(1, 3))
    reinforce = policy_gradient(log_prob, log_prob.detach(), advantages, torch.ones(1, 3))
    ppo_gradient = gradient(ppo.loss, log_prob)
    assert ppo_gradient == pytest.approx(gradient(reinforce.loss, log_prob))
    assert ppo_gradient == pytest.approx([-0.5, 2.0, -1.0])


def test_gpg_and_reinforce_are_one_function_minus_advantage_times_log_prob() -> None:
    assert POLICY_LOSSES.get("gpg") is POLICY_LOSSES.get("reinforce") is policy_gradient
    log_prob = leaf([-1.0, -2.0])
    out = policy_gradient(log_prob, torch.zeros(1, 2), torch.tensor([[2.0, -1.0]]), torch.ones(1, 2))
    assert out.loss[0].tolist() == [2.0, -2.0]


def test_cispo_clips_the_weight_but_keeps_every_gradient() -> None:
    log_prob = leaf([-1.0, -1.0])
    old_log_prob = torch.tensor([[-1.0 - math.log(1.5), -1.0]])  # ratios 1.5 and 1
    advantages = torch.tensor([[2.0, 2.0]])
    out = cispo(log_prob, old_log_prob, advantages, torch.ones(1, 2))
    # L = −sg(clip(ρ, 0.8, 1.2))·A·logπ = −1.2·2·(−1) and −1·2·(−1).
    assert out.loss[0].tolist() == pytest.approx([2.4, 2.0])
    assert out.metrics["clipfrac"][0].tolist() == [1.0, 0.0]
    assert gradient(out.loss, log_prob) == pytest.approx([-2.4, -2.0])


def test_gspo_uses_the_sequence_ratio_for_every_token() -> None:
    # Sequence 0: log-ratios [0.1, -0.1] → s = 1 (inside the clip). Sequence 1: [0.2, 0.4] → s = e^0.3.
    log_prob = torch.tensor([[-1.0, -2.0], [-1.0, -1.0]], requires_grad=True)
    old_log_prob = torch.tensor([[-1.1, -1.9], [-1.2, -1.4]])
    mask = torch.ones(2, 2)
    positive = gspo(log_prob, old_log_prob, torch.ones(2, 2), mask)
    assert positive.agg_mode == "seq-mean-token-mean"
    s = math.exp(0.3)
    # A > 0: sequence 1's ratio is clipped to 1 + 4e-4 (no gradient); sequence 0 is not.
    torch.testing.assert_close(positive.loss, torch.tensor([[-1.0, -1.0], [-(1 + 4e-4), -(1 + 4e-4)]]))
    (grad,) = torch.autograd.grad(positive.loss.sum(), log_prob)
    torch.testing.assert_close(grad, torch.tensor([[-1.0, -1.0], [0.0, 0.0]]))
    assert positive.metrics["clipfrac"].tolist() == [[0, 0], [1, 1]]
    # A < 0: the unclipped term −A·s wins; its gradient per token is −A·s (d s_t / d logπ_t = s).
    negative = gspo(log_prob, old_log_prob, -torch.ones(2, 2), mask)
    assert negative.loss[1].tolist() == pytest.approx([s, s])
    (grad,) = torch.autograd.grad(negative.loss.sum(), log_prob)
    assert grad[1].tolist() == pytest.approx([s, s])


def test_gspo_sequence_ratio_ignores_masked_tokens() -> None:
    log_prob = torch.tensor([[-1.0, -1.0, 5.0]])
    old_log_prob = torch.tensor([[-1.1, -0.9, -9.0]])  # the masked token's huge log-ratio must not count
    out = gspo(log_prob, old_log_prob, -torch.ones(1, 3), torch.tensor([[1, 1, 0]]))
    assert out.loss[0, :2].tolist() == pytest.approx([1.0, 1.0])


def test_value_loss_clipped_hand_computed() -> None:
    values = torch.tensor([[1.0, 1.0, 0.0]], requires_grad=True)
    old_values = torch.tensor([[0.0, 0.8, 1.0]])
    returns = torch.tensor([[2.0, 0.0, 2.0]])
    out = value_loss(values, old_values, returns, torch.ones(1, 3))
    # Token 0: clip(1, -0.5, 0.5) = 0.5 → max(1, 2.25)/2; token 1: inside the clip → 1/2; token 2: max(4, 2.25)/2.
    assert out.loss[0].tolist() == pytest.approx([1.125, 0.5, 2.0])
    assert out.metrics["vf_clipfrac"][0].tolist() == [1.0, 0.0, 0.0]
    (grad,) = torch.autograd.grad(out.loss.sum(), values)
    assert grad[0].tolist() == pytest.approx([0.0, 1.0, -2.0])  # clipped term: no gradient


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_value_loss_counts_no_clip_when_the_update_is_inside_the_range(dtype: torch.dtype) -> None:
    # V_old + (V − V_old) can be V ± 1 ulp in fp32/bf16 (when V and V_old are not within a factor 2 of
    # each other, V − V_old rounds); the clipped value must then be V itself.
    generator = torch.Generator().manual_seed(11)
    old_values = torch.randn(64, 32, generator=generator).to(dtype)
    values = (old_values.float() + 0.9 * torch.rand(64, 32, generator=generator) - 0.45).to(dtype)
    assert bool(((values.double() - old_values.double()).abs() < 0.5).all())
    returns = torch.randn(64, 32, generator=generator).to(dtype)
    out = value_loss(values, old_values, returns, torch.ones(64, 32), clip_range_value=0.5)
    assert int(out.metrics["vf_clipfrac"].sum()) == 0
    assert torch.equal(out.loss, 0.5 * (values - returns).square())


def test_entropy_from_logits() -> None:
    uniform = entropy_from_logits(torch.zeros(2, 3, 4))
    assert uniform.shape == (2, 3)
    torch.testing.assert_close(uniform, torch.full((2, 3), math.log(4.0)))
    skewed = entropy_from_logits(torch.tensor([[[0.0, math.log(3.0)]]]))
    assert float(skewed) == pytest.approx(-(0.25 * math.log(0.25) + 0.75 * math.log(0.75)))
