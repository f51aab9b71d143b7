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
A newly registered name without a reference here fails `test_every_registered_name_has_a_reference`.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from meshrl.algorithms import (
    ADVANTAGE_ESTIMATORS,
    KL_PENALTIES,
    POLICY_LOSSES,
    apply_kl_penalty,
    call_with_available,
    kl_penalty,
    value_loss,
)

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

    tensors: dict[str, torch.Tensor]
    mask: list[list[bool]]
    rewards: Matrix  # 0 at masked tokens
    values: Matrix
    greedy: list[float]
    uid: list[int]


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
    tensors = {
        "token_rewards": torch.where(mask, rewards, garbage),
        "response_mask": mask,
        "uid": uid,
        "values": torch.where(mask, values, -garbage),
        "greedy_scores": greedy,
    }
    return Rollout(tensors, mask.tolist(), rewards.double().tolist(), values.double().tolist(),
                   greedy.double().tolist(), uid.tolist())  # fmt: skip


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


@dataclass(frozen=True)
class EstimatorCase:
    reference: Callable[..., Reference]
    options: dict[str, Any] = field(default_factory=dict)
    group_sizes: tuple[int, ...] = GROUP_SIZES


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
        output = call_with_available(ADVANTAGE_ESTIMATORS.get(name), **rollout.tensors, **options)
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


@dataclass(frozen=True)
class LossCase:
    reference: Callable[..., TokenReference]
    options: dict[str, float]
    log_ratio_scale: float  # spread of logπ − logπ_old: puts tokens on both sides of the clip range
    agg_mode: str | None = None
    sequence_ratio: bool = False  # the reference takes the response's mean log-ratio first


POLICY_LOSS_REFERENCES: dict[str, LossCase] = {
    "vanilla": LossCase(ref_vanilla, {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "clip_ratio_c": 3.0}, 0.8),
    "gpg": LossCase(ref_policy_gradient, {}, 0.8),
    "reinforce": LossCase(ref_policy_gradient, {}, 0.8),
    "cispo": LossCase(ref_cispo, {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28}, 0.3),
    "gspo": LossCase(ref_gspo, {"clip_ratio_low": 3e-4, "clip_ratio_high": 4e-4}, 1e-3, "seq-mean-token-mean", True),
}
REFERENCE_ARGUMENT = {"clip_ratio_low": "low", "clip_ratio_high": "high", "clip_ratio_c": "c"}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", POLICY_LOSSES.names())
def test_policy_loss_agrees_with_verl_reference(name: str, dtype: torch.dtype) -> None:
    if name not in POLICY_LOSS_REFERENCES:
        pytest.fail(missing_references([name], POLICY_LOSS_REFERENCES))
    case = POLICY_LOSS_REFERENCES[name]
    generator = torch.Generator().manual_seed(99)
    mask = random_mask(generator)
    old = (-3 * torch.rand(BATCH, WIDTH, generator=generator, dtype=torch.float64)).to(dtype)
    noise = case.log_ratio_scale * torch.randn(BATCH, WIDTH, generator=generator, dtype=torch.float64)
    log_prob = torch.where(mask, old.double() + noise, 50.0).to(dtype)  # masked: a ratio far off the clip
    advantages = torch.randn(BATCH, WIDTH, generator=generator, dtype=torch.float64).to(dtype)
    advantages[:, 0] = 0.0
    leaf = log_prob.clone().requires_grad_(True)
    out = POLICY_LOSSES.get(name)(leaf, old, advantages, mask, **case.options)
    (grad,) = torch.autograd.grad(torch.where(mask, out.loss, 0.0).sum(), leaf)
    assert out.agg_mode == case.agg_mode

    options = {REFERENCE_ARGUMENT[key]: value for key, value in case.options.items()}
    expected: dict[str, Matrix] = defaultdict(lambda: [[0.0] * WIDTH for _ in range(BATCH)])
    for i, (lps, olds, advs, valid) in enumerate(zip(log_prob.double().tolist(), old.double().tolist(),
                                                     advantages.double().tolist(), mask.tolist())):  # fmt: skip
        diffs = [lp - o for lp, o, m in zip(lps, olds, valid) if m]
        prefix = (sum(diffs) / len(diffs),) if case.sequence_ratio else ()
        for t in (t for t in range(WIDTH) if valid[t]):
            token = case.reference(*prefix, lps[t], olds[t], advs[t], **options)
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
