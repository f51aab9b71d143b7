"""Driver-side step 5: token rewards (with optional KL in the reward) and advantages, from config.

Input batch fields: ``token_level_scores`` (B, T) (the outcome score on each response's last valid
token), ``response_mask`` (B, T), ``uid`` (B,) int group ids; as the method needs: ``old_log_probs``
and ``ref_log_probs`` (KL in reward), ``values`` (gae), ``greedy_scores`` (remax), ``old_log_probs`` and
``sum_pi_squared`` (the optimal token baselines; ``rollout_is_weights`` when the batch has them), the reward
function's extra outputs (``meta["reward_extra_keys"]``: gdpo's reward components, handed as ``reward_extras``).
Output fields: ``token_level_rewards``, ``advantages``, ``returns`` (the critic's target where the
estimator defines one, else the advantages).
"""

from __future__ import annotations

import torch
from omegaconf import DictConfig

from meshrl.algorithms import ADVANTAGE_ESTIMATORS, KLController, apply_kl_penalty, call_with_available
from meshrl.protocol import Batch
from meshrl.config.run_plan import ESTIMATOR_BATCH_INPUTS, ESTIMATOR_SETTINGS
from meshrl.trainer.dumps import REWARD_EXTRA_KEYS
from meshrl.workers.sequences import sampled


def outcome_to_token_scores(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Place each response's outcome score on its last valid token: r_{i,t} = s_i·[t = last_i], last_i the
    last t with m_{i,t} = 1 (a multi-turn response's mask has gaps at tool outputs, so not its count − 1)."""
    valid = response_mask.bool()
    if not valid.any(-1).all():
        empty = torch.nonzero(~valid.any(-1)).flatten().tolist()
        raise ValueError(f"responses {empty[:8]} have no valid token; cannot place their scores")
    positions = torch.arange(valid.shape[-1]).expand_as(valid)
    last = torch.where(valid, positions, -1).max(-1).values
    token_scores = torch.zeros(response_mask.shape, dtype=torch.float32)
    token_scores[torch.arange(len(scores)), last] = scores.float()
    return token_scores


def compute_token_rewards(batch: Batch, algo: DictConfig, kl_ctrl: KLController | None,
                          kl_in_reward: str | None) -> dict[str, float]:
    """``token_level_rewards`` = scores, minus β·KL per token of type ``kl_in_reward`` (the run plan's: the
    ``algorithm.kl_penalty`` of ``algorithm.use_kl_in_reward``; None: no KL in the reward).

    With ``algorithm.remax.reward_clip`` = c > 0, scores are first clipped to [−c, c], for every
    estimator; so is ReMax's baseline ``greedy_scores`` (rewritten in the batch), so that the sampled
    and the greedy response are scored on the same scale.
    """
    scores = batch["token_level_scores"]
    clip = algo.remax.reward_clip
    if clip > 0:  # the ReMax paper clips rewards to ±5
        scores = scores.clamp(-clip, clip)
        if "greedy_scores" in batch:
            batch.set("greedy_scores", batch["greedy_scores"].clamp(-clip, clip))
    if kl_in_reward is None:
        batch.set("token_level_rewards", scores)
        return {}
    penalised = apply_kl_penalty(scores, batch["old_log_probs"], batch["ref_log_probs"], batch["response_mask"],
                                 kl_coef=kl_ctrl.value, kl_type=kl_in_reward)
    batch.set("token_level_rewards", penalised.rewards)
    metrics = {"actor/reward_kl_penalty": float(penalised.mean_kl), "actor/reward_kl_coef": kl_ctrl.value}
    kl_ctrl.update(penalised.mean_kl, n_steps=len(batch))
    return metrics


def compute_advantages(batch: Batch, algo: DictConfig, estimator_name: str) -> dict[str, float]:
    """Run the estimator ``estimator_name`` (the run plan's ``algorithm.adv_estimator``: a registered name or
    ``module:function``) on the batch, with ``algo``'s settings for it."""
    estimator = ADVANTAGE_ESTIMATORS.get(estimator_name)
    available = {name: batch[name] for name in ESTIMATOR_BATCH_INPUTS if name in batch}
    extras = {key: batch[key] for key in batch.meta.get(REWARD_EXTRA_KEYS, ())}
    available.update(reward_extras=extras, **{name: read(algo) for name, read in ESTIMATOR_SETTINGS.items()})
    # every sampled token, rejected ones too
    # (algorithm.rollout_correction.rollout_rs: meshrl.trainer.rollout_correction)
    out = call_with_available(estimator, batch["token_level_rewards"], sampled(batch), **available)
    batch.set("advantages", out.advantages)
    batch.set("returns", out.returns if out.returns is not None else out.advantages)
    mask = batch["response_mask"].bool()
    valid = out.advantages[mask]
    metrics = {"critic/advantages/mean": float(valid.mean()), "critic/advantages/max": float(valid.max()),
               "critic/advantages/min": float(valid.min())}
    metrics.update({(k if "/" in k else f"algo/{k}"): float(v) for k, v in out.metrics.items()})
    return metrics
