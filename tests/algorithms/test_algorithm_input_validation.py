"""Bad inputs raise ValueError naming the argument and the problem."""

from __future__ import annotations

import pytest
import torch

from meshrl.algorithms import (
    GlobalNorm,
    aggregate_loss,
    apply_kl_penalty,
    gae,
    grpo,
    grpo_passk,
    remax,
    rloo,
    vanilla,
)

MASK = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 1]])
REWARDS = torch.zeros(4, 3)
UID = torch.tensor([0, 0, 1, 1])


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_rewards_at_valid_tokens(bad: float) -> None:
    rewards = REWARDS.clone()
    rewards[2, 1] = bad
    with pytest.raises(ValueError, match=r"token_rewards has 1 non-finite value.*index \(2, 1\)"):
        grpo(rewards, MASK, uid=UID)


def test_non_finite_values_for_gae() -> None:
    values = torch.zeros(4, 3)
    values[0, 0] = float("nan")
    with pytest.raises(ValueError, match="values has 1 non-finite"):
        gae(REWARDS, MASK, values=values)


def test_non_finite_advantages_in_the_policy_loss_even_at_masked_tokens() -> None:
    advantages = torch.zeros(4, 3)
    advantages[0, 2] = float("nan")  # masked, but it would still poison that token's gradient
    with pytest.raises(ValueError, match="advantages has 1 non-finite"):
        vanilla(torch.zeros(4, 3), torch.zeros(4, 3), advantages, MASK)


def test_mismatched_shapes_name_both_arguments() -> None:
    with pytest.raises(ValueError, match=r"token_rewards has shape \(4, 2\) but response_mask has shape \(4, 3\)"):
        grpo(torch.zeros(4, 2), MASK, uid=UID)
    with pytest.raises(ValueError, match=r"old_log_prob has shape \(4, 4\)"):
        vanilla(torch.zeros(4, 3), torch.zeros(4, 4), torch.zeros(4, 3), MASK)
    with pytest.raises(ValueError, match=r"greedy_scores must have shape \(4,\)"):
        remax(REWARDS, MASK, greedy_scores=torch.zeros(4, 1))
    with pytest.raises(ValueError, match=r"token_loss has shape"):
        aggregate_loss(torch.zeros(3, 3), MASK, "token-mean", GlobalNorm.from_mask(MASK))
    with pytest.raises(ValueError, match=r"log_prob has shape"):
        apply_kl_penalty(REWARDS, torch.zeros(4, 2), torch.zeros(4, 2), MASK, kl_coef=0.1)


@pytest.mark.parametrize(
    ("uid", "message"),
    [
        (torch.tensor([0.0, 0.0, 1.0, 1.0]), "uid must be an integer tensor"),
        (torch.tensor([0, 0, 1]), r"uid must have shape \(4,\)"),
        (torch.tensor([0, 0, -1, 1]), "uid must hold group indices >= 0"),
        (torch.tensor([0, 0, 2, 2]), r"uid leaves group\(s\) \[1\] of \[0, 3\) empty"),
    ],
)
def test_bad_group_ids(uid: torch.Tensor, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        rloo(REWARDS, MASK, uid=uid)


def test_empty_batch_and_masks() -> None:
    with pytest.raises(ValueError, match="empty batch"):
        grpo(torch.zeros(0, 3), torch.zeros(0, 3), uid=torch.zeros(0, dtype=torch.long))
    with pytest.raises(ValueError, match="response_mask must be 2-D"):
        grpo(torch.zeros(4), torch.ones(4), uid=UID)
    with pytest.raises(ValueError, match="no valid token"):
        gae(REWARDS, torch.zeros(4, 3), values=torch.zeros(4, 3))


def test_passk_needs_two_samples_per_group() -> None:
    with pytest.raises(ValueError, match=r"grpo_passk needs >= 2 samples per group; uid group\(s\) \[2\]"):
        grpo_passk(torch.zeros(5, 3), torch.ones(5, 3), uid=torch.tensor([0, 0, 1, 1, 2]))


def test_dual_clip_bound_must_exceed_one() -> None:
    with pytest.raises(ValueError, match="clip_ratio_c must be > 1"):
        vanilla(torch.zeros(4, 3), torch.zeros(4, 3), torch.zeros(4, 3), MASK, clip_ratio_c=1.0)
