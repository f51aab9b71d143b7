"""Agreement with verl: every registered estimator, policy loss and KL type against reference values.

The references below are written from scratch from the formulas of verl's `trainer/ppo/core_algos.py`
(and `ray_trainer.apply_kl_penalty`), in plain Python floats (double precision), one response and one
token at a time: no meshrl code computes an expected value, and no verl code is imported. Inputs are
seeded and random, with prompt groups (`uid`, a group of one included) and masks with gaps (masked
tokens inside a response, as tool output in a multi-turn rollout). Each is run in fp64 (tolerance
1e-6) and in fp32 (1e-5); the references read the very values the fp32 run sees.

Conventions shared with verl (its trainer guarantees them, meshrl's functions do not need them):
token rewards are 0 at masked tokens (meshrl gets garbage there instead, which it must ignore).
Where verl leaves a value at a masked token that nothing reads (GAE's carried advantage, ReMax's
returns), meshrl's contract is 0 there, and so is the reference's.

Where meshrl offers more than verl, the verl-compatible setting is checked against verl's formula
and the other settings against their papers' (as documented on the estimator):
  gpg   verl: gpg_alpha_mode="verl", norm_by_std=False (α = B/count_nonzero(s), F_norm = 1).
        Paper (AMAP-ML/GPG): α = B/(B − M), M the responses of groups (≥ 2) with identical scores;
        norm_by_std divides by std_g + ε.
  gdpo  verl's trainer never hands it norm_adv_by_std_in_grpo (always / std); meshrl passes the key, and False
        is checked as each component's c − mean_g.
A newly registered name without a reference here fails `test_every_registered_name_has_a_reference`.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from meshrl.algorithms import (
    ADVANTAGE_ESTIMATORS,
    KL_PENALTIES,
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    GlobalNorm,
    aggregate_loss,
    apply_kl_penalty,
    call_with_available,
    kl_penalty,
    value_loss,
)
from meshrl.algorithms.rollout_correction import RolloutCorrectionSettings, off_policy_metrics, rollout_correction

Matrix = list[list[float]]
TOLERANCE = {torch.float64: 1e-6, torch.float32: 1e-5}
DTYPES = list(TOLERANCE)
BATCH, WIDTH = 15, 9
GROUP_SIZES = (3, 4, 1, 2, 5)  # a group of one: mean 0, std 1 in verl
PAIRED_GROUP_SIZES = (3, 4, 2, 2, 4)  # grpo_passk needs >= 2 samples per group


# --------------------------------------------------------------------------------------- inputs


def random_mask(generator: torch.Generator) -> torch.Tensor:
    """Right-padded responses of 3..WIDTH tokens; most have a masked span strictly inside them."""
    mask = torch.zeros(BATCH, WIDTH, dtype=torch.bool)
    for i, length in enumerate(torch.randint(3, WIDTH + 1, (BATCH,), generator=generator).tolist()):
        mask[i, :length] = True
        if i % 5 != 4:  # a gap: first and last token stay valid
            start = int(torch.randint(1, length - 1, (1,), generator=generator))
            end = int(torch.randint(start + 1, length, (1,), generator=generator))
            mask[i, start:end] = False
    return mask


def shuffled_uid(generator: torch.Generator, sizes: tuple[int, ...]) -> torch.Tensor:
    """Group ids of `sizes`, in a random batch order (groups need not be contiguous)."""
    uid = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
    return uid[torch.randperm(len(uid), generator=generator)]


@dataclass
class Rollout:
    """A batch as meshrl receives it (tensors) and as the references read it (lists of floats)."""

    tensors: dict[str, Any]
    mask: list[list[bool]]
    rewards: Matrix  # 0 at masked tokens
    values: Matrix
    greedy: list[float]
    uid: list[int]
    # The optimal token baselines': the sampled tokens' old log-probs, Σ_v π_v², rollout IS weights.
    old_log_probs: Matrix = field(default_factory=list)
    sum_pi_squared: Matrix = field(default_factory=list)
    is_weights: Matrix = field(default_factory=list)
    components: dict[str, list[float]] = field(default_factory=dict)  # gdpo's reward components per response
    optional: dict[str, torch.Tensor] = field(default_factory=dict)  # handed to meshrl by a case (its `inputs`)


def make_rollout(family: str, dtype: torch.dtype, sizes: tuple[int, ...] = GROUP_SIZES) -> Rollout:
    """`dense`: a random reward on every token (process rewards, KL in the reward).
    `outcome`: a 0/1 score on each response's last valid token: ties, all-equal groups, zero scores.
    """
    generator = torch.Generator().manual_seed(1234)
    mask = random_mask(generator)
    uid = shuffled_uid(generator, sizes)
    if family == "dense":
        rewards = torch.randn(BATCH, WIDTH, generator=generator, dtype=torch.float64)
    else:
        scores = torch.randint(0, 2, (BATCH,), generator=generator).double()
        scores[uid == sizes.index(2)] = 1.0  # one all-correct group (no signal)
        last = WIDTH - 1 - mask.flip(-1).long().argmax(-1)
        rewards = torch.zeros(BATCH, WIDTH, dtype=torch.float64)
        rewards[torch.arange(BATCH), last] = scores
    rewards = torch.where(mask, rewards, 0.0).to(dtype)
    values = torch.randn(BATCH, WIDTH, generator=generator, dtype=torch.float64).to(dtype)
    greedy = torch.randn(BATCH, generator=generator, dtype=torch.float64).to(dtype)
    garbage = 1e3 * torch.randn(BATCH, WIDTH, generator=generator, dtype=torch.float64).to(dtype)
    # Drawn after the inputs above, which stay what they were. π of the sampled token in [0.05, 0.95] and
    # Σπ² = π² + (1 − π)²·u: what the rest of the mass can add (at most (1 − π)²).
    pi = 0.05 + 0.9 * torch.rand(BATCH, WIDTH, generator=generator, dtype=torch.float64)
    squares = (pi**2 + (1 - pi) ** 2 * torch.rand(BATCH, WIDTH, generator=generator, dtype=torch.float64)).to(dtype)
    old_log_probs = pi.log().to(dtype)
    is_weights = (0.5 + 1.5 * torch.rand(BATCH, WIDTH, generator=generator, dtype=torch.float64)).to(dtype)
    components = {"accuracy_reward": torch.randint(0, 2, (BATCH,), generator=generator).to(dtype),
                  "format_reward": (3 * torch.randn(BATCH, generator=generator, dtype=torch.float64)).to(dtype)}
    tensors = {
        "token_rewards": torch.where(mask, rewards, garbage),
        "response_mask": mask,
        "uid": uid,
        "values": torch.where(mask, values, -garbage),
        "greedy_scores": greedy,
        "old_log_probs": torch.where(mask, old_log_probs, garbage),
        "sum_pi_squared": torch.where(mask, squares, -garbage),
        # as the batch holds a reward function's extra outputs: a numpy array per name
        "reward_extras": {name: component.numpy() for name, component in components.items()},
    }
    return Rollout(tensors, mask.tolist(), rewards.double().tolist(), values.double().tolist(),
                   greedy.double().tolist(), uid.tolist(), old_log_probs.double().tolist(),
                   squares.double().tolist(), is_weights.double().tolist(),
                   {name: component.double().tolist() for name, component in components.items()},
                   {"rollout_is_weights": torch.where(mask, is_weights, garbage)})  # fmt: skip


# ------------------------------------------------------------------ references: plain Python


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def std(xs: list[float]) -> float:
    """Unbiased (n − 1), as torch.std."""
    mu = mean(xs)
    return math.sqrt(sum((x - mu) ** 2 for x in xs) / (len(xs) - 1))


def members(uid: list[int]) -> dict[int, list[int]]:
    groups: dict[int, list[int]] = defaultdict(list)
    for i, g in enumerate(uid):
        groups[g].append(i)
    return groups


def outcome_scores(r: Rollout) -> list[float]:
    """verl: token_level_rewards.sum(-1)."""
    return [sum(row) for row in r.rewards]


def group_mean_std(scores: list[float], uid: list[int]) -> tuple[list[float], list[float]]:
    """Each response's group mean and std; verl's group of one: mean 0, std 1."""
    groups = members(uid)
    stats = {g: (0.0, 1.0) if len(ix) == 1 else (mean([scores[i] for i in ix]), std([scores[i] for i in ix]))
             for g, ix in groups.items()}  # fmt: skip
    return [stats[g][0] for g in uid], [stats[g][1] for g in uid]


def broadcast(per_response: list[float], mask: list[list[bool]]) -> Matrix:
    return [[a if m else 0.0 for m in row] for a, row in zip(per_response, mask)]


def whiten(matrix: Matrix, mask: list[list[bool]]) -> Matrix:
    """verl_F.masked_whiten over the valid tokens of the batch: (x − μ)·rsqrt(σ²_unbiased + 1e-8)."""
    valid = [x for row, mrow in zip(matrix, mask) for x, m in zip(row, mrow) if m]
    mu = mean(valid)
    var = sum((x - mu) ** 2 for x in valid) / (len(valid) - 1)
    return [[(x - mu) / math.sqrt(var + 1e-8) if m else 0.0 for x, m in zip(row, mrow)]
            for row, mrow in zip(matrix, mask)]  # fmt: skip


@dataclass
class Reference:
    advantages: Matrix
    returns: Matrix | None = None  # None: the estimator defines no returns
    metrics: dict[str, float] = field(default_factory=dict)


def ref_gae(r: Rollout, gamma: float, lam: float) -> Reference:
    """verl compute_gae_advantage_return: observation tokens keep next value and running advantage."""
    advantages, returns = [], []
    for rewards, values, mask in zip(r.rewards, r.values, r.mask):
        next_value, running = 0.0, 0.0
        adv, ret = [0.0] * WIDTH, [0.0] * WIDTH
        for t in reversed(range(WIDTH)):
            if mask[t]:
                running = rewards[t] + gamma * next_value - values[t] + gamma * lam * running
                next_value = values[t]
                adv[t], ret[t] = running, running + values[t]
        advantages.append(adv)
        returns.append(ret)
    return Reference(whiten(advantages, r.mask), returns)


def ref_grpo(r: Rollout, norm_adv_by_std_in_grpo: bool) -> Reference:
    """verl compute_grpo_outcome_advantage: (s − mean_g)/(std_g + 1e-6), or s − mean_g (Dr.GRPO)."""
    scores = outcome_scores(r)
    mu, sigma = group_mean_std(scores, r.uid)
    adv = [(s - m) / (sd + 1e-6) if norm_adv_by_std_in_grpo else s - m for s, m, sd in zip(scores, mu, sigma)]
    return Reference(broadcast(adv, r.mask))


def ref_rloo(r: Rollout) -> Reference:
    """verl compute_rloo_outcome_advantage: n/(n−1)·s − n/(n−1)·mean_g for n > 1, else s."""
    scores = outcome_scores(r)
    groups = members(r.uid)
    adv = []
    for i, s in enumerate(scores):
        ix = groups[r.uid[i]]
        n = len(ix)
        adv.append(s * n / (n - 1) - mean([scores[j] for j in ix]) * n / (n - 1) if n > 1 else s)
    return Reference(broadcast(adv, r.mask))


def ref_remax(r: Rollout) -> Reference:
    """verl compute_remax_outcome_advantage: reverse cumsum of the masked rewards minus the baseline."""
    advantages, returns = [], []
    for rewards, mask, baseline in zip(r.rewards, r.mask, r.greedy):
        ret = [sum(rewards[t:]) if mask[t] else 0.0 for t in range(WIDTH)]
        returns.append(ret)
        advantages.append([g - baseline if m else 0.0 for g, m in zip(ret, mask)])
    return Reference(advantages, returns)


def ref_gpg(r: Rollout, mode: str, norm_by_std: bool) -> Reference:
    """verl compute_gpg_outcome_advantage (mode "verl", F_norm = 1): α·(s − mean_g), α = B/count_nonzero(s).
    Paper: α = B/(B − M), M = responses of groups of >= 2 whose scores are all equal; F_norm = std_g + ε.
    """
    scores = outcome_scores(r)
    if mode == "verl":
        alpha = BATCH / max(sum(1 for s in scores if s != 0), 1)
    else:
        flat = [ix for ix in members(r.uid).values() if len(ix) > 1 and len({scores[i] for i in ix}) == 1]
        alpha = BATCH / max(BATCH - sum(len(ix) for ix in flat), 1)
    mu, sigma = group_mean_std(scores, r.uid)
    adv = [alpha * (s - m) / (sd + 1e-6 if norm_by_std else 1.0) for s, m, sd in zip(scores, mu, sigma)]
    return Reference(broadcast(adv, r.mask), metrics={"gpg_alpha": alpha})


def ref_reinforce_plus_plus(r: Rollout, gamma: float, skip_masked: bool = True) -> Reference:
    """verl compute_reinforce_plus_plus_outcome_advantage: G_t = r_t + γ·G_{next valid token}, whitened.

    `skip_masked=False` is the bug verl and meshrl once had (the return restarts after a masked token);
    it exists only to show that this test would catch it.
    """
    returns = []
    for rewards, mask in zip(r.rewards, r.mask):
        running, ret = 0.0, [0.0] * WIDTH
        for t in reversed(range(WIDTH)):
            if mask[t]:
                running = rewards[t] + gamma * running
                ret[t] = running
            elif not skip_masked:
                running = 0.0
        returns.append(ret)
    return Reference(whiten(returns, r.mask), returns)


def ref_reinforce_plus_plus_baseline(r: Rollout) -> Reference:
    """verl: s − mean_g on every valid token, whitened over the valid tokens of the batch."""
    scores = outcome_scores(r)
    mu, _ = group_mean_std(scores, r.uid)
    return Reference(whiten(broadcast([s - m for s, m in zip(scores, mu)], r.mask), r.mask))


def ref_opo(r: Rollout) -> Reference:
    """verl compute_opo_outcome_advantage: s − Σ|o|·s/Σ|o| over the group (a group of one: s)."""
    scores = outcome_scores(r)
    lengths = [sum(row) for row in r.mask]
    groups = members(r.uid)
    adv = []
    for i, s in enumerate(scores):
        ix = groups[r.uid[i]]
        baseline = sum(lengths[j] * scores[j] for j in ix) / sum(lengths[j] for j in ix) if len(ix) > 1 else 0.0
        adv.append(s - baseline)
    return Reference(broadcast(adv, r.mask))


def ref_grpo_passk(r: Rollout, norm_adv_by_std_in_grpo: bool) -> Reference:
    """verl compute_grpo_passk_outcome_advantage: the best of each group gets r_max − r_second
    (over std_g + ε); with a tie for the best that is 0, whichever response verl's topk picks."""
    scores = outcome_scores(r)
    adv = [0.0] * BATCH
    for ix in members(r.uid).values():
        best, second = sorted(ix, key=lambda i: -scores[i])[:2]
        gap = scores[best] - scores[second]
        adv[best] = gap / (std([scores[i] for i in ix]) + 1e-6) if norm_adv_by_std_in_grpo else gap
    return Reference(broadcast(adv, r.mask))


def ref_rloo_vectorized(r: Rollout) -> Reference:
    """verl compute_rloo_vectorized_outcome_advantage: (n·s − Σ_g s)/(n − 1) for n > 1, 0 for a group of one."""
    scores = outcome_scores(r)
    groups = members(r.uid)
    adv = []
    for i, s in enumerate(scores):
        ix = groups[r.uid[i]]
        n = len(ix)
        adv.append((n * s - sum(scores[j] for j in ix)) / (n - 1) if n > 1 else 0.0)
    return Reference(broadcast(adv, r.mask))


def ref_gdpo(r: Rollout, gdpo_reward_keys: list[str] | None, gdpo_reward_weights: list[float] | None,
             norm_adv_by_std_in_grpo: bool) -> Reference:
    """verl compute_gdpo_outcome_advantage: each component's GRPO advantage (c − mean_g)/(std_g + 1e-6), summed
    with the weights (default 1), whitened over the valid tokens of the batch. No keys: the one component is
    the outcome score (verl's function without a config). Without std: c − mean_g (meshrl passes the key)."""
    components = [r.components[key] for key in gdpo_reward_keys] if gdpo_reward_keys else [outcome_scores(r)]
    weights = gdpo_reward_weights or [1.0] * len(components)
    total = [0.0] * BATCH
    for component, weight in zip(components, weights):
        mu, sigma = group_mean_std(component, r.uid)
        for i, c in enumerate(component):
            total[i] += weight * ((c - mu[i]) / (sigma[i] + 1e-6) if norm_adv_by_std_in_grpo else c - mu[i])
    return Reference(whiten(broadcast(total, r.mask), r.mask))


def ref_optimal_token_baseline(r: Rollout, is_weights: bool, tir: bool = False) -> Reference:
    """verl compute_optimal_token_baseline_advantage (tir: compute_multi_turn_optimal_token_baseline_advantage),
    handle_zero_tail=True, ε = 1e-8:

        G_t = Σ_{t' ≥ t} r_t'   w_t = (1 − 2·exp(old_log_prob_t) + Σπ²_t)·ρ_t²   W_t = Σ_{j ≤ t} w_j·m_j
        B_k = Σ_i G_{i,k}·W_{i,k} / (Σ_i W_{i,k} + ε) over the group's responses that have a token k
        A_t = G_t − B_k     (a group of one: B = 0)

    k is the column t, or with `tir` the index of t among the response's valid tokens. Zero tail: a group's
    unique longest response (by valid-token count L) gets B = 0 from k = L₂, the group's second-longest L.
    Returns G on valid tokens (0 on the others, meshrl's contract).
    """
    tokens, returns = [], []  # per response: [(k, G_t, W_t)] over its valid tokens; G on the (B, T) grid
    for i in range(BATCH):
        running_w, row, ret = 0.0, [], [0.0] * WIDTH
        for t in range(WIDTH):
            if r.mask[i][t]:
                w = 1 - 2 * math.exp(r.old_log_probs[i][t]) + r.sum_pi_squared[i][t]
                running_w += w * (r.is_weights[i][t] ** 2 if is_weights else 1.0)
                ret[t] = sum(r.rewards[i][t:])
                row.append((len(row) if tir else t, ret[t], running_w))
        tokens.append(row)
        returns.append(ret)
    lengths = [len(row) for row in tokens]
    baseline: dict[tuple[int, int], float] = {}  # (response, k) -> B
    for ix in members(r.uid).values():
        if len(ix) == 1:
            continue
        for k in range(WIDTH):
            cells = [(g, w) for i in ix for (kk, g, w) in tokens[i] if kk == k]
            numerator = sum(g * w for g, w in cells)
            denominator = sum(w for _, w in cells) + 1e-8
            for i in ix:
                baseline[i, k] = numerator / denominator
        longest = max(lengths[i] for i in ix)
        at_longest = [i for i in ix if lengths[i] == longest]
        if len(at_longest) == 1:
            second = max(lengths[i] for i in ix if i != at_longest[0])
            for k in range(second, WIDTH):
                baseline[at_longest[0], k] = 0.0
    advantages = [[0.0] * WIDTH for _ in range(BATCH)]
    for i, row in enumerate(tokens):
        for position, (k, g, _) in zip([t for t in range(WIDTH) if r.mask[i][t]], row):
            advantages[i][position] = g - baseline.get((i, k), 0.0)
    return Reference(advantages, returns)


def ref_tir_optimal_token_baseline(r: Rollout, is_weights: bool) -> Reference:
    return ref_optimal_token_baseline(r, is_weights, tir=True)


@dataclass(frozen=True)
class EstimatorCase:
    reference: Callable[..., Reference]
    options: dict[str, Any] = field(default_factory=dict)
    group_sizes: tuple[int, ...] = GROUP_SIZES
    inputs: tuple[str, ...] = ()  # Rollout.optional inputs handed to meshrl (e.g. rollout_is_weights)


ESTIMATOR_REFERENCES: dict[str, list[EstimatorCase]] = {
    "gae": [EstimatorCase(ref_gae, {"gamma": 0.95, "lam": 0.9}), EstimatorCase(ref_gae, {"gamma": 1.0, "lam": 1.0})],
    "grpo": [EstimatorCase(ref_grpo, {"norm_adv_by_std_in_grpo": norm}) for norm in (True, False)],
    "rloo": [EstimatorCase(ref_rloo)],
    "remax": [EstimatorCase(ref_remax)],
    "gpg": [
        EstimatorCase(ref_gpg, {"mode": "verl", "norm_by_std": False}),  # verl's GPG
        EstimatorCase(ref_gpg, {"mode": "paper", "norm_by_std": False}),  # meshrl's default (the paper's α)
        EstimatorCase(ref_gpg, {"mode": "paper", "norm_by_std": True}),
    ],
    "reinforce_plus_plus": [EstimatorCase(ref_reinforce_plus_plus, {"gamma": g}) for g in (0.9, 1.0)],
    "reinforce_plus_plus_baseline": [EstimatorCase(ref_reinforce_plus_plus_baseline)],
    "opo": [EstimatorCase(ref_opo)],
    "grpo_passk": [
        EstimatorCase(ref_grpo_passk, {"norm_adv_by_std_in_grpo": norm}, PAIRED_GROUP_SIZES) for norm in (True, False)
    ],
    "grpo_vectorized": [EstimatorCase(ref_grpo, {"norm_adv_by_std_in_grpo": norm}) for norm in (True, False)],
    "rloo_vectorized": [EstimatorCase(ref_rloo_vectorized)],
    "gdpo": [
        EstimatorCase(ref_gdpo, {"gdpo_reward_keys": keys, "gdpo_reward_weights": weights,
                                 "norm_adv_by_std_in_grpo": norm})
        for keys, weights, norm in ((["accuracy_reward", "format_reward"], None, True),  # verl's GDPO script
                                    (["format_reward", "accuracy_reward"], [0.5, 2.0], True),
                                    (["accuracy_reward", "format_reward"], None, False),
                                    (None, None, True))  # verl's function without a config: the outcome score
    ],
    **{name: [EstimatorCase(reference, {"is_weights": False}),
              EstimatorCase(reference, {"is_weights": True}, inputs=("rollout_is_weights",))]
       for name, reference in (("optimal_token_baseline", ref_optimal_token_baseline),
                               ("tir_optimal_token_baseline", ref_tir_optimal_token_baseline))},
}
# The references' option names, as meshrl's estimators spell them.
MESHRL_OPTION = {"mode": "gpg_alpha_mode"}


# ----------------------------------------------------------------------- comparison helpers


def assert_matrix_close(name: str, actual: torch.Tensor, expected: Matrix, dtype: torch.dtype) -> None:
    tolerance = TOLERANCE[dtype]
    assert actual.dtype == dtype, f"{name}: computed in {actual.dtype}, inputs were {dtype}"
    expected_tensor = torch.tensor(expected, dtype=torch.float64)
    torch.testing.assert_close(
        actual.double(), expected_tensor, rtol=tolerance, atol=tolerance, msg=lambda message: f"{name}: {message}"
    )


def check_estimator(output: Any, reference: Reference, dtype: torch.dtype) -> None:
    assert_matrix_close("advantages", output.advantages, reference.advantages, dtype)
    if reference.returns is None:
        assert output.returns is None, "meshrl defines returns where verl's estimator has none"
    else:
        assert_matrix_close("returns", output.returns, reference.returns, dtype)
    for key, value in reference.metrics.items():
        assert float(output.metrics[key]) == pytest.approx(value, rel=TOLERANCE[dtype])


def missing_references(registered: list[str], references: dict[str, Any]) -> str:
    missing = sorted(set(registered) - set(references))
    return f"no verl reference in {__name__} for: {', '.join(missing)}" if missing else ""


# -------------------------------------------------------------------------- estimator tests


def test_every_registered_name_has_a_reference() -> None:
    problems = [
        missing_references(ADVANTAGE_ESTIMATORS.names(), ESTIMATOR_REFERENCES),
        missing_references(POLICY_LOSSES.names(), POLICY_LOSS_REFERENCES),
        missing_references(KL_PENALTIES.names(), KL_REFERENCES),
    ]
    assert not any(problems), "; ".join(p for p in problems if p)
    stale = (set(ESTIMATOR_REFERENCES) - set(ADVANTAGE_ESTIMATORS.names())) | (
        set(POLICY_LOSS_REFERENCES) - set(POLICY_LOSSES.names())
    )
    assert not stale, f"references for names no longer registered: {sorted(stale)}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("family", ["dense", "outcome"])
@pytest.mark.parametrize("name", ADVANTAGE_ESTIMATORS.names())
def test_estimator_agrees_with_verl_reference(name: str, family: str, dtype: torch.dtype) -> None:
    if name not in ESTIMATOR_REFERENCES:
        pytest.fail(missing_references([name], ESTIMATOR_REFERENCES))
    for case in ESTIMATOR_REFERENCES[name]:
        rollout = make_rollout(family, dtype, case.group_sizes)
        options = {MESHRL_OPTION.get(key, key): value for key, value in case.options.items()}
        inputs = {key: rollout.optional[key] for key in case.inputs}
        output = call_with_available(ADVANTAGE_ESTIMATORS.get(name), **rollout.tensors, **inputs, **options)
        check_estimator(output, case.reference(rollout, **case.options), dtype)


def test_the_reference_check_catches_a_return_that_restarts_after_a_gap() -> None:
    # The REINFORCE++ bug meshrl had: on masks with gaps the restarted return differs, and the check fails.
    rollout = make_rollout("dense", torch.float64)
    output = call_with_available(ADVANTAGE_ESTIMATORS.get("reinforce_plus_plus"), **rollout.tensors, gamma=0.9)
    buggy = ref_reinforce_plus_plus(rollout, 0.9, skip_masked=False)
    with pytest.raises(AssertionError, match="advantages"):
        check_estimator(output, buggy, torch.float64)


# ---------------------------------------------------------------- policy losses (per token)


@dataclass
class TokenReference:
    loss: float
    grad: float  # dL/dlogπ of this token's loss
    metrics: dict[str, float]


def clip(x: float, low: float, high: float) -> float:
    return min(max(x, low), high)


def ref_vanilla(lp: float, old: float, a: float, low: float, high: float, c: float) -> TokenReference:
    """verl compute_policy_loss_vanilla: max(−Aρ, −A·clip(ρ)), then min(·, −A·c) for A < 0."""
    log_ratio = clip(lp - old, -20.0, 20.0)
    rho = math.exp(log_ratio)
    unclipped, clipped = -a * rho, -a * clip(rho, 1 - low, 1 + high)
    loss = max(unclipped, clipped)
    dual = a < 0 and loss > -a * c
    # Only the unclipped term carries a gradient (the clipped one is flat wherever it differs).
    grad = 0.0 if clipped > unclipped or dual else -a * rho
    metrics = {"clipfrac": float(clipped > unclipped), "clipfrac_lower": float(dual), "ppo_kl": -log_ratio}
    return TokenReference(-a * c if dual else loss, grad, metrics)


def ref_policy_gradient(lp: float, old: float, a: float) -> TokenReference:
    """verl compute_policy_loss_gpg / compute_policy_loss_reinforce (no IS weights): −A·logπ."""
    return TokenReference(-a * lp, -a, {"ppo_kl": old - lp})


def ref_cispo(lp: float, old: float, a: float, low: float, high: float) -> TokenReference:
    """verl compute_policy_loss_cispo: −sg(clip(ρ))·A·logπ."""
    log_ratio = clip(lp - old, -20.0, 20.0)
    rho = math.exp(log_ratio)
    weight = clip(rho, 1 - low, 1 + high)
    return TokenReference(-weight * a * lp, -weight * a, {"clipfrac": float(weight != rho), "ppo_kl": -log_ratio})


def ref_gspo(seq_log_ratio: float, lp: float, old: float, a: float, low: float, high: float) -> TokenReference:
    """verl compute_policy_loss_gspo: s = exp(min(log s_i, 10)) valued, with logπ's own gradient."""
    s = math.exp(min(seq_log_ratio, 10.0))
    unclipped, clipped = -a * s, -a * clip(s, 1 - low, 1 + high)
    grad = 0.0 if clipped > unclipped or seq_log_ratio > 10.0 else -a * s
    return TokenReference(max(unclipped, clipped), grad, {"clipfrac": float(clipped > unclipped), "ppo_kl": old - lp})


def ref_dppo(keep: bool, lp: float, old: float, a: float, c: float) -> TokenReference:
    """verl's DPPO losses given their trust-region mask: −A·sg(min(ρ, C))·logπ·keep."""
    log_ratio = clip(lp - old, -20.0, 20.0)
    rho = math.exp(log_ratio)
    weight = min(rho, c)
    metrics = {"clipfrac": float(not keep), "clipfrac_lower": float(keep and rho > c), "ppo_kl": -log_ratio}
    return TokenReference(-a * weight * lp if keep else 0.0, -a * weight if keep else 0.0, metrics)


def ref_dppo_tv(lp: float, old: float, a: float, low: float, high: float, c: float) -> TokenReference:
    """verl compute_policy_loss_dppo_tv: keep p − p_old ≤ δ_high for A > 0, p − p_old ≥ −δ_low otherwise."""
    moved = math.exp(lp) - math.exp(old)
    return ref_dppo(moved <= high if a > 0 else moved >= -low, lp, old, a, c)


def ref_dppo_kl(lp: float, old: float, a: float, low: float, high: float, c: float) -> TokenReference:
    """verl compute_policy_loss_dppo_kl: the binary KL D ≤ δ, or a move against the advantage's direction."""
    p, p_old = math.exp(lp), math.exp(old)
    kl = p_old * (old - lp) + (1 - p_old) * math.log((1.0 - p_old + 1e-8) / (1.0 - p + 1e-8))
    keep = (kl <= high or p <= p_old) if a > 0 else (kl <= low or p >= p_old)
    return ref_dppo(keep, lp, old, a, c)


def ref_sapo(lp: float, old: float, a: float, tau_pos: float, tau_neg: float) -> TokenReference:
    """verl compute_policy_loss_sapo: −A·σ(τ(ρ − 1))·4/τ, τ = τ_pos if A > 0 else τ_neg."""
    log_ratio = clip(lp - old, -20.0, 20.0)
    rho = math.exp(log_ratio)
    tau = tau_pos if a > 0 else tau_neg
    gate = 1.0 / (1.0 + math.exp(-tau * (rho - 1.0)))
    return TokenReference(-a * gate * 4.0 / tau, -a * 4.0 * gate * (1.0 - gate) * rho, {"ppo_kl": -log_ratio})


def ref_clip_cov(picked: bool, lp: float, old: float, a: float, low: float, high: float, **_: float) -> TokenReference:
    """verl compute_policy_loss_clip_cov: max(−Aρ, −A·clip(ρ)) (no dual clip), times 0 on the picked tokens."""
    rho = math.exp(lp - old)
    unclipped, clipped = -a * rho, -a * clip(rho, 1 - low, 1 + high)
    metrics = {"clipfrac": float(picked), "ppo_kl": old - lp}
    if picked:
        return TokenReference(0.0, 0.0, metrics)
    return TokenReference(max(unclipped, clipped), 0.0 if clipped > unclipped else -a * rho, metrics)


def ref_kl_cov(picked: bool, lp: float, old: float, a: float, ppo_kl_coef: float, **_: float) -> TokenReference:
    """verl compute_policy_loss_kl_cov: −Aρ, plus β·|logπ − logπ_old| on the picked tokens; ppo_kl = |Δ|."""
    delta = lp - old
    rho = math.exp(delta)
    penalty, slope = (ppo_kl_coef * abs(delta), ppo_kl_coef * math.copysign(1.0, delta)) if picked else (0.0, 0.0)
    return TokenReference(-a * rho + penalty, -a * rho + slope, {"ppo_kl": abs(delta)})


def ref_geo_mean(ratio: float, adv: float, n: int, lp: float, old: float, a: float, low: float, high: float
                 ) -> TokenReference:  # fmt: skip
    """verl compute_policy_loss_geo_mean: response i's loss −Â_i·r_i (its mean over responses is verl's loss: see
    test_geo_mean_aggregates_to_verls_mean_over_responses), on each of its tokens; the gradient is that of those n
    copies: −Â·r·n/(n + 1e-8) where Δ_t is on the unclipped side for its A_t (A_t ≠ 0), else 0."""
    delta = lp - old
    through = (a > 0 and delta <= high) or (a < 0 and delta >= -low)
    outside = delta != clip(delta, -low, high)
    metrics = {"clipfrac": float(outside and a > 0), "clipfrac_lower": float(outside and a < 0), "ppo_kl": -delta}
    return TokenReference(-adv * ratio, -adv * ratio * n / (n + 1e-8) if through else 0.0, metrics)


def ref_dro(lp: float, old: float, a: float, dro_beta: float) -> TokenReference:
    """verl compute_policy_loss_dro: −(A·logπ − ½β·(logπ − logπ_old)²)."""
    delta = lp - old
    return TokenReference(-(a * lp - 0.5 * dro_beta * delta**2), -a + dro_beta * delta, {"ppo_kl": -delta})


@dataclass
class LossBatch:
    """A policy-loss batch as the references read it."""

    log_prob: Matrix
    old: Matrix
    advantages: Matrix
    mask: list[list[bool]]

    def valid(self) -> list[tuple[int, int]]:
        """The valid tokens, row by row (the order of verl's kl_cov)."""
        return [(i, t) for i, row in enumerate(self.mask) for t, m in enumerate(row) if m]


Context = list[list[tuple[Any, ...]]]  # per token: the leading arguments of its reference, from the whole batch


def sequence_log_ratio(batch: LossBatch, **_: float) -> Context:
    """gspo: the response's mean log-ratio over its valid tokens."""
    out = []
    for lps, olds, valid in zip(batch.log_prob, batch.old, batch.mask):
        diffs = [lp - o for lp, o, m in zip(lps, olds, valid) if m]
        out.append([(sum(diffs) / len(diffs),)] * WIDTH)
    return out


def covariances(batch: LossBatch) -> dict[tuple[int, int], float]:
    """verl's clip_cov / kl_cov: (A − Ā)·(logπ − mean logπ) per valid token, means over the batch's valid tokens."""
    valid = batch.valid()
    mean_a = mean([batch.advantages[i][t] for i, t in valid])
    mean_lp = mean([batch.log_prob[i][t] for i, t in valid])
    return {(i, t): (batch.advantages[i][t] - mean_a) * (batch.log_prob[i][t] - mean_lp) for i, t in valid}


def picks(batch: LossBatch, chosen: set[tuple[int, int]]) -> Context:
    return [[((i, t) in chosen,) for t in range(len(row))] for i, row in enumerate(batch.mask)]


def clip_cov_picks(batch: LossBatch, low: float, high: float, clip_cov_ratio: float, clip_cov_lb: float,
                   clip_cov_ub: float) -> Context:  # fmt: skip
    """verl's clip_cov draws max(⌊r·N⌋, 1) tokens at random among those PPO does not clip with lb < cov < ub; the
    case leaves room for all of them, so that the draw takes every one."""
    candidates = set()
    for (i, t), cov in covariances(batch).items():
        a, rho = batch.advantages[i][t], math.exp(batch.log_prob[i][t] - batch.old[i][t])
        if not -a * clip(rho, 1 - low, 1 + high) > -a * rho and clip_cov_lb < cov < clip_cov_ub:
            candidates.add((i, t))
    room = max(int(clip_cov_ratio * len(batch.valid())), 1)
    assert 0 < len(candidates) <= room, f"the case must pick some tokens, all {len(candidates)} candidates"
    return picks(batch, candidates)


def kl_cov_picks(batch: LossBatch, kl_cov_ratio: float, **_: float) -> Context:
    """verl's kl_cov picks the max(⌊N·r⌋, 1) valid tokens of largest covariance."""
    covs = covariances(batch)
    count = max(1, int(len(covs) * kl_cov_ratio))
    return picks(batch, set(sorted(covs, key=covs.__getitem__, reverse=True)[:count]))


def geo_mean_sequences(batch: LossBatch, low: float, high: float) -> Context:
    """verl's geo_mean per response: r = exp(Σ_t Δ̃_t / (n + 1e-8)), Â = Σ_t A_t / (n + 1e-8), n its valid tokens,
    Δ̃ = sgn(A)·min(sgn(A)·Δ, sgn(A)·clip(Δ, −ε_low, ε_high)); every token gets its response's (r, Â, n)."""
    out = []
    for lps, olds, advs, valid in zip(batch.log_prob, batch.old, batch.advantages, batch.mask):
        n, clipped_sum, adv_sum = sum(valid), 0.0, 0.0
        for lp, o, a, m in zip(lps, olds, advs, valid):
            if m:
                sign = (a > 0) - (a < 0)
                clipped_sum += sign * min(sign * (lp - o), sign * clip(lp - o, -low, high))
                adv_sum += a
        out.append([(math.exp(clipped_sum / (n + 1e-8)), adv_sum / (n + 1e-8), n)] * WIDTH)
    return out


BYPASS_REINFORCE = RolloutCorrectionSettings(rollout_is="sequence", is_threshold=2.0, bypass=True,
                                             loss_type="reinforce")


def bypass_sequence_weights(batch: LossBatch, rollout_correction: RolloutCorrectionSettings) -> Context:
    """verl's sequence IS weight per response: min(exp(clamp(Σ_t (logπ − logπ_rollout), ±20)), U)."""
    out = []
    for lps, olds, valid in zip(batch.log_prob, batch.old, batch.mask):
        total = sum(lp - o for lp, o, m in zip(lps, olds, valid) if m)
        out.append([(min(math.exp(clip(total, -20.0, 20.0)), rollout_correction.is_threshold),)] * WIDTH)
    return out


def ref_bypass_reinforce(weight: float, lp: float, old: float, a: float, rollout_correction: Any) -> TokenReference:
    """verl compute_policy_loss_bypass_mode, loss_type=reinforce: −A·logπ·w (old = the rollout's log-prob); its
    rollout_corr/* metrics per token (their token means are verl's: see the rollout-correction section)."""
    delta = lp - old
    return TokenReference(-a * lp * weight, -a * weight, {
        "ppo_kl": -delta, "rollout_corr/rollout_is_mean": weight, "rollout_corr/kl": -delta,
        "rollout_corr/k3_kl": math.exp(delta) - delta - 1.0,
        "rollout_corr/chi2_token": math.exp(clip(delta, -20.0, 20.0)) ** 2 - 1.0})


@dataclass(frozen=True)
class LossCase:
    reference: Callable[..., TokenReference]
    options: dict[str, float]
    log_ratio_scale: float  # spread of logπ − logπ_old: puts tokens on both sides of the clip range
    agg_mode: str | None = None
    context: Callable[..., Context] | None = None  # (batch, **options) -> each token's leading reference arguments


POLICY_LOSS_REFERENCES: dict[str, LossCase] = {
    "vanilla": LossCase(ref_vanilla, {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "clip_ratio_c": 3.0}, 0.8),
    "gpg": LossCase(ref_policy_gradient, {}, 0.8),
    "reinforce": LossCase(ref_policy_gradient, {}, 0.8),
    "cispo": LossCase(ref_cispo, {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28}, 0.3),
    "gspo": LossCase(ref_gspo, {"clip_ratio_low": 3e-4, "clip_ratio_high": 4e-4}, 1e-3, "seq-mean-token-mean",
                     sequence_log_ratio),
    # DPPO's δ bound the move of the probability (TV) or its binary KL; C (2, not verl's 3) truncates some weights.
    "dppo_tv": LossCase(ref_dppo_tv, {"clip_ratio_low": 0.05, "clip_ratio_high": 0.08, "clip_ratio_c": 2.0}, 0.8),
    "dppo_kl": LossCase(ref_dppo_kl, {"clip_ratio_low": 0.02, "clip_ratio_high": 0.03, "clip_ratio_c": 2.0}, 0.8),
    "sapo": LossCase(ref_sapo, {"tau_pos": 1.0, "tau_neg": 1.05}, 0.8, "seq-mean-token-mean"),
    # clip_cov_ratio = 1 leaves room for every candidate: verl's random draw then takes them all.
    "clip_cov": LossCase(ref_clip_cov, {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "clip_cov_ratio": 1.0,
                                        "clip_cov_lb": 0.5, "clip_cov_ub": 2.0}, 0.5, context=clip_cov_picks),
    "kl_cov": LossCase(ref_kl_cov, {"kl_cov_ratio": 0.2, "ppo_kl_coef": 0.1}, 0.5, context=kl_cov_picks),
    "geo_mean": LossCase(ref_geo_mean, {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28}, 0.3, "seq-mean-token-mean",
                         geo_mean_sequences),
    "dro": LossCase(ref_dro, {"dro_beta": 0.1}, 0.8),
    # algorithm.rollout_correction.bypass_mode (old_log_prob is the engine's): REINFORCE with sequence IS weights;
    # its other settings in the rollout-correction section below
    "bypass_mode": LossCase(ref_bypass_reinforce, {"rollout_correction": BYPASS_REINFORCE}, 0.3,
                            context=bypass_sequence_weights),
}
REFERENCE_ARGUMENT = {"clip_ratio_low": "low", "clip_ratio_high": "high", "clip_ratio_c": "c"}


def reference_options(case: LossCase) -> dict[str, float]:
    return {REFERENCE_ARGUMENT.get(key, key): value for key, value in case.options.items()}


def policy_loss_inputs(case: LossCase, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """(mask, old log-probs, log-probs, advantages) of the policy-loss references, seeded."""
    generator = torch.Generator().manual_seed(99)
    mask = random_mask(generator)
    old = (-3 * torch.rand(BATCH, WIDTH, generator=generator, dtype=torch.float64)).to(dtype)
    noise = case.log_ratio_scale * torch.randn(BATCH, WIDTH, generator=generator, dtype=torch.float64)
    # Log-probs are <= 0 (DPPO's binary KL takes log(1 − π)); masked: a ratio far off the clip.
    log_prob = torch.where(mask, (old.double() + noise).clamp(max=0.0), 50.0).to(dtype)
    advantages = torch.randn(BATCH, WIDTH, generator=generator, dtype=torch.float64).to(dtype)
    advantages[:, 0] = 0.0
    return mask, old, log_prob, advantages


def loss_batch(log_prob: torch.Tensor, old: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor) -> LossBatch:
    return LossBatch(log_prob.double().tolist(), old.double().tolist(), advantages.double().tolist(), mask.tolist())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", POLICY_LOSSES.names())
def test_policy_loss_agrees_with_verl_reference(name: str, dtype: torch.dtype) -> None:
    if name not in POLICY_LOSS_REFERENCES:
        pytest.fail(missing_references([name], POLICY_LOSS_REFERENCES))
    case = POLICY_LOSS_REFERENCES[name]
    mask, old, log_prob, advantages = policy_loss_inputs(case, dtype)
    leaf = log_prob.clone().requires_grad_(True)
    out = POLICY_LOSSES.get(name)(leaf, old, advantages, mask, **case.options)
    (grad,) = torch.autograd.grad(torch.where(mask, out.loss, 0.0).sum(), leaf)
    assert out.agg_mode == case.agg_mode

    options = reference_options(case)
    batch = loss_batch(log_prob, old, advantages, mask)
    context = case.context(batch, **options) if case.context else [[()] * WIDTH] * BATCH
    expected: dict[str, Matrix] = defaultdict(lambda: [[0.0] * WIDTH for _ in range(BATCH)])
    for i, (lps, olds, advs, valid) in enumerate(zip(batch.log_prob, batch.old, batch.advantages, batch.mask)):
        for t in (t for t in range(WIDTH) if valid[t]):
            token = case.reference(*context[i][t], lps[t], olds[t], advs[t], **options)
            for key, value in {"loss": token.loss, "grad": token.grad, **token.metrics}.items():
                expected[key][i][t] = value
    assert set(expected) == {"loss", "grad", *out.metrics}, f"{name}: metrics differ from the reference's"
    computed = {"loss": out.loss.detach(), "grad": grad, **out.metrics}
    for key, value in computed.items():
        assert_matrix_close(f"{name} {key}", torch.where(mask, value, 0).to(dtype), expected[key], dtype)


@pytest.mark.parametrize("dtype", [*DTYPES, torch.bfloat16], ids=str)
def test_value_loss_agrees_with_verl_reference(dtype: torch.dtype) -> None:
    """verl compute_value_loss: ½·max((V−R)², (clip(V, V_old ± ε) − R)²); vf_clipfrac: the clipped one
    strictly larger. The clip fraction is compared exactly in every precision (bf16 included)."""
    generator = torch.Generator().manual_seed(5)
    # ~1000 tokens: V_old + (V − V_old) ≠ V only where V and V_old are not within a factor 2 of each other.
    mask = torch.cat([random_mask(generator) for _ in range(16)])
    shape = mask.shape
    old = torch.randn(shape, generator=generator, dtype=torch.float64).to(dtype)
    values = (old.double() + 0.6 * torch.randn(shape, generator=generator, dtype=torch.float64)).to(dtype)
    returns = torch.randn(shape, generator=generator, dtype=torch.float64).to(dtype)
    leaf = values.clone().requires_grad_(True)
    out = value_loss(leaf, old, returns, mask, clip_range_value=0.5)
    (grad,) = torch.autograd.grad(torch.where(mask, out.loss, 0.0).sum(), leaf)
    loss_ref, grad_ref, clipfrac_ref = (torch.zeros(shape, dtype=torch.float64) for _ in range(3))
    for i, t in mask.nonzero().tolist():
        v, v_old, ret = float(values[i, t]), float(old[i, t]), float(returns[i, t])
        unclipped, clipped = (v - ret) ** 2, (clip(v, v_old - 0.5, v_old + 0.5) - ret) ** 2
        loss_ref[i, t] = 0.5 * max(unclipped, clipped)
        grad_ref[i, t] = 0.0 if clipped > unclipped else v - ret
        clipfrac_ref[i, t] = float(clipped > unclipped)
    assert torch.equal(torch.where(mask, out.metrics["vf_clipfrac"], False), clipfrac_ref.bool())
    tolerance = TOLERANCE.get(dtype, 1e-2)
    # Not the bf16 gradient: two squared errors closer than bf16's resolution round to a tie, at which
    # torch.maximum splits the gradient between them.
    checked = [(out.loss.detach(), loss_ref)] + ([(grad, grad_ref)] if dtype in TOLERANCE else [])
    for actual, expected in checked:
        torch.testing.assert_close(torch.where(mask, actual, 0).double(), expected, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_geo_mean_aggregates_to_verls_mean_over_responses(dtype: torch.dtype) -> None:
    """verl's geo_mean loss is torch.mean over the responses of −Â_i·r_i (every response of these inputs has a
    valid token); meshrl's per-token loss, aggregated as the loss prescribes, over the whole batch, is that value."""
    case = POLICY_LOSS_REFERENCES["geo_mean"]
    mask, old, log_prob, advantages = policy_loss_inputs(case, dtype)
    out = POLICY_LOSSES.get("geo_mean")(log_prob, old, advantages, mask, **case.options)
    sequences = geo_mean_sequences(loss_batch(log_prob, old, advantages, mask), **reference_options(case))
    expected = mean([-adv * ratio for (ratio, adv, _), *_ in sequences])
    value = aggregate_loss(out.loss, mask, out.agg_mode, GlobalNorm.from_mask(mask))
    assert float(value) == pytest.approx(expected, rel=TOLERANCE[dtype], abs=TOLERANCE[dtype])


# ---------------------------------------------------------------------------- loss aggregation


def ref_agg_loss(losses: Matrix, mask: list[list[bool]], mode: str) -> float:
    """verl agg_loss over the whole batch on one rank (dp_size 1, whose ×dp_size only undoes DDP's mean), with the
    batch's own batch_num_tokens and global_batch_size (responses with a valid token), and loss_scale_factor None
    (the mask's width)."""
    rows = [[x for x, m in zip(row, mrow) if m] for row, mrow in zip(losses, mask)]
    total, num_tokens, num_seqs = sum(map(sum, rows)), sum(map(len, rows)), sum(1 for row in rows if row)
    references = {
        "token-mean": lambda: total / num_tokens,
        "token-sum": lambda: total,
        "seq-mean-token-sum": lambda: total / num_seqs,
        "seq-mean-token-sum-norm": lambda: total / num_seqs / len(mask[0]),
        "seq-mean-token-mean": lambda: sum(sum(row) / (len(row) + 1e-8) for row in rows) / num_seqs,
    }
    assert mode in references, f"no verl reference in {__name__} for loss_agg_mode {mode!r}"
    return references[mode]()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_loss_aggregation_agrees_with_verl_reference(mode: str, dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(8)
    mask = random_mask(generator)
    mask[3] = False  # a response without a valid token: verl's sequence modes leave it out of their count
    losses = torch.randn(BATCH, WIDTH, generator=generator, dtype=torch.float64).to(dtype)
    value = aggregate_loss(losses, mask, mode, GlobalNorm.from_mask(mask))
    expected = ref_agg_loss(losses.double().tolist(), mask.tolist(), mode)
    assert float(value) == pytest.approx(expected, rel=TOLERANCE[dtype], abs=TOLERANCE[dtype])


# --------------------------------------------------------------------------------- KL types


def ref_k3(delta: float) -> tuple[float, float]:
    """verl low_var_kl: x = clamp(logπ_ref − logπ, ±20), clamp(eˣ − x − 1, ±10); d/dlogπ = 1 − eˣ unclamped."""
    x = clip(-delta, -20.0, 20.0)
    value = math.exp(x) - x - 1
    inside = abs(delta) < 20 and abs(value) < 10
    return clip(value, -10.0, 10.0), (1 - math.exp(x)) if inside else 0.0


# KL type → (value, d value / d logπ) of Δ = logπ − logπ_ref, as verl's kl_penalty_forward.
KL_REFERENCES: dict[str, Callable[[float], tuple[float, float]]] = {
    "kl": lambda d: (d, 1.0),
    "k1": lambda d: (d, 1.0),
    "abs": lambda d: (abs(d), math.copysign(1.0, d)),
    "mse": lambda d: (0.5 * d * d, d),
    "k2": lambda d: (0.5 * d * d, d),
    "low_var_kl": ref_k3,
    "k3": ref_k3,
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("straight_through", [False, True], ids=["", "+"])
@pytest.mark.parametrize("name", KL_PENALTIES.names())
def test_kl_type_agrees_with_verl_reference(name: str, straight_through: bool, dtype: torch.dtype) -> None:
    """Values and gradients; `<type>+` keeps the value and takes k2's gradient, Δ (verl's straight-through).
    Then KL in the reward as verl's apply_kl_penalty: r = s − β·kl·m, mean_kl = mean_i(Σ_t kl·m / Σ_t m)."""
    if name not in KL_REFERENCES:
        pytest.fail(missing_references([name], KL_REFERENCES))
    generator = torch.Generator().manual_seed(21)
    ref_log_prob = (-4 * torch.rand(BATCH, WIDTH, generator=generator, dtype=torch.float64)).to(dtype)
    delta = 3 * torch.randn(BATCH, WIDTH, generator=generator, dtype=torch.float64)  # reaches k3's ±10 clamp
    log_prob = (ref_log_prob.double() + delta).to(dtype)
    kl_type = name + "+" * straight_through
    leaf = log_prob.clone().requires_grad_(True)
    value = kl_penalty(leaf, ref_log_prob, kl_type)
    (grad,) = torch.autograd.grad(value.sum(), leaf)
    pairs = [[KL_REFERENCES[name](lp - ref) for lp, ref in zip(lps, refs)]
             for lps, refs in zip(log_prob.double().tolist(), ref_log_prob.double().tolist())]  # fmt: skip
    deltas = (log_prob.double() - ref_log_prob.double()).tolist()
    assert_matrix_close(kl_type, value.detach(), [[v for v, _ in row] for row in pairs], dtype)
    expected_grad = deltas if straight_through else [[g for _, g in row] for row in pairs]
    assert_matrix_close(f"{kl_type} gradient", grad, expected_grad, dtype)

    mask = random_mask(generator)
    scores = torch.randn(BATCH, WIDTH, generator=generator, dtype=torch.float64).to(dtype)
    penalised = apply_kl_penalty(scores, log_prob, ref_log_prob, mask, kl_coef=0.1, kl_type=kl_type)
    kl = [[v if m else 0.0 for (v, _), m in zip(row, mrow)] for row, mrow in zip(pairs, mask.tolist())]
    rewards = [[s - 0.1 * k for s, k in zip(srow, krow)] for srow, krow in zip(scores.double().tolist(), kl)]
    assert_matrix_close(f"{kl_type} rewards", penalised.rewards, rewards, dtype)
    mean_kl = mean([sum(krow) / sum(mrow) for krow, mrow in zip(kl, mask.tolist())])
    assert float(penalised.mean_kl) == pytest.approx(mean_kl, rel=TOLERANCE[dtype], abs=TOLERANCE[dtype])


# ------------------------------------------------------------- rollout correction (algorithm.rollout_correction)
# References written from verl's trainer/ppo/rollout_corr_helper.py (IS weights, rejection, their metrics and the
# off-policy diagnostics, over the batch given) and core_algos.compute_policy_loss_bypass_mode, in plain floats,
# one token or response at a time. δ = logπ_train − logπ_rollout; "over responses" counts every row (verl's
# .mean() over the batch), the response without a valid token (EMPTY_ROW) included, unless said otherwise.

EMPTY_ROW = 6


def correction_inputs(dtype: torch.dtype, scale: float = 0.5, seed: int = 7) -> tuple[torch.Tensor, ...]:
    """(mask, π_train log-probs, π_rollout log-probs): δ ~ N(0, scale²) on valid tokens, garbage elsewhere; one
    response has no valid token."""
    generator = torch.Generator().manual_seed(seed)
    mask = random_mask(generator)
    mask[EMPTY_ROW] = False
    rollout = -3 * torch.rand(BATCH, WIDTH, generator=generator, dtype=torch.float64)
    noise = scale * torch.randn(BATCH, WIDTH, generator=generator, dtype=torch.float64)
    train = torch.where(mask, rollout + noise, 5.0 + rollout)
    return mask, train.to(dtype), rollout.to(dtype)


def valid_tokens(mask: list[list[bool]]) -> list[tuple[int, int]]:
    return [(i, t) for i, row in enumerate(mask) for t, m in enumerate(row) if m]


def token_mean(values: Matrix, mask: list[list[bool]]) -> float:
    return mean([values[i][t] for i, t in valid_tokens(mask)])


def row_mean(row: list[float], valid: list[bool]) -> float:
    """verl's masked_mean over one response (0 for one without a valid token)."""
    picked = [x for x, m in zip(row, valid) if m]
    return sum(picked) / len(picked) if picked else 0.0


def clamped_std(values: Matrix, mask: list[list[bool]], low: float, high: float) -> float:
    if len(valid_tokens(mask)) <= 1:
        return 0.0
    clamped = [[clip(x, low, high) for x in row] for row in values]
    var = token_mean([[x * x for x in row] for row in clamped], mask) - token_mean(clamped, mask) ** 2
    return math.sqrt(max(var, 0.0))


def ref_is_weights(lr: Matrix, mask: list[list[bool]], level: str, upper: float, lower: float | None,
                   normalize: bool) -> tuple[Matrix, dict[str, float]]:
    """verl compute_rollout_correction_weights + compute_is_metrics (metrics of the weights before normalisation)."""
    seq_lr = [sum(x for x, m in zip(row, valid) if m) for row, valid in zip(lr, mask)]
    raw = [[(math.exp(clip(lr[i][t] if level == "token" else seq_lr[i], -20.0, 20.0)) if mask[i][t] else 0.0)
            for t in range(WIDTH)] for i in range(BATCH)]  # fmt: skip
    if lower is None:
        weights = [[min(w, upper) for w in row] for row in raw]
    else:
        weights = [[w if lower <= w <= upper else 0.0 for w in row] for row in raw]
    low = 1.0 / upper if lower is None else lower
    metrics = {"rollout_is_mean": token_mean(weights, mask)}
    valid = valid_tokens(mask)
    if level == "sequence":
        metrics["rollout_is_max"] = math.exp(min(max(seq_lr), 20.0))
        metrics["rollout_is_min"] = math.exp(min(seq_lr))
        metrics["rollout_is_ratio_fraction_high"] = mean([float(s > math.log(upper)) for s in seq_lr])
        metrics["rollout_is_ratio_fraction_low"] = mean([float(s < math.log(low)) for s in seq_lr])
    else:
        metrics["rollout_is_ratio_fraction_high"] = token_mean([[float(w > upper) for w in row] for row in raw], mask)
        metrics["rollout_is_ratio_fraction_low"] = token_mean([[float(w < low) for w in row] for row in raw], mask)
        metrics["rollout_is_max"] = max(weights[i][t] for i, t in valid)
        metrics["rollout_is_min"] = min(weights[i][t] for i, t in valid)
    metrics["rollout_is_std"] = clamped_std(weights, mask, 0.0, upper)
    clamped = [[clip(w, 0.0, upper) for w in row] for row in weights]
    mu = token_mean(clamped, mask)
    metrics["rollout_is_eff_sample_size"] = 1.0 / token_mean([[(c / (mu + 1e-8)) ** 2 for c in row]
                                                               for row in clamped], mask)  # fmt: skip
    seq = [row_mean(row, valid) for row, valid in zip(weights, mask)]
    metrics.update(rollout_is_seq_mean=mean(seq), rollout_is_seq_std=std(seq), rollout_is_seq_max=max(seq),
                   rollout_is_seq_min=min(seq), rollout_is_seq_max_deviation=max(abs(s - 1.0) for s in seq))
    raw_seq = [row_mean(row, valid) for row, valid in zip(raw, mask)]
    metrics["rollout_is_seq_fraction_high"] = mean([float(s > upper) for s in raw_seq])
    metrics["rollout_is_seq_fraction_low"] = mean([float(s < low) for s in raw_seq])
    if lower is not None:
        metrics["rollout_is_oob_ratio"] = token_mean([[float(w < lower or w > upper) for w in row] for row in raw],
                                                     mask)  # fmt: skip
    if normalize:
        if level == "token":
            factor = token_mean(weights, mask)
        else:
            factor = mean([s for s, valid in zip(seq, mask) if any(valid)])
        if factor > 1e-8:
            weights = [[w / factor for w in row] for row in weights]
        metrics["rollout_is_batch_norm_factor"] = factor if factor > 1e-8 else 1.0
    return weights, metrics


def divergence(kind: str, delta: float) -> float:
    d = clip(delta, -20.0, 20.0)
    return {"k1": -d, "k2": 0.5 * d * d, "k3": math.exp(d) - 1.0 - d}[kind]


def ref_rejection(lr: Matrix, mask: list[list[bool]], options: list[tuple[str, float | None, float]]
                  ) -> tuple[list[list[bool]], dict[str, float]]:
    """verl compute_rollout_rejection_mask + compute_rs_metrics; options as (name, lower L (k1), upper U)."""
    keep_all = [[True] * WIDTH for _ in range(BATCH)]
    has = [any(row) for row in mask]
    metrics: dict[str, float] = {}
    for name, lower, upper in options:
        kind, level = name[-2:], name.rsplit("_", 1)[0]
        tokens = [[divergence(kind, x) for x in row] for row in lr]
        if level == "token":
            stat, per_seq = tokens, [row_mean(row, valid) for row, valid in zip(tokens, mask)]
        else:
            picked = [[x for x, m in zip(row, valid) if m] for row, valid in zip(tokens, mask)]
            reduce = {"seq_sum": sum, "seq_mean": lambda xs: sum(xs) / len(xs), "seq_max": max}[level]
            per_seq = [reduce(xs) if xs else 0.0 for xs in picked]
            stat = [[v] * WIDTH for v in per_seq]
        low, high = (math.log(lower), math.log(upper)) if kind == "k1" else (0.0, upper)
        keep = [[(low <= x <= high) if kind == "k1" else x <= high for x in row] for row in stat]
        values = [v for v, h in zip(per_seq, has) if h]
        prefix = f"rollout_rs_{name}"
        metrics[f"{prefix}_mean"] = token_mean(stat, mask)
        valid = valid_tokens(mask)
        if level == "token":
            metrics[f"{prefix}_max"] = max(stat[i][t] for i, t in valid)
            metrics[f"{prefix}_min"] = min(stat[i][t] for i, t in valid)
            metrics[f"{prefix}_fraction_high"] = token_mean([[float(x > high) for x in row] for row in stat], mask)
            metrics[f"{prefix}_fraction_low"] = \
                token_mean([[float(x < low) for x in row] for row in stat], mask) if kind == "k1" else 0.0
        else:
            metrics[f"{prefix}_max"], metrics[f"{prefix}_min"] = max(values), min(values)
            metrics[f"{prefix}_fraction_high"] = mean([float(v > high) for v in values])
            metrics[f"{prefix}_fraction_low"] = mean([float(v < low) for v in values]) if kind == "k1" else 0.0
        metrics[f"{prefix}_std"] = clamped_std(stat, mask, low, high)
        metrics.update({f"{prefix}_seq_mean": mean(values), f"{prefix}_seq_std": std(values),
                        f"{prefix}_seq_max": max(values), f"{prefix}_seq_min": min(values),
                        f"{prefix}_seq_max_deviation": max(abs(v) for v in values),
                        f"{prefix}_seq_fraction_high": mean([float(v > high) for v in values])})
        if kind == "k1":
            metrics[f"{prefix}_seq_fraction_low"] = mean([float(v < low) for v in values])
        metrics[f"{prefix}_masked_fraction"] = token_mean([[float(not k) for k in row] for row in keep], mask)
        metrics[f"{prefix}_seq_masked_fraction"] = mean([float(any(m and not k for k, m in zip(krow, mrow)))
                                                        for krow, mrow, h in zip(keep, mask, has) if h])
        keep_all = [[a and b for a, b in zip(arow, brow)] for arow, brow in zip(keep_all, keep)]
    metrics["rollout_rs_masked_fraction"] = token_mean([[float(not k) for k in row] for row in keep_all], mask)
    metrics["rollout_rs_seq_masked_fraction"] = mean([float(any(m and not k for k, m in zip(krow, mrow)))
                                                      for krow, mrow in zip(keep_all, mask)])  # fmt: skip
    return [[m and k for m, k in zip(mrow, krow)] for mrow, krow in zip(mask, keep_all)], metrics


def ref_off_policy(train: Matrix, rollout: Matrix, mask: list[list[bool]]) -> dict[str, float]:
    """verl compute_offpolicy_metrics."""
    train_mean = [row_mean(row, valid) for row, valid in zip(train, mask)]
    rollout_mean = [row_mean(row, valid) for row, valid in zip(rollout, mask)]
    diff = [r - t for r, t in zip(rollout_mean, train_mean)]
    lr = [[a - b for a, b in zip(arow, brow)] for arow, brow in zip(train, rollout)]
    seq_lr = [clip(sum(x for x, m in zip(row, valid) if m), -20.0, 20.0) for row, valid in zip(lr, mask)]
    return {
        "training_ppl": mean([math.exp(-x) for x in train_mean]), "training_log_ppl": mean([-x for x in train_mean]),
        "kl": token_mean([[-x for x in row] for row in lr], mask),
        "k3_kl": token_mean([[math.exp(x) - x - 1.0 for x in row] for row in lr], mask),
        "rollout_ppl": mean([math.exp(-x) for x in rollout_mean]), "rollout_log_ppl": mean([-x for x in rollout_mean]),
        "log_ppl_diff": mean(diff), "log_ppl_abs_diff": mean([abs(d) for d in diff]),
        "log_ppl_diff_max": max(diff), "log_ppl_diff_min": min(diff), "ppl_ratio": mean([math.exp(d) for d in diff]),
        "chi2_token": token_mean([[math.exp(clip(x, -20.0, 20.0)) ** 2 for x in row] for row in lr], mask) - 1.0,
        "chi2_seq": mean([math.exp(2.0 * s) for s in seq_lr]) - 1.0,
    }


def assert_metrics_close(computed: dict[str, float], expected: dict[str, float], dtype: torch.dtype) -> None:
    expected = {f"rollout_corr/{k}": v for k, v in expected.items()}
    assert set(computed) == set(expected), f"names differ: {sorted(set(computed) ^ set(expected))}"
    tolerance = TOLERANCE[dtype]
    wrong = {k: (computed[k], v) for k, v in expected.items()
             if not math.isclose(computed[k], v, rel_tol=tolerance, abs_tol=tolerance)}  # fmt: skip
    assert not wrong, f"(meshrl, verl reference): {wrong}"


def lists(*tensors: torch.Tensor) -> list[Any]:
    return [t.double().tolist() if t.dtype != torch.bool else t.tolist() for t in tensors]


# rollout_is, rollout_is_threshold (verl's forms), rollout_is_batch_normalize → (level, U, L, normalise)
IS_CASES = {
    "token_tis": (("token", "2.0", False), ("token", 2.0, None, False)),
    "token_icepop": (("token", "0.5_1.5", False), ("token", 1.5, 0.5, False)),
    "token_tis_normalised": (("token", 1.3, True), ("token", 1.3, None, True)),
    "sequence_tis": (("sequence", 3, False), ("sequence", 3.0, None, False)),
    "sequence_icepop_normalised": (("sequence", "0.6_1.8", True), ("sequence", 1.8, 0.6, True)),
}
# rollout_rs, rollout_rs_threshold → (name, L, U) per option; one option set per test case
RS_CASES = {
    "token_k1": ("token_k1", "0.6_1.4", [("token_k1", 0.6, 1.4)]),
    "token_k1_upper_only": ("token_k1", 1.4, [("token_k1", 1 / 1.4, 1.4)]),
    "token_k2": ("token_k2", 0.05, [("token_k2", None, 0.05)]),
    "token_k3": ("token_k3", "0.05", [("token_k3", None, 0.05)]),
    "seq_sum_k1": ("seq_sum_k1", "0.5_2.0", [("seq_sum_k1", 0.5, 2.0)]),
    "seq_sum_k2": ("seq_sum_k2", 0.6, [("seq_sum_k2", None, 0.6)]),
    "seq_sum_k3": ("seq_sum_k3", 0.6, [("seq_sum_k3", None, 0.6)]),
    "seq_mean_k1": ("seq_mean_k1", "0.8_1.25", [("seq_mean_k1", 0.8, 1.25)]),
    "seq_mean_k2": ("seq_mean_k2", 0.12, [("seq_mean_k2", None, 0.12)]),
    "seq_mean_k3": ("seq_mean_k3", 0.12, [("seq_mean_k3", None, 0.12)]),
    "seq_max_k2": ("seq_max_k2", 0.3, [("seq_max_k2", None, 0.3)]),
    "seq_max_k3": ("seq_max_k3", 0.3, [("seq_max_k3", None, 0.3)]),
    # several options, each its own threshold; a repeated option counts once
    "chained": ("token_k1, seq_mean_k3,token_k1", "0.5_2.0,0.15",
                [("token_k1", 0.5, 2.0), ("seq_mean_k3", None, 0.15)]),
    "chained_shared": ("seq_max_k2,seq_sum_k3", "1.0", [("seq_max_k2", None, 1.0), ("seq_sum_k3", None, 1.0)]),
}


def correction_settings(**values: Any) -> RolloutCorrectionSettings:
    section = {"rollout_is": None, "rollout_is_threshold": 2.0, "rollout_is_batch_normalize": False,
               "rollout_rs": None, "rollout_rs_threshold": None, "bypass_mode": False, "loss_type": "ppo_clip"}
    return RolloutCorrectionSettings.from_config(SimpleNamespace(**{**section, **values}))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", IS_CASES)
def test_rollout_is_weights_agree_with_verl_reference(case: str, dtype: torch.dtype) -> None:
    (level, threshold, normalize), reference = IS_CASES[case]
    mask, train, rollout = correction_inputs(dtype, scale=0.3 if level == "sequence" else 0.5)
    settings = correction_settings(rollout_is=level, rollout_is_threshold=threshold,
                                   rollout_is_batch_normalize=normalize)
    out = rollout_correction(train, rollout, mask.to(dtype), settings)
    train_l, rollout_l, mask_l = lists(train, rollout, mask)
    lr = [[a - b for a, b in zip(arow, brow)] for arow, brow in zip(train_l, rollout_l)]
    weights, metrics = ref_is_weights(lr, mask_l, *reference)
    assert 0 < metrics["rollout_is_ratio_fraction_high"] + metrics["rollout_is_ratio_fraction_low"] < 1
    assert_matrix_close(f"{case} weights", out.weights, weights, dtype)
    assert torch.equal(out.response_mask, mask.to(dtype))  # IS weights never touch the mask (IcePop included)
    assert_metrics_close(out.metrics, metrics, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", RS_CASES)
def test_rollout_rejection_agrees_with_verl_reference(case: str, dtype: torch.dtype) -> None:
    rollout_rs, threshold, options = RS_CASES[case]
    mask, train, rollout = correction_inputs(dtype)
    out = rollout_correction(train, rollout, mask.to(dtype),
                             correction_settings(rollout_rs=rollout_rs, rollout_rs_threshold=threshold))
    train_l, rollout_l, mask_l = lists(train, rollout, mask)
    lr = [[a - b for a, b in zip(arow, brow)] for arow, brow in zip(train_l, rollout_l)]
    kept, metrics = ref_rejection(lr, mask_l, options)
    assert 0 < metrics["rollout_rs_masked_fraction"] < 1, "the case must keep some tokens and reject others"
    assert out.weights is None and out.response_mask.dtype == dtype
    assert out.response_mask.bool().tolist() == kept
    assert_metrics_close(out.metrics, metrics, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_off_policy_metrics_agree_with_verl_reference(dtype: torch.dtype) -> None:
    mask, train, rollout = correction_inputs(dtype, scale=0.3)
    expected = ref_off_policy(*lists(train, rollout), mask.tolist())
    assert_metrics_close(off_policy_metrics(train, rollout, mask), expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_weights_and_rejection_together_as_verl(dtype: torch.dtype) -> None:
    """verl's combined call: the weights and the rejection are independent; the metrics are both sets."""
    mask, train, rollout = correction_inputs(dtype)
    settings = correction_settings(rollout_is="token", rollout_is_threshold=2.0, rollout_rs="seq_mean_k1",
                                   rollout_rs_threshold="0.8_1.25")
    out = rollout_correction(train, rollout, mask.to(dtype), settings)
    train_l, rollout_l, mask_l = lists(train, rollout, mask)
    lr = [[a - b for a, b in zip(arow, brow)] for arow, brow in zip(train_l, rollout_l)]
    weights, is_metrics = ref_is_weights(lr, mask_l, "token", 2.0, None, False)
    kept, rs_metrics = ref_rejection(lr, mask_l, [("seq_mean_k1", 0.8, 1.25)])
    assert_matrix_close("weights", out.weights, weights, dtype)  # of every sampled token, rejected ones too
    assert out.response_mask.bool().tolist() == kept
    assert_metrics_close(out.metrics, {**is_metrics, **rs_metrics}, dtype)


@pytest.mark.parametrize(("values", "message"), [
    ({"rollout_is": "geometric"}, "rollout_is must be"),
    ({"rollout_is": "token", "rollout_is_threshold": None}, "rollout_is_threshold must be set"),
    ({"rollout_is": "token", "rollout_is_threshold": "5_0.5"}, "lower bound exceeds"),
    ({"rollout_is": "token", "rollout_is_threshold": "-1"}, "positive"),
    ({"rollout_is": "token", "rollout_is_threshold": True}, "number"),
    ({"rollout_rs": "sequence", "rollout_rs_threshold": 2.0}, "unknown option"),
    ({"rollout_rs": "token_k2"}, "rollout_rs_threshold must be set"),
    ({"rollout_rs": "token_k2", "rollout_rs_threshold": "0.5_2.0"}, "upper bound alone"),
    ({"rollout_rs": "token_k1,seq_sum_k2", "rollout_rs_threshold": "0.5_2,1,3"}, "one per option"),
    ({"rollout_rs": "seq_max_k1", "rollout_rs_threshold": 2.0}, "unknown option"),  # verl has no seq_max_k1
    ({"loss_type": "ppo"}, "loss_type"),
])  # fmt: skip
def test_rollout_correction_settings_refuse_what_verl_refuses(values: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        correction_settings(**values)


def ref_bypass_token(kind: str, lp: float, old: float, a: float, weight: float) -> TokenReference:
    """verl compute_policy_loss_bypass_mode, one token: ppo_clip is vanilla PPO at ρ = π_θ/π_rollout (no weights);
    reinforce is −A·logπ·w (compute_policy_loss_reinforce)."""
    if kind == "ppo_clip":
        return ref_vanilla(lp, old, a, 0.2, 0.28, 3.0)
    return TokenReference(-a * lp * weight, -a * weight, {"ppo_kl": old - lp})


def is_bounds(threshold: Any) -> tuple[float, float | None]:
    """verl's rollout_is_threshold: "L_U" → (U, L) (IcePop), a number → (U, None) (TIS)."""
    if isinstance(threshold, str) and "_" in threshold:
        low, high = threshold.split("_")
        return float(high), float(low)
    return float(threshold), None


# loss_type, rollout_is, threshold, batch normalisation, rollout_rs, its threshold
BYPASS_CASES = {
    "ppo_clip_token_is_rs": ("ppo_clip", "token", "0.5_1.5", False, "token_k1,seq_max_k2", "0.6_1.4,0.5"),
    "reinforce_sequence_is_normalised_rs": ("reinforce", "sequence", 2.0, True, "seq_mean_k3", 0.05),
    "reinforce_token_is": ("reinforce", "token", 1.5, False, None, None),
}
RS_BOUNDS = {"ppo_clip_token_is_rs": [("token_k1", 0.6, 1.4), ("seq_max_k2", None, 0.5)],
             "reinforce_sequence_is_normalised_rs": [("seq_mean_k3", None, 0.05)]}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", BYPASS_CASES)
def test_bypass_mode_agrees_with_verl_reference(case: str, dtype: torch.dtype) -> None:
    """Loss, gradient, the narrowed loss mask, and the metrics: the loss's own at kept tokens, and rollout_corr/*
    terms whose token means are verl's metrics of the micro-batch (old_log_prob is the engine's log-prob)."""
    loss_type, level, threshold, normalize, rollout_rs, rs_threshold = BYPASS_CASES[case]
    mask, log_prob, rollout = correction_inputs(dtype, scale=0.3)
    advantages = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(3), dtype=torch.float64).to(dtype)
    settings = correction_settings(rollout_is=level, rollout_is_threshold=threshold,
                                   rollout_is_batch_normalize=normalize, rollout_rs=rollout_rs,
                                   rollout_rs_threshold=rs_threshold, bypass_mode=True, loss_type=loss_type)
    leaf = log_prob.clone().requires_grad_(True)
    out = POLICY_LOSSES.get("bypass_mode")(leaf, rollout, advantages, mask, rollout_correction=settings,
                                           clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0)
    (grad,) = torch.autograd.grad(torch.where(mask, out.loss, 0.0).sum(), leaf)

    lp_l, rollout_l, adv_l = lists(log_prob, rollout, advantages)
    mask_l = mask.tolist()
    lr = [[a - b for a, b in zip(arow, brow)] for arow, brow in zip(lp_l, rollout_l)]
    weights, is_metrics = ref_is_weights(lr, mask_l, level, *is_bounds(threshold), normalize)
    kept, rs_metrics = ref_rejection(lr, mask_l, RS_BOUNDS[case]) if rollout_rs else (mask_l, {})
    expected: dict[str, Matrix] = defaultdict(lambda: [[0.0] * WIDTH for _ in range(BATCH)])
    for i, t in valid_tokens(mask_l):
        token = ref_bypass_token(loss_type, lp_l[i][t], rollout_l[i][t], adv_l[i][t], weights[i][t])
        expected["loss"][i][t], expected["grad"][i][t] = token.loss, token.grad
        for key, value in token.metrics.items():
            expected[key][i][t] = value if kept[i][t] else 0.0
    computed = {"loss": out.loss.detach(), "grad": grad, **{k: v for k, v in out.metrics.items() if "/" not in k}}
    assert set(computed) == set(expected)
    for key, value in computed.items():
        assert_matrix_close(f"{case} {key}", torch.where(mask, value, 0).to(dtype), expected[key], dtype)
    narrowed = mask if out.response_mask is None else out.response_mask
    assert narrowed.tolist() == kept

    # The rollout_corr/* terms: token means over the response mask are verl's metrics of the same names.
    verl_metrics = {**is_metrics, **rs_metrics, **ref_off_policy(lp_l, rollout_l, mask_l)}
    terms = {k.removeprefix("rollout_corr/"): v for k, v in out.metrics.items() if "/" in k}
    assert {"rollout_is_mean", "kl", "k3_kl", "chi2_token"} <= set(terms) <= set(verl_metrics)
    if rollout_rs:
        names = [f"rollout_rs_{name}_masked_fraction" for name, _, _ in RS_BOUNDS[case]]
        assert {"rollout_rs_masked_fraction", *names} <= set(terms)
    for key, value in terms.items():
        computed_mean = float(torch.where(mask, value.double(), 0.0).sum() / mask.sum())
        assert computed_mean == pytest.approx(verl_metrics[key], rel=TOLERANCE[dtype], abs=TOLERANCE[dtype]), key


def ref_variance_proxy(old: Matrix, sum_pi2: Matrix, adv: Matrix, mask: list[list[bool]], is_w: Matrix | None,
                       grad_norm: float | None) -> dict[str, float]:
    """verl compute_variance_proxy_metrics (metric_utils.py), response by response."""
    w_token = [[1.0 - 2.0 * math.exp(o) + s for o, s in zip(orow, srow)] for orow, srow in zip(old, sum_pi2)]
    if is_w is not None:
        w_token = [[x * w * w for x, w in zip(xrow, wrow)] for xrow, wrow in zip(w_token, is_w)]
    a_bar = [row_mean(row, valid) for row, valid in zip(adv, mask)]
    w_tau = [sum(x for x, m in zip(row, valid) if m) for row, valid in zip(w_token, mask)]
    if is_w is None:
        power = mean([a * a * max(w, 0.0) for a, w in zip(a_bar, w_tau)])
    else:
        w_bar = [row_mean(row, valid) for row, valid in zip(is_w, mask)]
        w_orig = [max(sum(x / max(w * w, 1e-10) for x, w, m in zip(xrow, wrow, valid) if m), 0.0)
                  for xrow, wrow, valid in zip(w_token, is_w, mask)]
        power = mean([b * b * a * a * w for b, a, w in zip(w_bar, a_bar, w_orig)])
    signal = grad_norm ** 2 if grad_norm is not None else None
    noise = max(0.0, (power - signal) / (len(adv) - 1)) if signal is not None else 0.0
    return {"variance_proxy/proxy1_signal_strength": signal or 0.0, "variance_proxy/proxy2_total_power": power,
            "variance_proxy/proxy3_pure_noise": noise,
            "variance_proxy/expected_a_squared": mean([a * a for a in a_bar]),
            "variance_proxy/expected_w": mean(w_tau)}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("with_is", [False, True], ids=["on_policy", "is_weights"])
def test_variance_proxy_metrics_agree_with_verl_reference(dtype: torch.dtype, with_is: bool) -> None:
    from meshrl.algorithms.variance_proxy import variance_proxy_metrics

    mask, train, rollout = correction_inputs(dtype, scale=0.3)
    g = torch.Generator().manual_seed(11)
    old = -torch.rand(train.shape, generator=g, dtype=torch.float64).to(dtype) * 3  # log-probs of sampled tokens
    sum_pi2 = (torch.rand(train.shape, generator=g, dtype=torch.float64) * 0.5 + old.double().exp() ** 2).to(dtype)
    adv = torch.randn(train.shape, generator=g, dtype=torch.float64).to(dtype)
    is_w = (train - rollout).exp() if with_is else None
    computed = variance_proxy_metrics(old, sum_pi2, adv, mask, is_w, gradient_norm=0.7)
    expected = ref_variance_proxy(*lists(old, sum_pi2, adv), mask.tolist(), lists(is_w)[0] if with_is else None, 0.7)
    assert set(computed) == set(expected)
    tolerance = TOLERANCE[dtype]
    wrong = {k: (computed[k], v) for k, v in expected.items()
             if not math.isclose(computed[k], v, rel_tol=tolerance, abs_tol=tolerance)}  # fmt: skip
    assert not wrong, f"(meshrl, verl reference): {wrong}"
    assert expected["variance_proxy/proxy2_total_power"] > 0
