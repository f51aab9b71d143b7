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
    clip_cov,
    dppo_kl,
    dppo_tv,
    dro,
    entropy_from_logits,
    geo_mean,
    gspo,
    kl_cov,
    policy_gradient,
    sapo,
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


def test_dppo_tv_masks_moves_of_the_probability_beyond_the_threshold() -> None:
    # p_old = 0.5 everywhere. Token 0: p 0.6 (+0.1, A > 0) outside δ_high = 0.08: no loss, no gradient.
    # Token 1: p 0.55 inside, ρ = 1.1. Token 2: p 0.3 (−0.2, A < 0) outside δ_low = 0.05. Token 3: p 0.3 with
    # A > 0: only a rise is limited, kept. Token 4: A = 0 takes the A < 0 rule, p 0.52 kept (its loss is 0).
    probs = [0.6, 0.55, 0.3, 0.3, 0.52]
    log_prob = leaf([math.log(p) for p in probs])
    old_log_prob = torch.full((1, 5), math.log(0.5))
    advantages = torch.tensor([[1.0, 2.0, -1.0, 1.0, 0.0]])
    out = dppo_tv(log_prob, old_log_prob, advantages, torch.ones(1, 5), clip_ratio_low=0.05, clip_ratio_high=0.08,
                  clip_ratio_c=20.0)
    assert out.metrics["clipfrac"][0].tolist() == [True, False, True, False, False]
    # L = −A·sg(ρ)·logπ: the gradient is −A·ρ where kept.
    assert out.loss[0].tolist() == pytest.approx([0.0, -2 * 1.1 * math.log(0.55), 0.0, -0.6 * math.log(0.3), 0.0])
    assert gradient(out.loss, log_prob) == pytest.approx([0.0, -2.2, 0.0, -0.6, 0.0])


def test_dppo_truncates_the_importance_weight_at_clip_ratio_c() -> None:
    # ρ = 4 with A < 0: a rise of the probability is never masked for A < 0 (the update lowers it), in either
    # variant. The weight is min(ρ, C) = 3, and no gradient flows through it.
    log_prob = leaf([math.log(4e-3)])
    old_log_prob = torch.tensor([[math.log(1e-3)]])
    for loss in (dppo_tv, dppo_kl):
        out = loss(log_prob, old_log_prob, torch.tensor([[-1.0]]), torch.ones(1, 1), clip_ratio_c=3.0)
        assert out.metrics["clipfrac_lower"][0].tolist() == [True]
        assert out.loss[0].tolist() == pytest.approx([3.0 * math.log(4e-3)])
        assert gradient(out.loss, log_prob) == pytest.approx([3.0])


def test_dppo_kl_limits_only_moves_in_the_direction_of_the_advantage() -> None:
    # p_old = 0.5 → p = 0.1: binary KL ≈ 0.51, far beyond δ = 0.02. Against A < 0 this fall is masked; with
    # A > 0 (the update would raise p back) it is kept.
    log_prob = leaf([math.log(0.1), math.log(0.1)])
    old_log_prob = torch.full((1, 2), math.log(0.5))
    out = dppo_kl(log_prob, old_log_prob, torch.tensor([[-1.0, 1.0]]), torch.ones(1, 2), clip_ratio_low=0.02,
                  clip_ratio_high=0.02)
    assert out.metrics["clipfrac"][0].tolist() == [True, False]
    assert gradient(out.loss, log_prob) == pytest.approx([0.0, -0.2])


def test_sapo_is_the_policy_gradient_on_policy_and_fades_off_policy() -> None:
    log_prob = leaf([-1.0, -1.0, -1.0])
    advantages = torch.tensor([[2.0, -2.0, 2.0]])
    on_policy = sapo(log_prob, log_prob.detach(), advantages, torch.ones(1, 3), tau_pos=1.0, tau_neg=1.05)
    assert on_policy.agg_mode == "seq-mean-token-mean"
    # f(1) = σ(0)·4/τ = 2/τ, f'(1) = 1: the value is −A·2/τ, the gradient −A.
    assert on_policy.loss[0].tolist() == pytest.approx([-4.0, 4 / 1.05, -4.0])
    assert gradient(on_policy.loss, log_prob) == pytest.approx([-2.0, 2.0, -2.0])
    # ρ = 3: the gradient −A·ρ·4σ(1 − σ) with σ = σ(2τ) shrinks, never to 0 (no hard clip).
    off_policy = sapo(log_prob, torch.full((1, 3), -1.0 - math.log(3.0)), advantages, torch.ones(1, 3))
    sigma = 1 / (1 + math.exp(-2.0))
    assert gradient(off_policy.loss, log_prob)[0] == pytest.approx(-2.0 * 3 * 4 * sigma * (1 - sigma))
    with pytest.raises(ValueError, match="tau_pos and tau_neg must be > 0"):
        sapo(log_prob, log_prob.detach(), advantages, torch.ones(1, 3), tau_neg=0.0)


def covariance_problem(seed: int = 0) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seed)
    mask = torch.rand(16, 32, generator=generator) > 0.1
    old_log_prob = -3 * torch.rand(16, 32, generator=generator)
    log_prob = (old_log_prob + 0.3 * torch.randn(16, 32, generator=generator)).requires_grad_(True)
    return log_prob, old_log_prob, torch.randn(16, 32, generator=generator), mask


def test_clip_cov_removes_the_loss_and_gradient_of_a_random_draw_among_its_candidates() -> None:
    log_prob, old_log_prob, advantages, mask = covariance_problem()
    options = {"clip_cov_ratio": 0.02, "clip_cov_lb": 0.3, "clip_cov_ub": 3.0}
    torch.manual_seed(0)
    out = clip_cov(log_prob, old_log_prob, advantages, mask, **options)
    picked = out.metrics["clipfrac"]
    # Candidates: valid, not clipped by PPO, lb < (A − Ā)(logπ − mean logπ) < ub over the valid tokens.
    lp = log_prob.detach()
    cov = (advantages - advantages[mask].mean()) * (lp - lp[mask].mean())
    ratio = torch.exp(lp - old_log_prob)
    ppo_clipped = ((advantages > 0) & (ratio > 1.2)) | ((advantages < 0) & (ratio < 0.8))
    candidates = mask & ~ppo_clipped & (cov > 0.3) & (cov < 3.0)
    assert int(picked.sum()) == int(0.02 * int(mask.sum())) < int(candidates.sum())
    assert not bool((picked & ~candidates).any())
    grad = torch.autograd.grad(torch.where(mask, out.loss, 0.0).sum(), log_prob)[0]
    assert bool((out.loss[picked] == 0).all()) and bool((grad[picked] == 0).all())
    unpicked = vanilla(log_prob, old_log_prob, advantages, mask, clip_ratio_c=math.inf).loss
    torch.testing.assert_close(out.loss[~picked], unpicked[~picked])
    # Another draw picks other tokens; without candidates nothing is picked.
    again = clip_cov(log_prob, old_log_prob, advantages, mask, **options).metrics["clipfrac"]
    assert not torch.equal(again, picked)
    none = clip_cov(log_prob, old_log_prob, advantages, mask, clip_cov_lb=100.0, clip_cov_ub=200.0)
    assert not bool(none.metrics["clipfrac"].any())
    with pytest.raises(ValueError, match="clip_cov_ratio must be > 0"):
        clip_cov(log_prob, old_log_prob, advantages, mask, clip_cov_ratio=0.0)


def test_kl_cov_penalises_the_tokens_of_largest_covariance() -> None:
    log_prob, old_log_prob, advantages, mask = covariance_problem(seed=1)
    out = kl_cov(log_prob, old_log_prob, advantages, mask, kl_cov_ratio=0.05, ppo_kl_coef=0.5)
    lp = log_prob.detach()
    cov = torch.where(mask, (advantages - advantages[mask].mean()) * (lp - lp[mask].mean()), -math.inf)
    count = int(0.05 * int(mask.sum()))
    picked = torch.zeros(cov.numel(), dtype=torch.bool)
    picked[cov.flatten().argsort(descending=True)[:count]] = True
    picked = picked.view_as(mask)
    delta = lp - old_log_prob
    ratio = torch.exp(delta)
    torch.testing.assert_close(out.loss.detach(), -advantages * ratio + torch.where(picked, 0.5 * delta.abs(), 0.0))
    grad = torch.autograd.grad(out.loss.sum(), log_prob)[0]
    torch.testing.assert_close(grad, -advantages * ratio + torch.where(picked, 0.5 * delta.sign(), 0.0))
    torch.testing.assert_close(out.metrics["ppo_kl"], delta.abs())  # verl's ppo_kl for this loss: |Δ|
    # At least one token, whatever the ratio.
    one = kl_cov(log_prob, old_log_prob, advantages, mask, kl_cov_ratio=1e-9, ppo_kl_coef=1.0)
    assert int(torch.isclose(one.loss, -advantages * ratio).logical_not().sum()) == 1
    with pytest.raises(ValueError, match="kl_cov_ratio must be > 0"):
        kl_cov(log_prob, old_log_prob, advantages, mask, kl_cov_ratio=-1.0)


def test_geo_mean_is_the_geometric_mean_ratio_of_each_response() -> None:
    # Response 0 (A = 1): log-ratios 0.1 and 0.5; the second is clipped at ε_high = 0.2 (no gradient), so
    # r = exp((0.1 + 0.2)/2). Response 1 (A = −2 on one token, 0 on the other): the A = 0 token counts 0 in
    # the mean log-ratio and Â = −1; its third token is masked (a huge log-ratio that must not count).
    log_prob = torch.tensor([[-1.0, -1.0, 0.0], [-1.0, -1.0, 0.0]], requires_grad=True)
    old_log_prob = torch.tensor([[-1.1, -1.5, 0.0], [-0.9, -1.3, -40.0]])
    advantages = torch.tensor([[1.0, 1.0, 0.0], [-2.0, 0.0, 5.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    out = geo_mean(log_prob, old_log_prob, advantages, mask)
    value = aggregate_loss(out.loss, mask, out.agg_mode, GlobalNorm.from_mask(mask))
    # Response 1: Δ = (−0.1, 0.3), the A < 0 token above −ε_low: unclipped; r = exp(−0.1/2).
    r0, r1 = math.exp(0.15), math.exp(-0.05)
    assert float(value.detach()) == pytest.approx((-1.0 * r0 + 1.0 * r1) / 2)
    (grad,) = torch.autograd.grad(value, log_prob)
    # ∂/∂logπ_t of −Â·r / N_seqs = −Â·r/(|o|·N_seqs) on unclipped tokens with A ≠ 0.
    torch.testing.assert_close(grad, torch.tensor([[-r0 / 4, 0.0, 0.0], [r1 / 4, 0.0, 0.0]]))
    assert out.metrics["clipfrac"][0, :2].tolist() == [False, True]
    assert not bool(out.metrics["clipfrac_lower"].any())


def test_geo_mean_weights_a_response_by_the_geometric_mean_of_its_is_weights() -> None:
    # verl: the rollout-correction weights of a response enter as exp(mean log w), here w = (4, 1) → 2; the
    # masked token's weight (0) must not count.
    log_prob = torch.tensor([[-1.0, -1.0, -1.0]], requires_grad=True)
    advantages = torch.tensor([[1.0, 1.0, 1.0]])
    mask = torch.tensor([[1, 1, 0]])
    weights = torch.tensor([[4.0, 1.0, 0.0]])
    plain = geo_mean(log_prob, log_prob.detach(), advantages, mask)
    weighted = geo_mean(log_prob, log_prob.detach(), advantages, mask, rollout_is_weights=weights)
    torch.testing.assert_close(weighted.loss, 2 * plain.loss)
    assert weighted.loss[0].tolist() == pytest.approx([-2.0] * 3, rel=1e-6)


def test_dro_penalises_the_squared_log_ratio_and_needs_its_beta() -> None:
    log_prob = leaf([-1.0, -2.0])
    old_log_prob = torch.tensor([[-1.5, -2.0]])
    advantages = torch.tensor([[1.0, -1.0]])
    out = dro(log_prob, old_log_prob, advantages, torch.ones(1, 2), dro_beta=0.4)
    assert out.loss[0].tolist() == pytest.approx([1.0 + 0.2 * 0.25, -2.0])
    assert gradient(out.loss, log_prob) == pytest.approx([-1.0 + 0.4 * 0.5, 1.0])
    for beta in (None, 0.0):
        with pytest.raises(ValueError, match="dro_beta must be > 0"):
            dro(log_prob, old_log_prob, advantages, torch.ones(1, 2), dro_beta=beta)


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
