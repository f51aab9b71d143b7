"""Advantage estimators: hand-computed cases and invariants."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from meshrl.algorithms import (
    ADVANTAGE_ESTIMATORS,
    call_with_available,
    gae,
    gpg,
    gpg_alpha,
    grpo,
    grpo_passk,
    opo,
    optimal_token_baseline,
    reinforce_plus_plus,
    reinforce_plus_plus_baseline,
    remax,
    rloo,
    tir_optimal_token_baseline,
)


def outcome_rewards(scores: list[float], lengths: list[int], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token rewards with each score on the last valid token, and the right-padded mask."""
    mask = torch.arange(width) < torch.tensor(lengths).unsqueeze(-1)
    rewards = torch.zeros(len(scores), width)
    rewards[torch.arange(len(scores)), torch.tensor(lengths) - 1] = torch.tensor(scores)
    return rewards, mask


def per_response(advantages: torch.Tensor) -> torch.Tensor:
    """The advantage of each response (its first token)."""
    return advantages[:, 0]


# Scores: group 0 = [1, 0, 0, 0], group 1 = [2, 4], group 2 = [5] (a group of one).
SCORES = [1.0, 0.0, 0.0, 0.0, 2.0, 4.0, 5.0]
UID = torch.tensor([0, 0, 0, 0, 1, 1, 2])
LENGTHS = [3, 1, 2, 3, 2, 3, 1]


def test_grpo_hand_computed() -> None:
    rewards, mask = outcome_rewards(SCORES, LENGTHS, 3)
    advantages = grpo(rewards, mask, uid=UID).advantages
    # group 0: mean 0.25, unbiased std 0.5; group 1: mean 3, std sqrt(2); group of one: mean 0, std 1.
    g0, g1 = 0.5 + 1e-6, math.sqrt(2) + 1e-6
    expected = [0.75 / g0, -0.25 / g0, -0.25 / g0, -0.25 / g0, -1 / g1, 1 / g1, 5 / (1 + 1e-6)]
    torch.testing.assert_close(per_response(advantages), torch.tensor(expected), rtol=1e-5, atol=1e-6)
    # Broadcast over valid tokens only.
    assert advantages[1].tolist() == pytest.approx([-0.25 / g0, 0.0, 0.0], abs=1e-6)
    assert torch.all(advantages[~mask] == 0)


def test_dr_grpo_does_not_divide_by_std() -> None:
    rewards, mask = outcome_rewards(SCORES, LENGTHS, 3)
    advantages = grpo(rewards, mask, uid=UID, norm_adv_by_std_in_grpo=False).advantages
    assert per_response(advantages).tolist() == pytest.approx([0.75, -0.25, -0.25, -0.25, -1.0, 1.0, 5.0])


def test_rloo_hand_computed() -> None:
    rewards, mask = outcome_rewards(SCORES, LENGTHS, 3)
    advantages = rloo(rewards, mask, uid=UID).advantages
    assert per_response(advantages).tolist() == pytest.approx([1.0, -1 / 3, -1 / 3, -1 / 3, -2.0, 2.0, 5.0], abs=1e-6)


def test_gpg_paper_alpha_counts_responses_of_all_identical_groups() -> None:
    # group 0 = [1, 1] and group 2 = [0, 0, 0] carry no signal: M = 5 of B = 7, α = 7/2.
    scores = [1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0]
    uid = torch.tensor([0, 0, 1, 1, 2, 2, 2])
    rewards, mask = outcome_rewards(scores, [1] * 7, 2)
    out = gpg(rewards, mask, uid=uid)
    assert float(out.metrics["gpg_alpha"]) == pytest.approx(3.5)
    assert per_response(out.advantages).tolist() == pytest.approx([0, 0, -1.75, 1.75, 0, 0, 0])


def test_gpg_verl_alpha_is_batch_over_nonzero_scores() -> None:
    scores = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0])
    uid = torch.tensor([0, 0, 1, 1, 2, 2, 2])
    assert float(gpg_alpha(scores, uid, "verl")) == pytest.approx(7 / 3)
    rewards, mask = outcome_rewards(scores.tolist(), [1] * 7, 2)
    out = gpg(rewards, mask, uid=uid, gpg_alpha_mode="verl")
    assert per_response(out.advantages)[2:4].tolist() == pytest.approx([-7 / 6, 7 / 6])


def test_gpg_alpha_is_one_without_degenerate_groups_and_singletons_carry_signal() -> None:
    rewards, mask = outcome_rewards(SCORES, LENGTHS, 3)
    out = gpg(rewards, mask, uid=UID, norm_by_std=True)
    assert float(out.metrics["gpg_alpha"]) == 1.0
    # With F_norm = std, GPG's advantage is GRPO's.
    torch.testing.assert_close(out.advantages, grpo(rewards, mask, uid=UID).advantages)


def test_opo_length_weighted_baseline() -> None:
    # group 0: scores [1, 0], lengths [3, 2] → b = 3/5; group 1: scores [1, 2], lengths [2, 3] → b = 8/5.
    rewards, mask = outcome_rewards([1.0, 0.0, 1.0, 2.0], [3, 2, 2, 3], 3)
    advantages = opo(rewards, mask, uid=torch.tensor([0, 0, 1, 1])).advantages
    assert per_response(advantages).tolist() == pytest.approx([0.4, -0.6, -0.6, 0.4], abs=1e-6)


def test_grpo_passk_credits_only_the_best() -> None:
    # group 0 = [0, 2, 1]: best 2, second 1, std 1; group 1 = [1, 3, 3, 2]: tie for best → gap 0.
    rewards, mask = outcome_rewards([0.0, 2.0, 1.0, 1.0, 3.0, 3.0, 2.0], [1] * 7, 1)
    uid = torch.tensor([0, 0, 0, 1, 1, 1, 1])
    advantages = grpo_passk(rewards, mask, uid=uid).advantages
    assert per_response(advantages).tolist() == pytest.approx([0, 1 / (1 + 1e-6), 0, 0, 0, 0, 0])
    raw = grpo_passk(rewards, mask, uid=uid, norm_adv_by_std_in_grpo=False).advantages
    assert per_response(raw).tolist() == [0, 1, 0, 0, 0, 0, 0]


def test_remax_reverse_return_minus_greedy_baseline() -> None:
    rewards = torch.tensor([[0.0, 1.0, 2.0], [1.0, 1.0, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    out = remax(rewards, mask, greedy_scores=torch.tensor([1.5, 0.5]))
    assert out.advantages.tolist() == [[1.5, 1.5, 0.5], [1.5, 0.5, 0.0]]
    assert out.returns is not None and out.returns.tolist() == [[3, 3, 2], [2, 1, 0]]


def test_remax_is_zero_when_the_sample_scores_like_the_greedy_response() -> None:
    rewards, mask = outcome_rewards([0.7, 1.0], [3, 2], 4)
    advantages = remax(rewards, mask, greedy_scores=torch.tensor([0.7, 1.0])).advantages
    assert torch.count_nonzero(advantages) == 0


def test_gae_returns_hand_computed_and_advantages_whitened() -> None:
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 0.6, 0.7]])
    out = gae(rewards, torch.ones(1, 3), values=values, gamma=0.9, lam=0.8)
    # δ = [0.04, 0.03, 0.3]; A_2 = 0.3, A_1 = 0.03 + 0.72·0.3, A_0 = 0.04 + 0.72·A_1.
    raw = torch.tensor([[0.21712, 0.246, 0.3]])
    assert out.returns is not None
    torch.testing.assert_close(out.returns, raw + values)
    expected = (raw - raw.mean()) / torch.sqrt(raw.var() + 1e-8)
    torch.testing.assert_close(out.advantages, expected)


def test_gae_skips_interior_masked_tokens() -> None:
    # A masked observation token in the middle behaves as if it were not there.
    rewards = torch.tensor([[0.1, 7.0, 0.2, 1.0]])
    values = torch.tensor([[0.5, -3.0, 0.4, 0.3]])
    mask = torch.tensor([[1, 0, 1, 1]])
    holey = gae(rewards, mask, values=values, gamma=0.9, lam=0.95)
    compact = gae(rewards[:, [0, 2, 3]], torch.ones(1, 3), values=values[:, [0, 2, 3]], gamma=0.9, lam=0.95)
    torch.testing.assert_close(holey.advantages[:, [0, 2, 3]], compact.advantages)
    assert holey.returns is not None and compact.returns is not None
    torch.testing.assert_close(holey.returns[:, [0, 2, 3]], compact.returns)
    assert holey.advantages[0, 1] == 0


def test_reinforce_plus_plus_discounted_returns_skip_masked_tokens() -> None:
    rewards = torch.tensor([[0.0, 0.0, 1.0], [1.0, 2.0, 3.0], [1.0, 5.0, 2.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 1]])
    out = reinforce_plus_plus(rewards, mask, gamma=0.5)
    assert out.returns is not None
    # Row 2: the masked 5.0 is dropped and the return flows past it: G_0 = 1 + 0.5·2.
    assert out.returns.tolist() == [[0.25, 0.5, 1.0], [2.0, 2.0, 0.0], [2.0, 0.0, 2.0]]
    valid = mask.bool()
    whitened = out.advantages[valid]
    assert float(whitened.mean()) == pytest.approx(0.0, abs=1e-6)
    assert float(whitened.std()) == pytest.approx(1.0, abs=1e-4)


def test_reinforce_plus_plus_return_reaches_past_a_tool_output_span() -> None:
    # Multi-turn: the outcome reward on the last token credits the first turn across the masked span.
    out = reinforce_plus_plus(torch.tensor([[0.0, 0.0, 1.0]]), torch.tensor([[1, 0, 1]]), gamma=1.0)
    assert out.returns is not None and out.returns.tolist() == [[1.0, 0.0, 1.0]]
    compact = reinforce_plus_plus(torch.tensor([[0.0, 1.0]]), torch.ones(1, 2), gamma=1.0)
    assert out.advantages[:, [0, 2]].tolist() == compact.advantages.tolist()


def float_discounted_sum(rewards: list[float], decay: float) -> list[float]:
    """Σ_{t' ≥ t} decay^(t'−t) r_t' in Python floats (double precision throughout)."""
    out, running = [], 0.0
    for reward in reversed(rewards):
        running = reward + decay * running
        out.append(running)
    return out[::-1]


def test_fp64_inputs_discount_in_fp64() -> None:
    # γ and γλ rounded to fp32 (0.99 → 0.9900000095) err by ~1e-8 per step: far above fp64 round-off.
    generator = torch.Generator().manual_seed(3)
    rewards = torch.randn(2, 64, generator=generator, dtype=torch.float64)
    mask = torch.ones(2, 64, dtype=torch.bool)
    returns = reinforce_plus_plus(rewards, mask, gamma=0.99).returns
    assert returns is not None and returns.dtype == torch.float64
    expected = torch.tensor([float_discounted_sum(row, 0.99) for row in rewards.tolist()], dtype=torch.float64)
    torch.testing.assert_close(returns, expected, rtol=1e-13, atol=1e-13)
    # GAE with V = 0: δ_t = r_t, so the raw advantages (= returns) are the γλ-discounted sums.
    gae_returns = gae(rewards, mask, values=torch.zeros_like(rewards), gamma=0.99, lam=0.9).returns
    expected = torch.tensor([float_discounted_sum(row, 0.99 * 0.9) for row in rewards.tolist()], dtype=torch.float64)
    torch.testing.assert_close(gae_returns, expected, rtol=1e-13, atol=1e-13)


def test_reinforce_plus_plus_baseline_centres_per_group_then_whitens_over_tokens() -> None:
    rewards, mask = outcome_rewards([1.0, 0.0, 3.0, 3.0], [2, 1, 1, 1], 2)
    advantages = reinforce_plus_plus_baseline(rewards, mask, uid=torch.tensor([0, 0, 1, 1])).advantages
    # Centred per token: [0.5, 0.5], [-0.5], [0], [0] → mean 0.1, unbiased std over 5 tokens.
    centred = torch.tensor([0.5, 0.5, -0.5, 0.0, 0.0])
    expected = (centred - centred.mean()) / torch.sqrt(centred.var() + 1e-8)
    torch.testing.assert_close(advantages[mask.bool()], expected)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(sizes=st.lists(st.integers(1, 5), min_size=1, max_size=6), seed=st.integers(0, 2**31 - 1))
def test_grpo_has_zero_mean_in_every_group_of_two_or_more(sizes: list[int], seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    uid = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
    scores = torch.randint(0, 3, (len(uid),), generator=generator).float()
    rewards, mask = outcome_rewards(scores.tolist(), [1] * len(uid), 1)
    for norm in (True, False):
        advantages = per_response(grpo(rewards, mask, uid=uid, norm_adv_by_std_in_grpo=norm).advantages)
        for group, size in enumerate(sizes):
            if size > 1:
                assert float(advantages[uid == group].sum()) == pytest.approx(0.0, abs=1e-5)
            else:
                assert float(advantages[uid == group]) == pytest.approx(float(scores[uid == group]), rel=1e-5)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(sizes=st.lists(st.integers(2, 5), min_size=1, max_size=5), seed=st.integers(0, 2**31 - 1))
def test_rloo_equals_explicit_leave_one_out(sizes: list[int], seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    uid = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
    uid = uid[torch.randperm(len(uid), generator=generator)]  # groups need not be contiguous in the batch
    scores = torch.randn(len(uid), generator=generator)
    rewards, mask = outcome_rewards(scores.tolist(), [1] * len(uid), 1)
    advantages = per_response(rloo(rewards, mask, uid=uid).advantages)
    for i in range(len(uid)):
        others = [j for j in range(len(uid)) if j != i and uid[j] == uid[i]]
        assert float(advantages[i]) == pytest.approx(float(scores[i] - scores[others].mean()), abs=1e-5)


def test_the_optimal_token_baselines_agree_on_responses_without_gaps() -> None:
    """tir_optimal_token_baseline lines tokens up by valid-token count, optimal_token_baseline by column: the same
    thing when no response has a masked token inside it. A group's lone longest response keeps its own return
    past the others' length (the zero tail), where the baseline would otherwise be that very return."""
    generator = torch.Generator().manual_seed(3)
    lengths = [2, 5, 3, 3, 4, 1]
    mask = torch.arange(6) < torch.tensor(lengths).unsqueeze(-1)
    inputs = dict(uid=torch.tensor([0, 0, 0, 1, 1, 2]), old_log_probs=-torch.rand(6, 6, generator=generator),
                  sum_pi_squared=0.3 + 0.5 * torch.rand(6, 6, generator=generator))
    rewards = torch.where(mask, torch.randn(6, 6, generator=generator), 0.0)
    column = optimal_token_baseline(rewards, mask, **inputs)
    counted = tir_optimal_token_baseline(rewards, mask, **inputs)
    torch.testing.assert_close(column.advantages, counted.advantages)
    assert torch.equal(column.returns, counted.returns)
    assert torch.equal(column.advantages[1, 3:5], column.returns[1, 3:5])  # response 1: 5 tokens, the others <= 3
    assert torch.equal(column.advantages[5], column.returns[5])  # a group of one: no baseline


ALL_INPUTS_RNG = torch.Generator().manual_seed(0)


def random_batch(batch: int, width: int, groups: int) -> dict[str, torch.Tensor]:
    lengths = torch.randint(1, width + 1, (batch,), generator=ALL_INPUTS_RNG)
    mask = torch.arange(width) < lengths.unsqueeze(-1)
    mask[:, 1] &= torch.rand(batch, generator=ALL_INPUTS_RNG) > 0.5  # some interior holes
    mask[:, 0] = True
    return {
        "token_rewards": torch.randn(batch, width, generator=ALL_INPUTS_RNG),
        "response_mask": mask,
        "uid": torch.arange(batch) % groups,
        "values": torch.randn(batch, width, generator=ALL_INPUTS_RNG),
        "greedy_scores": torch.randn(batch, generator=ALL_INPUTS_RNG),
        # the optimal token baselines': the sampled token's log-prob and Σπ² (>= π²)
        "old_log_probs": -torch.rand(batch, width, generator=ALL_INPUTS_RNG),
        "sum_pi_squared": 0.4 + 0.6 * torch.rand(batch, width, generator=ALL_INPUTS_RNG),
    }


@pytest.mark.parametrize("name", ADVANTAGE_ESTIMATORS.names())
def test_masked_tokens_never_change_a_result(name: str) -> None:
    inputs = random_batch(batch=12, width=6, groups=4)
    estimator = ADVANTAGE_ESTIMATORS.get(name)
    clean = call_with_available(estimator, **inputs, gamma=0.9, lam=0.95)
    padded = ~inputs["response_mask"]
    garbage = dict(inputs)
    garbage["token_rewards"] = inputs["token_rewards"].masked_fill(padded, float("nan"))
    garbage["values"] = inputs["values"].masked_fill(padded, float("inf"))
    garbage["old_log_probs"] = inputs["old_log_probs"].masked_fill(padded, float("nan"))
    garbage["sum_pi_squared"] = inputs["sum_pi_squared"].masked_fill(padded, float("inf"))
    dirty = call_with_available(estimator, **garbage, gamma=0.9, lam=0.95)
    assert torch.equal(clean.advantages, dirty.advantages)
    assert torch.all(clean.advantages[padded] == 0)
    assert torch.isfinite(clean.advantages).all()
    if clean.returns is not None:
        assert dirty.returns is not None and torch.equal(clean.returns, dirty.returns)


@pytest.mark.parametrize("name", ["grpo", "rloo", "opo", "gpg", "reinforce_plus_plus_baseline"])
def test_grouped_estimators_ignore_batch_order(name: str) -> None:
    inputs = random_batch(batch=10, width=5, groups=3)
    estimator = ADVANTAGE_ESTIMATORS.get(name)
    permutation = torch.randperm(10, generator=ALL_INPUTS_RNG)
    shuffled = {key: value[permutation] for key, value in inputs.items()}
    torch.testing.assert_close(
        call_with_available(estimator, **inputs).advantages[permutation],
        call_with_available(estimator, **shuffled).advantages,
    )
