"""Policy losses (`actor.policy_loss.loss_mode`), the value loss and the entropy of the policy.

Each loss returns a `TokenLoss`: the *per-token* loss L_{i,t} and per-token diagnostics, not yet masked
or averaged, so the caller aggregates them with `aggregation.aggregate_loss` against normalisers of the
whole mini-batch (see there for why). Notation: ρ = exp(clamp(logπ − logπ_old, −20, 20)),
sg = stop-gradient, A the advantages. Every policy loss has the signature
`(log_prob, old_log_prob, advantages, response_mask, *, <options>)`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from meshrl.algorithms.masked import masked_sum
from meshrl.algorithms.registry import register_policy_loss
from meshrl.algorithms.validation import check_finite, check_same_shape, response_mask_as_bool


@dataclass(frozen=True)
class TokenLoss:
    loss: Tensor  # (B, T) per-token loss, to be aggregated with the response mask
    # (B, T) detached diagnostics (bool indicators or values), to be token-mean aggregated like the loss.
    metrics: dict[str, Tensor] = field(default_factory=dict)
    agg_mode: str | None = None  # the aggregation the method itself prescribes (GSPO); None = configured one


def _check_inputs(log_prob: Tensor, old_log_prob: Tensor, advantages: Tensor, response_mask: Tensor) -> Tensor:
    mask = response_mask_as_bool(response_mask)
    check_same_shape("log_prob", log_prob, "response_mask", response_mask)
    check_same_shape("old_log_prob", old_log_prob, "response_mask", response_mask)
    check_same_shape("advantages", advantages, "response_mask", response_mask)
    # Everywhere, not just on valid tokens: a NaN advantage at a padded token would still turn that
    # token's gradient into NaN (0·NaN) on its way back into the model.
    check_finite("advantages", advantages)
    return mask


def _log_ratio(log_prob: Tensor, old_log_prob: Tensor) -> Tensor:
    return torch.clamp(log_prob - old_log_prob, -20.0, 20.0)


def _clipped_ratio(
    ratio: Tensor, advantages: Tensor, clip_ratio_low: float, clip_ratio_high: float, clip_ratio_c: float = math.inf
) -> Tensor:
    """The ratio ρ̃ with which PPO's clipped surrogate is exactly −A·ρ̃:

        max(−Aρ, −A·clip(ρ, 1−ε_low, 1+ε_high)) = −A·min(ρ, 1+ε_high)     if A ≥ 0
                                                = −A·max(ρ, 1−ε_low)      if A < 0
        and the dual clip, min(·, −A·c) for A < 0, caps the latter:   −A·clamp(ρ, 1−ε_low, c)

    One clamp with per-token bounds: the same values, and no gradient wherever a clip is active, in
    fewer passes over the tokens than the max/min form (about half the time, forward and backward, on CPU).
    """
    negative = advantages < 0
    lower = torch.where(negative, ratio.new_tensor(1.0 - clip_ratio_low), ratio.new_tensor(-math.inf))
    upper = torch.where(negative, ratio.new_tensor(clip_ratio_c), ratio.new_tensor(1.0 + clip_ratio_high))
    return torch.clamp(ratio, lower, upper)


def _clip_fraction(ratio: Tensor, advantages: Tensor, clip_ratio_low: float, clip_ratio_high: float) -> Tensor:
    """Tokens where the clipped term of the surrogate is the active one (−A·clip(ρ) > −Aρ)."""
    return ((advantages > 0) & (ratio > 1.0 + clip_ratio_high)) | ((advantages < 0) & (ratio < 1.0 - clip_ratio_low))


@register_policy_loss("vanilla")
def vanilla(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
) -> TokenLoss:
    """PPO clipped surrogate (Schulman et al. 2017) with clip-higher (DAPO) and dual clip (Ye et al. 2020).

        L = max(−Aρ, −A·clip(ρ, 1−ε_low, 1+ε_high))
        L = min(L, −A·c)            for A < 0 only (dual clip, c = clip_ratio_c > 1)
          = −A·ρ̃                    (see `_clipped_ratio`)

    metrics: clipfrac (the clip is active), clipfrac_lower (the dual clip is active: A < 0, ρ > c),
    ppo_kl = logπ_old − logπ (k1 estimate of KL(π_old‖π)).
    """
    if clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1 (dual-clip lower bound on the ratio), got {clip_ratio_c}")
    _check_inputs(log_prob, old_log_prob, advantages, response_mask)
    log_ratio = _log_ratio(log_prob, old_log_prob)
    ratio = torch.exp(log_ratio)
    loss = -advantages * _clipped_ratio(ratio, advantages, clip_ratio_low, clip_ratio_high, clip_ratio_c)
    ratio = ratio.detach()
    return TokenLoss(
        loss=loss,
        metrics={
            "clipfrac": _clip_fraction(ratio, advantages, clip_ratio_low, clip_ratio_high),
            "clipfrac_lower": (advantages < 0) & (ratio > clip_ratio_c),
            "ppo_kl": -log_ratio.detach(),
        },
    )


@register_policy_loss("gpg", "reinforce")
def policy_gradient(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
) -> TokenLoss:
    """Plain policy gradient, no ratio, no clip: L = −A·logπ.

    `gpg`: the GPG paper's loss (with its α already folded into A by the `gpg` estimator), token-mean.
    `reinforce`: the ReMax paper's REINFORCE loss −Σ A·logπ·m / Σm (token-mean).
    `old_log_prob` only feeds the ppo_kl diagnostic.
    """
    _check_inputs(log_prob, old_log_prob, advantages, response_mask)
    return TokenLoss(loss=-advantages * log_prob, metrics={"ppo_kl": (old_log_prob - log_prob).detach()})


@register_policy_loss("gspo")
def gspo(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_ratio_low: float = 3e-4,
    clip_ratio_high: float = 4e-4,
) -> TokenLoss:
    """Group Sequence Policy Optimization (Zheng et al. 2025, arXiv 2507.18071).

        log s_i   = (1/|o_i|) Σ_t (logπ − logπ_old)                           sequence-level ratio
        log s_i,t = min(logπ − sg(logπ) + sg(log s_i), 10)                    value s_i, gradient of logπ
        L         = max(−A s_i,t, −A·clip(s_i,t, 1−ε_low, 1+ε_high))  (= −A·s̃, see `_clipped_ratio`),
                    aggregated seq-mean-token-mean

    Default ε are the paper's (3e-4, 4e-4): the sequence ratio moves far less than a token's.
    """
    mask = _check_inputs(log_prob, old_log_prob, advantages, response_mask)
    lengths = mask.sum(-1).clamp(min=1)
    seq_log_ratio = masked_sum(log_prob - old_log_prob, mask, -1) / lengths
    token_log_ratio = log_prob - log_prob.detach() + seq_log_ratio.detach().unsqueeze(-1)
    ratio = torch.exp(torch.clamp(token_log_ratio, max=10.0))
    loss = -advantages * _clipped_ratio(ratio, advantages, clip_ratio_low, clip_ratio_high)
    return TokenLoss(
        loss=loss,
        metrics={
            "clipfrac": _clip_fraction(ratio.detach(), advantages, clip_ratio_low, clip_ratio_high),
            "ppo_kl": (old_log_prob - log_prob).detach(),
        },
        agg_mode="seq-mean-token-mean",
    )


@register_policy_loss("cispo")
def cispo(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
) -> TokenLoss:
    """Clipped IS-weight Policy Optimization (MiniMax-M1, arXiv 2506.13585).

        L = −sg(clip(ρ, 1−ε_low, 1+ε_high)) · A · logπ

    Every token keeps a gradient (the IS weight is clipped, not the update).
    metrics: clipfrac (ρ outside the range), ppo_kl.
    """
    _check_inputs(log_prob, old_log_prob, advantages, response_mask)
    log_ratio = _log_ratio(log_prob, old_log_prob)
    ratio = torch.exp(log_ratio).detach()
    weight = torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    return TokenLoss(
        loss=-weight * advantages * log_prob,
        metrics={"clipfrac": weight != ratio, "ppo_kl": -log_ratio.detach()},
    )


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    response_mask: Tensor,
    *,
    clip_range_value: float = 0.5,
) -> TokenLoss:
    """PPO clipped value loss (per token):

        L = ½ · max((V − R)², (clip(V, V_old − ε_v, V_old + ε_v) − R)²),   ε_v = clip_range_value

    metrics: vf_clipfrac (the clipped term is strictly the larger one, as verl's
    `compute_value_loss`: (clip(V) − R)² > (V − R)²).
    """
    response_mask_as_bool(response_mask)
    check_same_shape("values", values, "response_mask", response_mask)
    check_same_shape("old_values", old_values, "response_mask", response_mask)
    check_same_shape("returns", returns, "response_mask", response_mask)
    check_finite("returns", returns)
    # Clamp V itself, not V_old + clamp(V − V_old): that sum is V ± 1 ulp in fp32/bf16 when nothing is
    # clipped, which would count the token in vf_clipfrac half the time.
    clipped_values = torch.clamp(values, old_values - clip_range_value, old_values + clip_range_value)
    unclipped_error = (values - returns).square()
    clipped_error = (clipped_values - returns).square()
    return TokenLoss(
        loss=0.5 * torch.maximum(unclipped_error, clipped_error),
        metrics={"vf_clipfrac": (clipped_error > unclipped_error).detach()},
    )


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Per-token entropy of the policy: H = logsumexp(z) − Σ_v softmax(z)_v · z_v, (B, T, V) → (B, T).

    The entropy bonus enters the per-token loss as `loss − entropy_coeff · H` before aggregation.
    """
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(-1)
