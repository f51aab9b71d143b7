"""KL estimators, straight-through variants, controllers and the KL-penalised reward."""

from __future__ import annotations

import math

import pytest
import torch

from meshrl.algorithms import (
    KL_PENALTIES,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    kl_penalty,
    make_kl_controller,
)

# Δ = logπ − logπ_ref = +0.5 and −0.5.
LOG_PROB = torch.tensor([[-1.0, -1.5]])
REF_LOG_PROB = torch.tensor([[-1.5, -1.0]])


@pytest.mark.parametrize(
    ("kl_type", "expected"),
    [
        ("kl", [0.5, -0.5]),
        ("k1", [0.5, -0.5]),
        ("abs", [0.5, 0.5]),
        ("mse", [0.125, 0.125]),
        ("k2", [0.125, 0.125]),
        # ρ' − log ρ' − 1 with log ρ' = −Δ: e^{-0.5} + 0.5 − 1 and e^{0.5} − 0.5 − 1.
        ("low_var_kl", [math.exp(-0.5) - 0.5, math.exp(0.5) - 1.5]),
        ("k3", [math.exp(-0.5) - 0.5, math.exp(0.5) - 1.5]),
    ],
)
def test_kl_types_hand_computed(kl_type: str, expected: list[float]) -> None:
    assert kl_penalty(LOG_PROB, REF_LOG_PROB, kl_type)[0].tolist() == pytest.approx(expected, abs=1e-6)


def test_low_var_kl_is_clamped() -> None:
    # log ρ' = 30 is clamped to 20 and e^20 − 21 then to 10.
    assert kl_penalty(torch.tensor([-31.0]), torch.tensor([-1.0]), "k3").item() == 10.0


ALL_TYPES = KL_PENALTIES.names() + [f"{name}+" for name in KL_PENALTIES.names()]


@pytest.mark.parametrize("kl_type", ALL_TYPES)
def test_identical_policies_give_exactly_zero_kl(kl_type: str) -> None:
    log_prob = torch.tensor([[-0.3, -2.5, -7.0]], requires_grad=True)
    kl = kl_penalty(log_prob, log_prob.detach().clone(), kl_type)
    assert torch.equal(kl, torch.zeros_like(kl))
    (grad,) = torch.autograd.grad(kl.sum(), log_prob)
    # k1's per-sample gradient is the score itself (1 per token); every other type is flat at π = π_ref.
    expected = 1.0 if kl_type in ("kl", "k1") else 0.0
    assert torch.equal(grad, torch.full_like(grad, expected))


@pytest.mark.parametrize("base", ["kl", "abs", "k3"])
def test_straight_through_keeps_the_value_and_takes_the_k2_gradient(base: str) -> None:
    log_prob = LOG_PROB.clone().requires_grad_(True)
    plain = kl_penalty(log_prob, REF_LOG_PROB, base)
    straight = kl_penalty(log_prob, REF_LOG_PROB, f"{base}+")
    assert torch.equal(plain.detach(), straight.detach())
    (grad,) = torch.autograd.grad(straight.sum(), log_prob)
    assert grad[0].tolist() == pytest.approx([0.5, -0.5])  # d(½Δ²)/dlogπ = Δ


def test_fixed_controller_never_moves() -> None:
    controller = FixedKLController(0.05)
    controller.update(current_kl=3.0, n_steps=256)
    assert controller.value == 0.05


def test_adaptive_controller_ziegler_update_hand_computed() -> None:
    controller = AdaptiveKLController(init_kl_coef=0.1, target_kl=0.1, horizon=100)
    controller.update(current_kl=0.15, n_steps=10)  # error 0.5 clipped to 0.2
    assert controller.value == pytest.approx(0.1 * 1.02)
    controller = AdaptiveKLController(init_kl_coef=0.1, target_kl=0.1, horizon=100)
    controller.update(current_kl=torch.tensor(0.09), n_steps=10)  # error −0.1
    assert controller.value == pytest.approx(0.1 * 0.99)


def test_adaptive_controller_state_round_trip() -> None:
    controller = make_kl_controller("adaptive", kl_coef=0.001, target_kl=0.1, horizon=10000)
    for kl in (0.5, 0.2, 0.05):
        controller.update(kl, n_steps=64)
    restored = make_kl_controller("adaptive", kl_coef=0.001, target_kl=0.1, horizon=10000)
    restored.load_state_dict(controller.state_dict())
    assert restored.value == controller.value != 0.001
    controller.update(0.3, n_steps=64)
    restored.update(0.3, n_steps=64)
    assert restored.value == controller.value


def test_controller_rejects_bad_settings() -> None:
    with pytest.raises(ValueError, match="horizon"):
        AdaptiveKLController(horizon=0)
    with pytest.raises(ValueError, match="current_kl"):
        AdaptiveKLController().update(float("nan"), 1)
    with pytest.raises(ValueError, match="'fixed', 'adaptive'"):
        make_kl_controller("adaptiv")


def test_apply_kl_penalty_hand_computed() -> None:
    token_scores = torch.tensor([[0.0, 0.0, 1.0]])
    log_prob = torch.tensor([[-1.0, -1.0, -1.0]])
    ref_log_prob = torch.tensor([[-1.5, -1.0, float("nan")]])  # the masked token's value is never used
    out = apply_kl_penalty(token_scores, log_prob, ref_log_prob, torch.tensor([[1, 1, 0]]), kl_coef=0.1)
    assert out.kl.tolist() == [[0.5, 0.0, 0.0]]
    torch.testing.assert_close(out.rewards, torch.tensor([[-0.05, 0.0, 1.0]]))
    assert float(out.mean_kl) == pytest.approx(0.25)


def test_unknown_kl_type_suggests_the_closest() -> None:
    with pytest.raises(ValueError, match="Did you mean 'low_var_kl'"):
        kl_penalty(LOG_PROB, REF_LOG_PROB, "lowvar_kl+")
