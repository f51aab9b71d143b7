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

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

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
    # scalars worth logging (e.g. GPG's α), logged as algo/<name>; a name with its own prefix keeps it (gdpo/...)
    metrics: dict[str, Tensor] = field(default_factory=dict)


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


@register_advantage("grpo", "grpo_vectorized")
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

    Also registered as ``grpo_vectorized``, verl's scatter-based implementation of the same formula (in fp32
    there; the values agree up to that rounding).
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


@register_advantage("rloo_vectorized")
@torch.no_grad()
def rloo_vectorized(token_rewards: Tensor, response_mask: Tensor, *, uid: Tensor) -> AdvantageOutput:
    """verl's vectorised RLOO: `rloo`'s formula, but a group of one gets A_i = 0 (`rloo`: s_i).

        A_i = (n_g·s_i − Σ_{j in g} s_j) / (n_g − 1)   for n_g > 1,   0 for n_g = 1

    Not an alias of `rloo`: the two differ exactly on groups of one (as verl's two functions do).
    """
    mask, rewards = _prepare(token_rewards, response_mask)
    scores = rewards.sum(-1)
    stats = group_stats(scores, uid)
    per_response = torch.where(stats.size > 1, stats.size / (stats.size - 1).clamp(min=1) * (scores - stats.mean), 0.0)
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


def reward_component(name: str, values: Sequence[Any], like: Tensor) -> Tensor:
    """One per-response reward component (a reward function's extra output ``name``) as a (B,) tensor in the
    dtype of ``like``; a response without it (its reward call failed: scored 0) counts 0."""
    if len(values) != like.shape[0]:
        raise ValueError(f"reward component {name!r} has {len(values)} values for {like.shape[0]} responses")
    try:
        numbers = [0.0 if v is None else float(v) for v in values]
    except (TypeError, ValueError) as error:
        raise ValueError(f"reward component {name!r} must be a number per response ({error})") from error
    out = torch.tensor(numbers, dtype=like.dtype, device=like.device)
    check_finite(f"reward component {name!r}", out)
    return out


@register_advantage("gdpo")
@torch.no_grad()
def gdpo(
    token_rewards: Tensor,
    response_mask: Tensor,
    *,
    uid: Tensor,
    reward_extras: Mapping[str, Sequence[Any]] | None = None,
    gdpo_reward_keys: Sequence[str] | None = None,
    gdpo_reward_weights: Sequence[float] | None = None,
    norm_adv_by_std_in_grpo: bool = True,
    epsilon: float = 1e-6,
) -> AdvantageOutput:
    """GDPO, group reward-decoupled normalisation (arXiv 2601.05242): each reward component normalised in its
    group on its own, so that a large component does not drown the others, then summed and whitened.

        c_{i,k} = component k of response i: the reward function's extra output `gdpo_reward_keys[k]`
        A_{i,k} = (c_{i,k} − mean_g(c_k)) / (std_g(c_k) + ε)      each component's GRPO advantage
                  (c_{i,k} − mean_g(c_k) with norm_adv_by_std_in_grpo=False)
        A_i     = Σ_k w_k · A_{i,k}                                w = gdpo_reward_weights (default all 1)
        A       = whiten(A_i broadcast over the tokens)            over the valid tokens of the batch

    `reward_extras` holds the reward function's extra outputs by name (the entries of its returned dict other
    than "score"), one value per response; a response without one counts 0 (its reward call failed). Without
    `gdpo_reward_keys` the one component is the outcome score s_i (verl's function called without a config;
    verl's trainer requires the keys, and so does meshrl's config check).

    verl's trainer hands gdpo no `norm_adv_by_std_in_grpo` (its default True applies whatever the config says);
    meshrl passes the config's, as it does to `grpo_passk`. The default is verl's.
    """
    mask, rewards = _prepare(token_rewards, response_mask)
    check_has_valid_token(mask)
    scores = rewards.sum(-1)
    if gdpo_reward_keys:
        extras = reward_extras or {}
        missing = [key for key in gdpo_reward_keys if key not in extras]
        if missing:
            raise ValueError(f"gdpo: reward component(s) {missing} (algorithm.gdpo_reward_keys) are not among the "
                             f"reward function's extra outputs {sorted(extras)}; its returned dict must hold them "
                             "beside 'score'")
        components = [reward_component(key, extras[key], scores) for key in gdpo_reward_keys]
    else:
        components = [scores]
    weights = [1.0] * len(components) if gdpo_reward_weights is None else [float(w) for w in gdpo_reward_weights]
    if len(weights) != len(components):
        raise ValueError(f"gdpo: {len(weights)} gdpo_reward_weights for {len(components)} reward components")
    total = torch.zeros_like(scores)
    for component, weight in zip(components, weights):
        stats = group_stats(component, uid)
        centred = component - stats.mean
        total = total + weight * (centred / (stats.std + epsilon) if norm_adv_by_std_in_grpo else centred)
    # verl's per-component statistics over the batch (std: the population's, as np.std)
    metrics = {f"gdpo/{key}/{name}": value for key, component in zip(gdpo_reward_keys or (), components)
               for name, value in (("mean", component.double().mean()), ("std", component.double().std(correction=0)),
                                   ("max", component.max()), ("min", component.min()))}
    return AdvantageOutput(advantages=masked_whiten(_broadcast(total, mask), mask), metrics=metrics)


def _path_variance(mask: Tensor, old_log_probs: Tensor, sum_pi_squared: Tensor,
                   rollout_is_weights: Tensor | None) -> Tensor:
    """W_t = Σ_{j ≤ t, m_j} ρ_j² (1 − 2π_j + Σ_v π_{j,v}²), π_j = exp(old_log_probs_j): (B, T), carried past
    masked tokens."""
    check_same_shape("old_log_probs", old_log_probs, "response_mask", mask)
    check_same_shape("sum_pi_squared", sum_pi_squared, "response_mask", mask)
    w = 1 - 2 * torch.where(mask, old_log_probs, 0.0).exp() + torch.where(mask, sum_pi_squared, 0.0)
    if rollout_is_weights is not None:
        check_same_shape("rollout_is_weights", rollout_is_weights, "response_mask", mask)
        w = w * torch.where(mask, rollout_is_weights, 0.0).square()
    w = torch.where(mask, w, 0.0)
    check_finite("1 - 2π + Σπ² (from old_log_probs and sum_pi_squared)", w, "valid")
    return w.cumsum(-1)


def _token_baseline(returns: Tensor, weights: Tensor, lengths: Tensor, members: Tensor, uid: Tensor,
                    epsilon: float, handle_zero_tail: bool) -> Tensor:
    """B_{g,k} = Σ_{i in g} G_{i,k} W_{i,k} / (Σ_{i in g} W_{i,k} + ε) per column k, read back per response (B, T).

    `returns` G and `weights` W are 0 where a response has no token. A group counts its `members` (B,) only,
    and one of fewer than two members gets B = 0. With `handle_zero_tail`, a group's unique longest member (by
    `lengths`) gets B = 0 from column L₂ on, L₂ the longest length among the group's other members.
    """
    index = uid.long()
    groups = num_groups(uid, returns.shape[0])
    size = group_sum(members.to(returns.dtype), index, groups)[index]
    numerator = returns.new_zeros(groups, returns.shape[1]).index_add_(0, index, returns * weights)
    denominator = returns.new_zeros(groups, returns.shape[1]).index_add_(0, index, weights) + epsilon
    baseline = torch.where((size > 1).unsqueeze(-1), (numerator / denominator)[index], 0.0)
    if not handle_zero_tail:
        return baseline
    length = torch.where(members, lengths.to(returns.dtype), -1.0)
    is_longest = members & (length == group_amax(length, index, groups)[index])
    unique = group_sum(is_longest.to(returns.dtype), index, groups)[index] == 1
    second = group_amax(torch.where(is_longest, -1.0, length), index, groups)[index]
    tail = (is_longest & unique & (size > 1)).unsqueeze(-1)
    columns = torch.arange(returns.shape[1], device=returns.device)
    return torch.where(tail & (columns >= second.unsqueeze(-1)), 0.0, baseline)


def _otb_inputs(token_rewards: Tensor, response_mask: Tensor, old_log_probs: Tensor, sum_pi_squared: Tensor,
                rollout_is_weights: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """(bool mask, reward-to-go G (B, T) with 0 at masked tokens, W (B, T) of `_path_variance` with 0 there)."""
    mask, rewards = _prepare(token_rewards, response_mask)
    check_has_valid_token(mask)
    returns = torch.where(mask, rewards.flip(-1).cumsum(-1).flip(-1), 0.0)
    weights = torch.where(mask, _path_variance(mask, old_log_probs, sum_pi_squared, rollout_is_weights), 0.0)
    return mask, returns, weights


@register_advantage("optimal_token_baseline")
@torch.no_grad()
def optimal_token_baseline(
    token_rewards: Tensor,
    response_mask: Tensor,
    *,
    uid: Tensor,
    old_log_probs: Tensor,
    sum_pi_squared: Tensor,
    rollout_is_weights: Tensor | None = None,
    handle_zero_tail: bool = True,
    epsilon: float = 1e-8,
) -> AdvantageOutput:
    """Optimal Token Baseline (verl's OTB): a baseline per prompt group and token position, each trajectory
    weighted by the score-function energy it has accumulated up to that position.

        G_{i,t} = Σ_{t' ≥ t} r_{i,t'}                                   reward-to-go (the returns)
        w_{i,t} = 1 − 2π_{i,t} + Σ_v π_{i,t,v}²   (× ρ_{i,t}² with rollout IS weights ρ)
                  π_{i,t} = exp(old_log_probs), Σπ² = `sum_pi_squared` (actor.calculate_sum_pi_squared)
        W_{i,t} = Σ_{j ≤ t} w_{i,j} m_{i,j}
        B_{g,t} = Σ_{i in g} G_{i,t} W_{i,t} m_{i,t} / (Σ_{i in g} W_{i,t} m_{i,t} + ε)    per position t
        A_{i,t} = (G_{i,t} − B_{g,t}) · m_{i,t}                          a group of one: B = 0

    `handle_zero_tail`: in a group whose longest response is unique, that response gets B = 0 from position
    L₂ on (L₂: the second-longest length, counted in valid tokens, as verl does), where its baseline would be
    its own return. Positions are columns of the response: a multi-turn response (masked tool output) lines
    its tokens up with the others' by column; `tir_optimal_token_baseline` lines them up by valid-token count.
    Every response counts in its group, one without valid tokens too (verl's).
    """
    mask, returns, weights = _otb_inputs(token_rewards, response_mask, old_log_probs, sum_pi_squared,
                                         rollout_is_weights)
    members = torch.ones_like(mask[:, 0])
    baseline = _token_baseline(returns, weights, mask.sum(-1), members, uid, epsilon, handle_zero_tail)
    return AdvantageOutput(advantages=torch.where(mask, returns - baseline, 0.0), returns=returns)


@register_advantage("tir_optimal_token_baseline")
@torch.no_grad()
def tir_optimal_token_baseline(
    token_rewards: Tensor,
    response_mask: Tensor,
    *,
    uid: Tensor,
    old_log_probs: Tensor,
    sum_pi_squared: Tensor,
    rollout_is_weights: Tensor | None = None,
    handle_zero_tail: bool = True,
    epsilon: float = 1e-8,
) -> AdvantageOutput:
    """`optimal_token_baseline` for multi-turn (tool-integrated) responses: G and W as there, but the baseline
    runs over each response's k-th valid token instead of its t-th column, so tool outputs (masked) do not
    shift one response's turns against another's.

        k(i, t) = Σ_{j ≤ t} m_{i,j} − 1                                  the valid-token index of token t
        B_{g,k} = Σ_{i in g} G_{i,k} W_{i,k} / (Σ_{i in g} W_{i,k} + ε)  over the responses with a k-th token
        A_{i,t} = (G_{i,t} − B_{g,k(i,t)}) · m_{i,t}

    Groups count the responses with at least one valid token (one with none gets A = 0); `handle_zero_tail`
    zeroes the unique longest response's B from its L₂-th valid token on. Without gaps in the masks, this is
    `optimal_token_baseline`.
    """
    mask, returns, weights = _otb_inputs(token_rewards, response_mask, old_log_probs, sum_pi_squared,
                                         rollout_is_weights)
    lengths = mask.sum(-1)
    # Each response's valid tokens moved to the front, in order (a stable sort puts the masked ones last).
    order = torch.sort((~mask).to(torch.int8), dim=-1, stable=True).indices
    packed = torch.arange(mask.shape[1], device=mask.device) < lengths.unsqueeze(-1)
    packed_returns = torch.where(packed, returns.gather(-1, order), 0.0)
    packed_weights = torch.where(packed, weights.gather(-1, order), 0.0)
    baseline = _token_baseline(packed_returns, packed_weights, lengths, lengths > 0, uid, epsilon, handle_zero_tail)
    advantages = torch.zeros_like(returns).scatter_(-1, order, packed_returns - baseline)
    return AdvantageOutput(advantages=torch.where(mask, advantages, 0.0), returns=returns)
