"""Per-token KL estimators (`kl_penalty` / `kl_loss_type`), KL coefficient controllers, KL in the reward.

Δ = logπ − logπ_ref on sampled tokens (Schulman, "Approximating KL divergence", 2020):

    kl / k1          Δ
    abs              |Δ|
    mse / k2         ½ Δ²
    low_var_kl / k3  ρ' − log ρ' − 1,  ρ' = exp(clamp(−Δ, −20, 20)), result clamped to [−10, 10]
    <type>+          forward value of <type>, gradient of k2 (straight-through; k2's gradient is the
                     unbiased one for the KL's gradient)

All are exactly 0 when π = π_ref; k2, k3, abs and every `+` type then also have zero gradient.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple, Protocol

import torch
from torch import Tensor

from meshrl.algorithms.masked import masked_mean
from meshrl.algorithms.registry import KL_PENALTIES, register_kl_penalty
from meshrl.algorithms.validation import check_finite, check_same_shape, response_mask_as_bool


@register_kl_penalty("kl", "k1")
def k1(log_prob: Tensor, ref_log_prob: Tensor) -> Tensor:
    """Δ"""
    return log_prob - ref_log_prob


@register_kl_penalty("abs")
def abs_kl(log_prob: Tensor, ref_log_prob: Tensor) -> Tensor:
    """|Δ|"""
    return (log_prob - ref_log_prob).abs()


@register_kl_penalty("mse", "k2")
def k2(log_prob: Tensor, ref_log_prob: Tensor) -> Tensor:
    """½ Δ²"""
    return 0.5 * (log_prob - ref_log_prob).square()


@register_kl_penalty("low_var_kl", "k3")
def k3(log_prob: Tensor, ref_log_prob: Tensor) -> Tensor:
    """ρ' − log ρ' − 1 with log ρ' = clamp(logπ_ref − logπ, ±20); clamped to [−10, 10] for stability."""
    log_ref_ratio = torch.clamp(ref_log_prob - log_prob, -20.0, 20.0)
    return torch.clamp(torch.exp(log_ref_ratio) - log_ref_ratio - 1.0, -10.0, 10.0)


def kl_penalty(log_prob: Tensor, ref_log_prob: Tensor, kl_type: str = "low_var_kl") -> Tensor:
    """Per-token KL estimate of type `kl_type` (a registered name, optionally with a `+` suffix)."""
    check_same_shape("log_prob", log_prob, "ref_log_prob", ref_log_prob)
    straight_through = kl_type.endswith("+")
    value = KL_PENALTIES.get(kl_type.removesuffix("+"))(log_prob, ref_log_prob)
    if not straight_through:
        return value
    gradient_carrier = k2(log_prob, ref_log_prob)
    # (g − sg(g)) is exactly 0 in the forward pass, so the value is bit-identical to `value`.
    return gradient_carrier - gradient_carrier.detach() + value.detach()


class KLPenalizedRewards(NamedTuple):
    rewards: Tensor  # (B, T) r_t = score_t − β·kl_t
    kl: Tensor  # (B, T) per-token KL, 0 at masked tokens
    mean_kl: Tensor  # scalar, mean over responses of their token-mean KL (what a controller tracks)


@torch.no_grad()
def apply_kl_penalty(
    token_scores: Tensor,
    log_prob: Tensor,
    ref_log_prob: Tensor,
    response_mask: Tensor,
    *,
    kl_coef: float,
    kl_type: str = "kl",
) -> KLPenalizedRewards:
    """KL in the reward (`algorithm.use_kl_in_reward`): r_t = score_t − β·kl_t on valid tokens.

    `log_prob` is the rollout policy's; β comes from a KL controller (`.value`), to which `mean_kl`
    is fed back. `token_scores` are validated by the advantage estimator that consumes the rewards.
    """
    mask = response_mask_as_bool(response_mask)
    check_same_shape("token_scores", token_scores, "response_mask", response_mask)
    check_same_shape("log_prob", log_prob, "response_mask", response_mask)
    kl = torch.where(mask, kl_penalty(log_prob, ref_log_prob, kl_type), 0.0)
    check_finite("kl (from log_prob and ref_log_prob)", kl, "valid")
    mean_kl = masked_mean(kl, mask, dim=-1).mean()
    return KLPenalizedRewards(rewards=token_scores - kl_coef * kl, kl=kl, mean_kl=mean_kl)


class KLController(Protocol):
    value: float

    def update(self, current_kl: float | Tensor, n_steps: int) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class FixedKLController:
    """β stays at `kl_coef`."""

    def __init__(self, kl_coef: float = 0.001) -> None:
        self.value = float(kl_coef)

    def update(self, current_kl: float | Tensor, n_steps: int) -> None:
        """A fixed coefficient ignores the observed KL."""

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Adaptive β of Ziegler et al. 2019 (arXiv 1909.08593), a proportional controller on the KL:

        e = clip(KL / KL_target − 1, −0.2, 0.2)
        β ← β · (1 + e · n_steps / horizon)
    """

    def __init__(self, init_kl_coef: float = 0.001, target_kl: float = 0.1, horizon: int = 10000) -> None:
        if target_kl <= 0:
            raise ValueError(f"target_kl must be > 0, got {target_kl}")
        if horizon <= 0:
            raise ValueError(f"horizon must be > 0, got {horizon}")
        self.value = float(init_kl_coef)
        self.target_kl = float(target_kl)
        self.horizon = int(horizon)

    def update(self, current_kl: float | Tensor, n_steps: int) -> None:
        current = float(current_kl)
        if not math.isfinite(current):
            raise ValueError(f"current_kl must be finite, got {current}")
        error = min(max(current / self.target_kl - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict[str, Any]:
        # β is the only state; target and horizon come from the config of the resumed run.
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = float(state["value"])


def make_kl_controller(
    kind: str = "fixed", *, kl_coef: float = 0.001, target_kl: float = 0.1, horizon: int = 10000
) -> KLController:
    """`algorithm.kl_ctrl.type`: "fixed" or "adaptive"."""
    if kind == "fixed":
        return FixedKLController(kl_coef)
    if kind == "adaptive":
        return AdaptiveKLController(kl_coef, target_kl, horizon)
    raise ValueError(f"unknown KL controller type {kind!r}; available: 'fixed', 'adaptive'")
