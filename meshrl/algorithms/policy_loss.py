"""Policy losses (`actor.policy_loss.loss_mode`), the value loss and the entropy of the policy.

Each loss returns a `TokenLoss`: the *per-token* loss L_{i,t} and per-token diagnostics, not yet masked
or averaged, so the caller aggregates them with `aggregation.aggregate_loss` against normalisers of the
whole mini-batch (see there for why). Notation: ρ = exp(clamp(logπ − logπ_old, −20, 20)),
sg = stop-gradient, A the advantages. Every policy loss has the signature
`(log_prob, old_log_prob, advantages, response_mask, *, <options>)`.

clip_cov and kl_cov pick tokens by statistics of the micro-batch they are given (as verl): they alone
depend on the split of the mini-batch (see `clip_cov`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from meshrl.algorithms.masked import masked_mean, masked_sum
from meshrl.algorithms.registry import register_policy_loss
from meshrl.algorithms.validation import check_finite, check_same_shape, response_mask_as_bool


@dataclass(frozen=True)
class TokenLoss:
    loss: Tensor  # (B, T) per-token loss, to be aggregated with the response mask
    # (B, T) detached diagnostics (bool indicators or values), to be token-mean aggregated like the loss.
    metrics: dict[str, Tensor] = field(default_factory=dict)
    agg_mode: str | None = None  # the aggregation the method prescribes (gspo, sapo, geo_mean); None: configured
    # (B, T) bool: the tokens the loss is aggregated over when the method narrows the response mask itself
    # (bypass_mode's rejection sampling); None: the response mask. Metrics stay over the response mask.
    response_mask: Tensor | None = None


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


def _dppo_loss(
    log_prob: Tensor, old_log_prob: Tensor, advantages: Tensor, keep: Tensor, clip_ratio_c: float
) -> TokenLoss:
    """DPPO's loss given its trust region `keep`: L = −A·sg(min(ρ, C))·logπ where kept, 0 (no gradient) outside."""
    log_ratio = _log_ratio(log_prob, old_log_prob).detach()
    ratio = torch.exp(log_ratio)
    weight = torch.clamp(ratio, max=clip_ratio_c)
    return TokenLoss(
        loss=torch.where(keep, -advantages * weight * log_prob, 0.0),
        metrics={"clipfrac": ~keep, "clipfrac_lower": keep & (ratio > clip_ratio_c), "ppo_kl": -log_ratio},
    )


@register_policy_loss("dppo_tv")
def dppo_tv(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 20.0,
) -> TokenLoss:
    """DPPO-Binary-TV (Qi et al. 2026, arXiv 2602.04879): a truncated-IS policy gradient whose trust region is
    the total variation of the token's probability p = π(token) = exp(logπ), instead of PPO's ratio:

        keep = p − p_old ≤ δ_high     if A > 0
               p − p_old ≥ −δ_low     otherwise
        L    = −A · sg(min(ρ, C)) · logπ · keep                    C = clip_ratio_c

    δ are the actor's clip_ratio_low / high, read as thresholds on the probability (verl's convention).
    C caps the IS weight (truncated IS, not a dual clip); the paper recommends a large one (verl's example
    script: 10000). verl falls back on 20 only without the key, which its actor config always holds (3.0
    by default), as meshrl's does: the trainer passes actor.clip_ratio_c.
    metrics: clipfrac (outside the trust region), clipfrac_lower (kept, with the weight truncated: ρ > C),
    ppo_kl.
    """
    _check_inputs(log_prob, old_log_prob, advantages, response_mask)
    moved = log_prob.detach().exp() - old_log_prob.exp()
    keep = torch.where(advantages > 0, moved <= clip_ratio_high, moved >= -clip_ratio_low)
    return _dppo_loss(log_prob, old_log_prob, advantages, keep, clip_ratio_c)


@register_policy_loss("dppo_kl")
def dppo_kl(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 20.0,
) -> TokenLoss:
    """DPPO-Binary-KL (arXiv 2602.04879): `dppo_tv` with the KL divergence of the binary distributions
    {token, any other token} as the trust region:

        D    = p_old·log(p_old/p) + (1 − p_old)·log((1 − p_old + 1e-8) / (1 − p + 1e-8))
        keep = D ≤ δ_high or p ≤ p_old     if A > 0   (only a move in the advantage's direction is limited)
               D ≤ δ_low  or p ≥ p_old     otherwise
        L    = −A · sg(min(ρ, C)) · logπ · keep

    Thresholds, C and metrics as `dppo_tv`'s.
    """
    _check_inputs(log_prob, old_log_prob, advantages, response_mask)
    current = log_prob.detach()
    prob, old_prob = current.exp(), old_log_prob.exp()
    divergence = old_prob * (old_log_prob - current) + (1 - old_prob) * torch.log(
        (1.0 - old_prob + 1e-8) / (1.0 - prob + 1e-8)
    )
    keep = torch.where(
        advantages > 0,
        (divergence <= clip_ratio_high) | (prob <= old_prob),
        (divergence <= clip_ratio_low) | (prob >= old_prob),
    )
    return _dppo_loss(log_prob, old_log_prob, advantages, keep, clip_ratio_c)


@register_policy_loss("sapo")
def sapo(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
) -> TokenLoss:
    """Soft Adaptive Policy Optimization (SAPO, arXiv 2511.20347): a smooth gate on ρ instead of a clip.

        τ    = τ_pos if A > 0 else τ_neg                        (actor.tau_pos / tau_neg)
        f(ρ) = σ(τ(ρ − 1)) · 4/τ
        L    = −A · f(ρ),  aggregated seq-mean-token-mean (as verl, whatever loss_agg_mode says)

    dL/dlogπ = −A · ρ · 4σ(1 − σ): −A on-policy (ρ = 1), fading smoothly as ρ leaves 1, never cut off;
    τ_neg > τ_pos makes updates of negative advantage fade faster.
    metrics: ppo_kl (verl also reports clip fractions, always 0 for this loss).
    """
    if tau_pos <= 0 or tau_neg <= 0:
        raise ValueError(f"tau_pos and tau_neg must be > 0 (SAPO's gate divides by them), got {tau_pos}, {tau_neg}")
    _check_inputs(log_prob, old_log_prob, advantages, response_mask)
    log_ratio = _log_ratio(log_prob, old_log_prob)
    tau = torch.where(advantages > 0, advantages.new_tensor(tau_pos), advantages.new_tensor(tau_neg))
    gate = torch.sigmoid(tau * (torch.exp(log_ratio) - 1.0)) * (4.0 / tau)
    return TokenLoss(loss=-advantages * gate, metrics={"ppo_kl": -log_ratio.detach()}, agg_mode="seq-mean-token-mean")


def _covariance(advantages: Tensor, log_prob: Tensor, mask: Tensor) -> Tensor:
    """Each token's term (A − Ā)(logπ − mean logπ) of the covariance of A and logπ over the batch's valid tokens."""
    log_prob = log_prob.detach()
    return (advantages - masked_mean(advantages, mask)) * (log_prob - masked_mean(log_prob, mask))


@register_policy_loss("clip_cov")
def clip_cov(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_cov_ratio: float = 0.0002,
    clip_cov_lb: float = 1.0,
    clip_cov_ub: float = 5.0,
) -> TokenLoss:
    """Clip-Cov (Cui et al. 2025, arXiv 2505.22617): PPO's clipped surrogate, without dual clip, with the gradient
    of a few tokens of high covariance between advantage and log-prob (those that collapse the entropy) removed:

        cov_t = (A_t − Ā)·(logπ_t − mean logπ)         means over the valid tokens of the micro-batch
        S     = max(⌊r·N⌋, 1) tokens drawn at random (torch's global generator) among the valid tokens that PPO
                does not clip and whose clip_cov_lb < cov_t < clip_cov_ub; all of them if fewer.
                N: the micro-batch's valid tokens, r = clip_cov_ratio
        L     = max(−Aρ, −A·clip(ρ, 1−ε_low, 1+ε_high))    (= −A·ρ̃, see `_clipped_ratio`),  0 on S

    The tokens are picked per micro-batch, as verl does, and so depend on the split into micro-batches and
    ranks, unlike every other loss here: over the whole mini-batch, the mean of logπ under the parameters
    being updated would need the forward pass of every micro-batch before the first backward, i.e. a second
    forward pass of the mini-batch. The loss is still aggregated against the mini-batch's normalisers.

    metrics: clipfrac = the tokens of S (verl's pg_clipfrac for this loss: the covariance clip, not PPO's),
    ppo_kl. ρ is clamped as the other losses' (verl's clip_cov does not: the same unless |logπ − logπ_old| > 20).
    """
    if clip_cov_ratio <= 0:
        raise ValueError(f"clip_cov_ratio must be > 0 (the fraction of tokens clip_cov may pick), got {clip_cov_ratio}")
    mask = _check_inputs(log_prob, old_log_prob, advantages, response_mask)
    log_ratio = _log_ratio(log_prob, old_log_prob)
    ratio = torch.exp(log_ratio)
    clipped = _clip_fraction(ratio.detach(), advantages, clip_ratio_low, clip_ratio_high)
    cov = _covariance(advantages, log_prob, mask)
    candidates = torch.nonzero(mask & ~clipped & (cov > clip_cov_lb) & (cov < clip_cov_ub))
    count = max(int(clip_cov_ratio * int(mask.sum())), 1)
    picked = candidates[torch.randperm(len(candidates))[:count].to(candidates.device)]
    selected = torch.zeros_like(mask)
    selected[picked[:, 0], picked[:, 1]] = True
    loss = -advantages * _clipped_ratio(ratio, advantages, clip_ratio_low, clip_ratio_high)
    return TokenLoss(
        loss=torch.where(selected, 0.0, loss),
        metrics={"clipfrac": selected, "ppo_kl": (old_log_prob - log_prob).detach()},
    )


@register_policy_loss("kl_cov")
def kl_cov(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    kl_cov_ratio: float = 0.0002,
    ppo_kl_coef: float = 0.1,
) -> TokenLoss:
    """KL-Cov (Cui et al. 2025, arXiv 2505.22617): the unclipped surrogate, with a penalty on the log-ratio of
    the tokens of largest covariance between advantage and log-prob:

        cov_t as `clip_cov`'s: over the valid tokens of the micro-batch (see there why)
        S     = the max(⌊r·N⌋, 1) valid tokens of largest cov_t              r = kl_cov_ratio
        L     = −Aρ + β·|logπ − logπ_old|·[t ∈ S]                           β = ppo_kl_coef

    metrics: ppo_kl = |logπ − logπ_old|: verl reports the absolute log-ratio under this key for this loss.
    ρ is clamped as the other losses' (verl's kl_cov does not: the same unless |logπ − logπ_old| > 20).
    """
    if kl_cov_ratio <= 0:
        raise ValueError(f"kl_cov_ratio must be > 0 (the fraction of tokens kl_cov penalises), got {kl_cov_ratio}")
    mask = _check_inputs(log_prob, old_log_prob, advantages, response_mask)
    cov = torch.where(mask, _covariance(advantages, log_prob, mask), -math.inf)
    count = max(int(int(mask.sum()) * kl_cov_ratio), 1)
    selected = torch.zeros(mask.numel(), dtype=torch.bool, device=mask.device)
    selected[torch.topk(cov.flatten(), count).indices] = True
    abs_log_ratio = (log_prob - old_log_prob).abs()
    penalty = torch.where(selected.view_as(mask), ppo_kl_coef * abs_log_ratio, 0.0)
    return TokenLoss(
        loss=-advantages * torch.exp(_log_ratio(log_prob, old_log_prob)) + penalty,
        metrics={"ppo_kl": abs_log_ratio.detach()},
    )


@register_policy_loss("geo_mean")
def geo_mean(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    rollout_is_weights: Tensor | None = None,
) -> TokenLoss:
    """Geometric-Mean Policy Optimization (GMPO, arXiv 2507.20673): a response's ratio is the
    geometric mean of its tokens' ratios, each clipped one-sidedly in log space first:

        Δ_t = logπ − logπ_old
        Δ̃_t = min(Δ_t, ε_high) if A_t > 0,  max(Δ_t, −ε_low) if A_t < 0,  0 if A_t = 0
              (verl's sgn(A)·min(sgn(A)·Δ, sgn(A)·clip(Δ, −ε_low, ε_high)))
        L_i = −Â_i · exp(Σ_t Δ̃_t / |o_i|),   Â_i = Σ_t A_t / |o_i|
        loss = the mean of L_i over the responses

    L_i is written on every token of response i and aggregated seq-mean-token-mean, which is Σ_i L_i / N_seqs
    exactly, gradient included, over the whole mini-batch and for any split. verl takes the mean of L_i over
    the rows of each micro-batch, ignoring its global-batch normalisers: the same for one micro-batch on one
    rank without empty responses (N_seqs counts responses with a valid token, as verl's seq-mean modes do).
    Rollout-correction IS weights w (decoupled mode) scale L_i by their geometric mean over the response,
    exp(Σ_t log(w_t + 1e-10) / |o_i|), as verl does, not token by token as the other losses' weights.
    metrics: clipfrac / clipfrac_lower: Δ_t outside [−ε_low, ε_high] at a token with A_t > 0 / A_t < 0 (verl's
    meaning), ppo_kl. No clamp on Δ (as verl).
    """
    mask = _check_inputs(log_prob, old_log_prob, advantages, response_mask)
    log_ratio = log_prob - old_log_prob
    positive, negative = advantages > 0, advantages < 0
    lower = torch.where(negative, log_ratio.new_tensor(-clip_ratio_low), log_ratio.new_tensor(-math.inf))
    upper = torch.where(positive, log_ratio.new_tensor(clip_ratio_high), log_ratio.new_tensor(math.inf))
    clipped_log_ratio = torch.where(positive | negative, torch.clamp(log_ratio, lower, upper), 0.0)
    lengths = mask.sum(-1).clamp(min=1)
    sequence_ratio = torch.exp(masked_sum(clipped_log_ratio, mask, -1) / lengths)
    sequence_advantage = masked_sum(advantages, mask, -1) / lengths
    sequence_loss = -sequence_advantage * sequence_ratio
    if rollout_is_weights is not None:
        check_same_shape("rollout_is_weights", rollout_is_weights, "response_mask", response_mask)
        sequence_loss = sequence_loss * torch.exp(masked_sum(torch.log(rollout_is_weights + 1e-10), mask, -1) / lengths)
    log_ratio = log_ratio.detach()
    outside = (log_ratio < -clip_ratio_low) | (log_ratio > clip_ratio_high)
    return TokenLoss(
        loss=sequence_loss.unsqueeze(-1).expand_as(log_prob),
        metrics={"clipfrac": outside & positive, "clipfrac_lower": outside & negative, "ppo_kl": -log_ratio},
        agg_mode="seq-mean-token-mean",
    )


@register_policy_loss("dro")
def dro(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    dro_beta: float | None,
) -> TokenLoss:
    """Direct Reward Optimization as verl writes it: the policy gradient with a quadratic penalty on the
    log-ratio instead of a clip,

        L = −(A·logπ − ½β·(logπ − logπ_old)²)          β = policy_loss.dro_beta, required, > 0

    metrics: ppo_kl.
    """
    if dro_beta is None or dro_beta <= 0:
        raise ValueError(f"policy_loss.dro_beta must be > 0 for loss_mode=dro (DRO's penalty), got {dro_beta}")
    _check_inputs(log_prob, old_log_prob, advantages, response_mask)
    log_ratio = log_prob - old_log_prob
    return TokenLoss(
        loss=-(advantages * log_prob - 0.5 * dro_beta * log_ratio.square()),
        metrics={"ppo_kl": -log_ratio.detach()},
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
