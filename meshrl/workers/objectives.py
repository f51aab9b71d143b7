"""The actor's and the critic's training objectives, assembled from ``meshrl.algorithms`` by config.

For one micro-batch k of a mini-batch with global normaliser N (``GlobalNorm``):

    actor:  ℓ_k = agg(L_policy) − c_H · agg(H) + c_KL · agg(kl(logπ, logπ_ref))
    critic: ℓ_k = agg(½ max((V−R)², (clip(V, V_old ± ε_v) − R)²))

where every ``agg`` divides by N (token-sum by nothing), so Σ_k ℓ_k over micro-batches *and* data-parallel
ranks is the mini-batch loss, whatever the split (but for the tokens that clip_cov / kl_cov pick in each
micro-batch, as verl: ``meshrl.algorithms.policy_loss.clip_cov``). Diagnostics are returned the same way
(``Σ m·mask / N_tokens``), so summing them over micro-batches and ranks gives exact mini-batch token means.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass, field

from omegaconf import DictConfig
from torch import Tensor

from meshrl.algorithms import GlobalNorm, aggregate_loss, call_with_available, get_policy_loss, kl_penalty, value_loss
from meshrl.algorithms.rollout_correction import RolloutCorrectionSettings


# actor.policy_loss's keys other than loss_mode
POLICY_LOSS_OPTIONS = ("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub", "kl_cov_ratio", "ppo_kl_coef", "dro_beta")


def _token_share(values: Tensor, mask: Tensor, norm: GlobalNorm) -> Tensor:
    """This micro-batch's share of the mini-batch token mean of ``values``."""
    return (values.float() * mask).sum() / norm.num_tokens


@dataclass(frozen=True)
class ActorObjective:
    loss_mode: str
    loss_agg_mode: str
    clip_ratio_low: float
    clip_ratio_high: float
    clip_ratio_c: float
    entropy_coeff: float
    use_kl_loss: bool
    kl_loss_coef: float
    kl_loss_type: str
    # the other losses' options (sapo's actor.tau_*, actor.policy_loss.*), by verl's names: each loss takes its own
    loss_options: Mapping[str, float | None] = field(default_factory=dict)
    # algorithm.rollout_correction (the run plan's): bypass_mode's settings (decoupled IS weights come per micro-batch)
    rollout_correction: RolloutCorrectionSettings | None = None

    @classmethod
    def from_config(cls, actor: DictConfig, plan) -> "ActorObjective":
        """From the ``actor`` section and the run plan (``plan``: its loss, ``bypass_mode`` in rollout correction's
        bypass mode whatever ``policy_loss.loss_mode`` says, as verl's trainer sets it; its aggregation and its
        rollout correction)."""
        return cls(
            loss_mode=plan.policy_loss,
            loss_agg_mode=plan.loss_agg_mode,
            clip_ratio_low=actor.clip_ratio_low if actor.clip_ratio_low is not None else actor.clip_ratio,
            clip_ratio_high=actor.clip_ratio_high if actor.clip_ratio_high is not None else actor.clip_ratio,
            clip_ratio_c=actor.clip_ratio_c,
            entropy_coeff=actor.entropy_coeff,
            use_kl_loss=actor.use_kl_loss,
            kl_loss_coef=actor.kl_loss_coef,
            kl_loss_type=actor.kl_loss_type,
            loss_options={"tau_pos": actor.tau_pos, "tau_neg": actor.tau_neg,
                          **{key: actor.policy_loss[key] for key in POLICY_LOSS_OPTIONS}},
            rollout_correction=plan.rollout_correction,
        )

    @property
    def needs_entropy(self) -> bool:
        return self.entropy_coeff != 0

    def __call__(self, log_probs: Tensor, entropy: Tensor | None, mb: dict[str, Tensor],
                 norm: GlobalNorm) -> tuple[Tensor, dict[str, Tensor]]:
        """(ℓ_k, diagnostics) for response-aligned (b, R) ``log_probs`` / ``entropy`` of micro-batch ``mb``."""
        mask = mb["response_mask"]
        weights = mb.get("rollout_is_weights")  # algorithm.rollout_correction.rollout_is, decoupled mode
        fn = get_policy_loss(self.loss_mode)
        policy = call_with_available(fn, log_probs, mb["old_log_probs"], mb["advantages"], mask,
                                     clip_ratio_low=self.clip_ratio_low, clip_ratio_high=self.clip_ratio_high,
                                     clip_ratio_c=self.clip_ratio_c, **self.loss_options,
                                     rollout_correction=self.rollout_correction, rollout_is_weights=weights)
        # algorithm.rollout_correction's IS weights multiply the loss token by token, as in verl; a loss that names
        # rollout_is_weights applies them itself
        token_loss = policy.loss
        if weights is not None and "rollout_is_weights" not in inspect.signature(fn).parameters:
            token_loss = token_loss * weights
        # a loss may narrow the tokens it is aggregated over (bypass_mode's rejection); metrics keep the response mask
        loss_mask = mask if policy.response_mask is None else policy.response_mask
        policy_loss = aggregate_loss(token_loss, loss_mask, policy.agg_mode or self.loss_agg_mode, norm)
        loss = policy_loss
        metrics = {"actor/pg_loss": policy_loss.detach()}
        # a metric named with its own prefix (bypass_mode's rollout_corr/*) keeps it
        metrics.update({(k if "/" in k else f"actor/{k}"): _token_share(v, mask, norm)
                        for k, v in policy.metrics.items()})
        if entropy is not None:
            entropy_loss = aggregate_loss(entropy, mask, self.loss_agg_mode, norm)
            loss = loss - self.entropy_coeff * entropy_loss
            metrics["actor/entropy"] = _token_share(entropy.detach(), mask, norm)
        if self.use_kl_loss:
            kl = kl_penalty(log_probs, mb["ref_log_probs"], self.kl_loss_type)
            kl_loss = aggregate_loss(kl, mask, self.loss_agg_mode, norm)
            loss = loss + self.kl_loss_coef * kl_loss
            metrics["actor/kl_loss"] = kl_loss.detach()
        return loss, metrics


@dataclass(frozen=True)
class CriticObjective:
    loss_agg_mode: str
    cliprange_value: float

    @classmethod
    def from_config(cls, critic: DictConfig, plan) -> "CriticObjective":
        """From the ``critic`` section; its ``loss_agg_mode`` defaults to the actor's (the plan's), as in verl."""
        return cls(loss_agg_mode=critic.loss_agg_mode or plan.loss_agg_mode, cliprange_value=critic.cliprange_value)

    def __call__(self, values: Tensor, mb: dict[str, Tensor], norm: GlobalNorm) -> tuple[Tensor, dict[str, Tensor]]:
        mask = mb["response_mask"]
        out = value_loss(values, mb["values"], mb["returns"], mask, clip_range_value=self.cliprange_value)
        loss = aggregate_loss(out.loss, mask, self.loss_agg_mode, norm)
        metrics = {"critic/vf_loss": loss.detach(),
                   "critic/vf_clipfrac": _token_share(out.metrics["vf_clipfrac"], mask, norm),
                   "critic/vpred_mean": _token_share(values.detach(), mask, norm)}
        return loss, metrics


def sum_metrics(parts: list[dict[str, Tensor]]) -> dict[str, float]:
    """Add up per-micro-batch metric shares (see module doc) into mini-batch values."""
    total: dict[str, float] = {}
    for part in parts:
        for key, value in part.items():
            total[key] = total.get(key, 0.0) + float(value)
    return total

