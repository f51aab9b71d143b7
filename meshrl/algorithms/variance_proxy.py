"""verl's gradient-variance proxies (``variance_proxy/*``, its ``metric_utils.compute_variance_proxy_metrics``),
logged for a batch that carries the policy's per-token Σ_v π_v² (the old-log-prob pass computes it for the optimal
token baselines: ``actor.calculate_sum_pi_squared``). With π_t = exp(old log-prob) of the sampled token, A the
advantages, m the response mask, N responses, and w the rollout IS weights when the batch has them::

    W_t  = 1 − 2 π_t + Σ_v π_t(v)²           (× w_t² with IS weights)     the score-norm proxy per token
    W(τ) = Σ_t m_t W_t,   Ā(τ) = Σ_t m_t A_t / Σ_t m_t
    proxy2_total_power  = mean_τ Ā² · max(W, 0)                          on-policy
                        = mean_τ w̄² · Ā² · max(Σ_t m_t W_t / max(w_t², 1e-10), 0),  w̄ = mean_t w_t   with IS weights
    proxy1_signal_strength = ‖g‖² (the actor's gradient norm squared; 0 without one)
    proxy3_pure_noise   = max(0, (proxy2 − proxy1) / (N − 1))            (0 for N = 1 or without a gradient norm)
    expected_a_squared  = mean_τ Ā²,   expected_w = mean_τ W             (W as above, unclamped)
"""

from __future__ import annotations

from torch import Tensor

from meshrl.algorithms.masked import masked_mean, masked_sum


def variance_proxy_metrics(old_log_probs: Tensor, sum_pi_squared: Tensor, advantages: Tensor, response_mask: Tensor,
                           rollout_is_weights: Tensor | None = None, gradient_norm: float | None = None
                           ) -> dict[str, float]:
    """The ``variance_proxy/*`` metrics (module docstring); (B, T) tensors, ``response_mask`` boolean."""
    mask = response_mask.bool()
    w_token = 1 - 2 * old_log_probs.exp() + sum_pi_squared
    if rollout_is_weights is not None:
        w_token = w_token * rollout_is_weights.detach() ** 2
    adv = masked_mean(advantages, mask, dim=-1)
    w = masked_sum(w_token, mask, dim=-1)
    if rollout_is_weights is None:
        total_power = (adv ** 2 * w.clamp(min=0)).mean()
    else:
        w_bar = masked_mean(rollout_is_weights, mask, dim=-1)
        w_original = masked_sum(w_token / (rollout_is_weights.detach() ** 2).clamp(min=1e-10), mask, dim=-1)
        total_power = (w_bar ** 2 * adv ** 2 * w_original.clamp(min=0)).mean()
    signal = None if gradient_norm is None else float(gradient_norm) ** 2
    n = adv.shape[0]
    noise = max(0.0, (float(total_power) - signal) / (n - 1)) if signal is not None and n > 1 else 0.0
    return {"variance_proxy/proxy1_signal_strength": signal if signal is not None else 0.0,
            "variance_proxy/proxy2_total_power": float(total_power),
            "variance_proxy/proxy3_pure_noise": noise,
            "variance_proxy/expected_a_squared": float((adv ** 2).mean()),
            "variance_proxy/expected_w": float(w.mean())}


__all__ = ["variance_proxy_metrics"]
