"""Advantage estimators, under the names verl users type in `algorithm.adv_estimator`.

Notation (as in the project's algorithm reference): B responses, response i has token rewards r_{i,t}
and mask m_{i,t}; its outcome score is s_i = Σ_t r_{i,t}·m_{i,t}; g = g(i) is its prompt group (`uid`),
n_g the group size. "std" is the unbiased (n−1) standard deviation. A group of one has mean 0, std 1.

Every estimator takes `(token_rewards, response_mask, *, <batch inputs>, <options>)`, runs without
autograd on the whole rollout batch (so batch/group statistics are global by construction), returns
an `AdvantageOutput` whose advantages are 0 at masked tokens, and ignores whatever masked positions
hold. Call one by name with `registry.call_with_available(ADVANTAGE_ESTIMATORS.get(name), ...)`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor

from meshrl.algorithms.groups import group_amax, group_amin, group_stats, group_sum, num_groups
from meshrl.algorithms.masked import masked_whiten, reverse_linear_scan
from meshrl.algorithms.registry import register_advantage
from meshrl.algorithms.validation import (
    check_finite,
    check_has_valid_token,
    check_per_response,
    check_same_shape,
    response_mask_as_bool,
)


@dataclass(frozen=True)
class AdvantageOutput:
    advantages: Tensor  # (B, T), 0 at masked tokens
    returns: Tensor | None = None  # (B, T) return targets, for estimators that define them (a critic's target)
    metrics: dict[str, Tensor] = field(default_factory=dict)  # scalars worth logging (e.g. GPG's α)


def _prepare(token_rewards: Tensor, response_mask: Tensor) -> tuple[Tensor, Tensor]:
    """Validate the common inputs; return (bool mask, rewards with masked positions set to 0)."""
    mask = response_mask_as_bool(response_mask)
    check_same_shape("token_rewards", token_rewards, "response_mask", response_mask)
    rewards = torch.where(mask, token_rewards, 0.0)
    check_finite("token_rewards", rewards, "valid")
    return mask, rewards


def _broadcast(per_response: Tensor, mask: Tensor) -> Tensor:
    """A_{i,t} = A_i on valid tokens, 0 elsewhere."""
    return torch.where(mask, per_response.unsqueeze(-1), 0.0)


@register_advantage("gae")
@torch.no_grad()
def gae(
    token_rewards: Tensor,
    response_mask: Tensor,
    *,
    values: Tensor,
    gamma: float = 1.0,
    lam: float = 1.0,
) -> AdvantageOutput:
    """Generalised Advantage Estimation (Schulman et al. 2016), the PPO estimator.

        δ_t = r_t + γ V_{t+1} − V_t
        A_t = δ_t + γλ A_{t+1}
        returns_t = A_t + V_t                           (before whitening)
        A ← (A − μ)/sqrt(σ² + 1e-8)                      over the valid tokens of the batch

    Masked tokens inside a response (e.g. tool observations in a multi-turn rollout) are skipped:
    "t+1" is the next *valid* token, so they carry neither reward, value nor discount.
    """
    mask, rewards = _prepare(token_rewards, response_mask)
    check_same_shape("values", values, "response_mask", response_mask)
    check_has_valid_token(mask)
    values = torch.where(mask, values, 0.0)
    check_finite("values", values, "valid")
    # V of the next valid token: y_t = V_t if m_t else y_{t+1}, read at t+1.
    value_here_or_later = reverse_linear_scan(values, ~mask)
    next_values = torch.nn.functional.pad(value_here_or_later[:, 1:], (0, 1))
    deltas = torch.where(mask, rewards + gamma * next_values - values, 0.0)
    # A_t = δ_t + γλ A_{t+1} on valid tokens; masked tokens pass A_{t+1} through unchanged (decay 1).
    # γλ in the dtype of δ (the scan's): an fp32 constant would cost fp64 inputs their precision.
    decay = torch.where(mask, deltas.new_tensor(gamma * lam), 1.0)
    raw_advantages = reverse_linear_scan(deltas, decay)
    returns = torch.where(mask, raw_advantages + values, 0.0)
    return AdvantageOutput(advantages=masked_whiten(raw_advantages, mask), returns=returns)


@register_advantage("grpo")
@torch.no_grad()
def grpo(
    token_rewards: Tensor,
    response_mask: Tensor,
    *,
    uid: Tensor,
    norm_adv_by_std_in_grpo: bool = True,
    epsilon: float = 1e-6,
) -> AdvantageOutput:
    """GRPO (Shao et al. 2024, DeepSeekMath), outcome supervision.

        A_i = (s_i − mean_g) / (std_g + ε)          broadcast over the tokens of response i
        A_i = s_i − mean_g                          norm_adv_by_std_in_grpo=False (Dr.GRPO, arXiv 2503.20783)
    """
    mask, rewards = _prepare(token_rewards, response_mask)
    scores = rewards.sum(-1)
    stats = group_stats(scores, uid)
    centred = scores - stats.mean
    per_response = centred / (stats.std + epsilon) if norm_adv_by_std_in_grpo else centred
    return AdvantageOutput(advantages=_broadcast(per_response, mask))


@register_advantage("rloo")
@torch.no_grad()
def rloo(token_rewards: Tensor, response_mask: Tensor, *, uid: Tensor) -> AdvantageOutput:
    """REINFORCE Leave-One-Out (Ahmadian et al. 2024, arXiv 2402.14740).

        A_i = s_i − (1/(n_g−1)) Σ_{j in g, j≠i} s_j  =  n_g/(n_g−1) · (s_i − mean_g)

    A group of one has no other sample: baseline 0, A_i = s_i (n/(n−1) is taken as 1 and mean_g as 0).
    """
    mask, rewards = _prepare(token_rewards, response_mask)
    scores = rewards.sum(-1)
    stats = group_stats(scores, uid)
    per_response = stats.size / (stats.size - 1).clamp(min=1) * (scores - stats.mean)
    return AdvantageOutput(advantages=_broadcast(per_response, mask))


@register_advantage("remax")
@torch.no_grad()
def remax(token_rewards: Tensor, response_mask: Tensor, *, greedy_scores: Tensor) -> AdvantageOutput:
    """ReMax (Li et al. 2023, arXiv 2310.10505): REINFORCE with the greedy response as baseline.

        b_i = r(x_i, ŷ_i)                     score of the greedy decode for response i's prompt
        A_{i,t} = Σ_{t' ≥ t} r_{i,t'} − b_i    reverse cumulative return minus the baseline

    No whitening, no critic. `greedy_scores` (B,) repeats each prompt's baseline for each of its
    samples. Masked tokens inside a response add no reward, so the return flows past them. The paper
    clips rewards to ±5 (`algorithm.remax.reward_clip`: the trainer clips the sampled and the greedy
    scores alike before this runs) and folds a per-token KL into r (see `kl.apply_kl_penalty`).
    """
    mask, rewards = _prepare(token_rewards, response_mask)
    check_per_response("greedy_scores", greedy_scores, rewards.shape[0])
    check_finite("greedy_scores", greedy_scores)
    returns = rewards.flip(-1).cumsum(-1).flip(-1)
    advantages = torch.where(mask, returns - greedy_scores.unsqueeze(-1), 0.0)
    return AdvantageOutput(advantages=advantages, returns=torch.where(mask, returns, 0.0))


GpgAlphaMode = Literal["paper", "verl"]


@torch.no_grad()
def gpg_alpha(scores: Tensor, uid: Tensor, mode: GpgAlphaMode = "paper") -> Tensor:
    """GPG's gradient correction α (scalar tensor).

        paper (AMAP-ML/GPG): α = B / (B − M), M = #responses in groups (of ≥ 2) whose scores are all
                             identical, i.e. whose advantages are all zero (no signal)
        verl:                α = B / count_nonzero(s)   (with 0/1 rewards: B / #correct)

    Denominators are clamped at 1; when every group is degenerate all advantages are 0 anyway.
    """
    batch = scores.shape[0]
    if mode == "verl":
        return batch / torch.count_nonzero(scores).clamp(min=1).to(scores.dtype)
    if mode != "paper":
        raise ValueError(f"gpg_alpha_mode must be 'paper' or 'verl', got {mode!r}")
    groups = num_groups(uid, batch)
    index = uid.long()
    size = group_sum(torch.ones_like(scores), index, groups)
    no_signal = (group_amax(scores, index, groups) == group_amin(scores, index, groups)) & (size > 1)
    zero_signal_responses = size[no_signal].sum()
    return batch / (batch - zero_signal_responses).clamp(min=1)


@register_advantage("gpg")
@torch.no_grad()
def gpg(
    token_rewards: Tensor,
    response_mask: Tensor,
    *,
    uid: Tensor,
    norm_by_std: bool = False,
    gpg_alpha_mode: GpgAlphaMode = "paper",
    epsilon: float = 1e-6,
) -> AdvantageOutput:
    """Group Policy Gradient (Chu et al. 2025, arXiv 2504.02546; AMAP-ML/GPG).

        A_i = α · (s_i − mean_g) / F_norm,   F_norm = std_g + ε if norm_by_std else 1
        α   = `gpg_alpha(s, uid, gpg_alpha_mode)`  (paper: B/(B−M); "verl": B/count_nonzero(s))

    α is folded into the advantages (it rescales the gradient of −Σ logπ·A·m/Σm, the `gpg` loss);
    it is also reported as metrics["gpg_alpha"].
    """
    mask, rewards = _prepare(token_rewards, response_mask)
    scores = rewards.sum(-1)
    stats = group_stats(scores, uid)
    f_norm = stats.std + epsilon if norm_by_std else 1.0
    alpha = gpg_alpha(scores, uid, gpg_alpha_mode)
    per_response = alpha * (scores - stats.mean) / f_norm
    return AdvantageOutput(advantages=_broadcast(per_response, mask), metrics={"gpg_alpha": alpha})


@register_advantage("reinforce_plus_plus")
@torch.no_grad()
def reinforce_plus_plus(token_rewards: Tensor, response_mask: Tensor, *, gamma: float = 1.0) -> AdvantageOutput:
    """REINFORCE++ (Hu 2025, arXiv 2501.03262).

        G_t = r_t + γ · G_{t'}      t' the next valid token after t (G = 0 past the last one)
        A   = whiten(G) · m         whitened over the valid tokens of the batch

    Masked tokens inside a response (tool output in a multi-turn rollout) are skipped, as in `gae`:
    they carry neither reward nor discount, and the return flows past them to the earlier turns.
    """
    mask, rewards = _prepare(token_rewards, response_mask)
    check_has_valid_token(mask)
    # Masked tokens pass G_{t+1} through unchanged (decay 1). γ in the rewards' dtype: an fp32 γ
    # would cost fp64 inputs their precision.
    decay = torch.where(mask, rewards.new_tensor(gamma), 1.0)
    returns = torch.where(mask, reverse_linear_scan(rewards, decay), 0.0)
    return AdvantageOutput(advantages=masked_whiten(returns, mask), returns=returns)


@register_advantage("reinforce_plus_plus_baseline")
@torch.no_grad()
def reinforce_plus_plus_baseline(token_rewards: Tensor, response_mask: Tensor, *, uid: Tensor) -> AdvantageOutput:
    """REINFORCE++ with a group baseline (arXiv 2501.03262).

        A_{i,t} = whiten_batch(s_i − mean_g) · m_{i,t}     whitened over all valid tokens of the batch
    """
    mask, rewards = _prepare(token_rewards, response_mask)
    check_has_valid_token(mask)
    scores = rewards.sum(-1)
    centred = scores - group_stats(scores, uid).mean
    return AdvantageOutput(advantages=masked_whiten(_broadcast(centred, mask), mask))


@register_advantage("opo")
@torch.no_grad()
def opo(token_rewards: Tensor, response_mask: Tensor, *, uid: Tensor) -> AdvantageOutput:
    """On-Policy RL with Optimal reward baseline (Hao et al. 2025, arXiv 2505.23585).

        b_g = Σ_{j in g} |o_j| s_j / Σ_{j in g} |o_j|      length-weighted group mean
        A_i = s_i − b_g                                     (a group of one: b = 0)
    """
    mask, rewards = _prepare(token_rewards, response_mask)
    scores = rewards.sum(-1)
    lengths = mask.sum(-1).to(scores.dtype)
    stats = group_stats(scores, uid)  # validates uid, gives group sizes
    groups = num_groups(uid, scores.shape[0])
    index = uid.long()
    weighted = group_sum(lengths * scores, index, groups) / group_sum(lengths, index, groups).clamp(min=1)
    baseline = torch.where(stats.size > 1, weighted[index], 0.0)
    return AdvantageOutput(advantages=_broadcast(scores - baseline, mask))


@register_advantage("grpo_passk")
@torch.no_grad()
def grpo_passk(
    token_rewards: Tensor,
    response_mask: Tensor,
    *,
    uid: Tensor,
    norm_adv_by_std_in_grpo: bool = True,
    epsilon: float = 1e-6,
) -> AdvantageOutput:
    """Pass@k GRPO (arXiv 2503.19595): only the best sample of each group is credited.

        A_best = (r_max − r_second) / (std_g + ε)     (or r_max − r_second without normalisation)
        A_other = 0

    Ties for the best go to the lowest batch index (and then r_max − r_second = 0). Groups need ≥ 2 samples.
    """
    mask, rewards = _prepare(token_rewards, response_mask)
    scores = rewards.sum(-1)
    stats = group_stats(scores, uid)
    if bool((stats.size < 2).any()):
        lonely = torch.unique(uid[stats.size < 2])[:5].tolist()
        raise ValueError(f"grpo_passk needs >= 2 samples per group; uid group(s) {lonely} have 1")
    batch = scores.shape[0]
    groups = num_groups(uid, batch)
    index = uid.long()
    best_score = group_amax(scores, index, groups)
    position = torch.arange(batch, device=scores.device)
    candidates = torch.where(scores == best_score[index], position, batch)
    best_position = candidates.new_full((groups,), batch).scatter_reduce_(0, index, candidates, "amin")
    is_best = position == best_position[index]
    second_score = group_amax(torch.where(is_best, -torch.inf, scores), index, groups)
    gap = (best_score - second_score)[index]
    if norm_adv_by_std_in_grpo:
        gap = gap / (stats.std + epsilon)
    return AdvantageOutput(advantages=_broadcast(torch.where(is_best, gap, 0.0), mask))
