"""Driver step 5: outcome scores placed on the last token, KL in reward, estimator dispatch by config."""

import numpy as np
import pytest
import torch

from meshrl.algorithms import gdpo, make_kl_controller, optimal_token_baseline
from meshrl.config import load_config
from meshrl.protocol import Batch
from meshrl.config.run_plan import build_run_plan
from meshrl.trainer.advantage import compute_advantages, compute_token_rewards, outcome_to_token_scores
from meshrl.trainer.dumps import set_reward_extras


def rollout_batch():
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]], dtype=torch.float32)
    scores = torch.tensor([1.0, 0.0, 1.0, 1.0])
    return Batch(tensors={
        "response_mask": mask,
        "token_level_scores": outcome_to_token_scores(scores, mask),
        "uid": torch.tensor([0, 0, 1, 1]),
        "old_log_probs": -torch.ones(4, 4),
        "ref_log_probs": -torch.ones(4, 4),
    })


def test_scores_sit_on_last_valid_token():
    batch = rollout_batch()
    expected = torch.tensor([[0, 0, 1, 0], [0, 0, 0, 0], [0, 0, 0, 1], [1, 0, 0, 0]], dtype=torch.float32)
    assert torch.equal(batch["token_level_scores"], expected)
    with pytest.raises(ValueError, match="no valid token"):
        outcome_to_token_scores(torch.ones(1), torch.zeros(1, 3))


def test_grpo_by_config():
    batch = rollout_batch()
    cfg = load_config(["algorithm.adv_estimator=grpo"])
    compute_token_rewards(batch, cfg.algorithm, None, None)
    compute_advantages(batch, cfg.algorithm, cfg.algorithm.adv_estimator)
    adv = batch["advantages"]
    # group 0: scores (1, 0): mean .5, std .7071 → ±0.7071; group 1 all equal → 0
    assert adv[0, 0] == pytest.approx(0.5 / (2 ** 0.5 / 2 + 1e-6), rel=1e-5)
    assert adv[1, 0] == pytest.approx(-adv[0, 0].item(), rel=1e-6)
    assert torch.all(adv[2:] == 0) and torch.all(adv[0, 3] == 0)


def test_remax_needs_greedy_scores_and_uses_them():
    batch = rollout_batch()
    cfg = load_config(["algorithm.adv_estimator=remax"])
    compute_token_rewards(batch, cfg.algorithm, None, None)
    with pytest.raises(ValueError, match="greedy_scores"):
        compute_advantages(batch, cfg.algorithm, cfg.algorithm.adv_estimator)
    batch.set("greedy_scores", torch.tensor([1.0, 1.0, 0.0, 0.0]))
    compute_advantages(batch, cfg.algorithm, cfg.algorithm.adv_estimator)
    # response 0 equals the greedy score → 0 advantage on every token; response 1 scored 0 vs 1 → -1
    assert torch.all(batch["advantages"][0] == 0)
    assert batch["advantages"][1, :2].tolist() == [-1.0, -1.0]


def test_remax_reward_clip_clips_sampled_and_greedy_scores_alike():
    batch = rollout_batch()
    batch.set("token_level_scores", 4 * batch["token_level_scores"])  # sampled scores 4, 0, 4, 4
    batch.set("greedy_scores", torch.tensor([9.0, 9.0, -7.0, -7.0]))
    cfg = load_config(["algorithm.adv_estimator=remax", "algorithm.remax.reward_clip=2"])
    compute_token_rewards(batch, cfg.algorithm, None, None)
    assert batch["greedy_scores"].tolist() == [2.0, 2.0, -2.0, -2.0]
    compute_advantages(batch, cfg.algorithm, cfg.algorithm.adv_estimator)
    # Both sides clipped: 2 − 2 = 0 for response 0 (unclipped it would be 4 − 9), 2 − (−2) = 4 for response 2.
    assert batch["advantages"][:, 0].tolist() == [0.0, -2.0, 4.0, 4.0]


def test_reward_clip_clips_the_scores_of_every_estimator():
    batch = rollout_batch()
    batch.set("token_level_scores", -3 * batch["token_level_scores"])
    cfg = load_config(["algorithm.adv_estimator=grpo", "algorithm.remax.reward_clip=1"])
    compute_token_rewards(batch, cfg.algorithm, None, None)
    assert torch.equal(batch["token_level_rewards"], batch["token_level_scores"] / 3)


def test_kl_in_reward_with_identical_policies_changes_nothing():
    batch = rollout_batch()
    cfg = load_config(["algorithm.adv_estimator=grpo", "algorithm.use_kl_in_reward=True"])
    ctrl = make_kl_controller("fixed", kl_coef=0.5)
    kl_in_reward = build_run_plan(cfg).kl_in_reward  # algorithm.kl_penalty, as the trainer takes it
    assert kl_in_reward == cfg.algorithm.kl_penalty
    metrics = compute_token_rewards(batch, cfg.algorithm, ctrl, kl_in_reward)
    assert metrics["actor/reward_kl_penalty"] == 0.0
    assert torch.equal(batch["token_level_rewards"], batch["token_level_scores"])
    batch.set("old_log_probs", torch.zeros(4, 4))  # now KL(k1) = +1 per valid token
    compute_token_rewards(batch, cfg.algorithm, ctrl, kl_in_reward)
    diff = batch["token_level_scores"] - batch["token_level_rewards"]
    assert torch.allclose(diff, 0.5 * batch["response_mask"])


def test_unknown_estimator_suggests():
    batch = rollout_batch()
    cfg = load_config(["algorithm.adv_estimator=grppo"])
    compute_token_rewards(batch, cfg.algorithm, None, None)
    with pytest.raises(ValueError, match="grpo"):
        compute_advantages(batch, cfg.algorithm, cfg.algorithm.adv_estimator)


def test_gdpo_reads_the_reward_functions_components_by_verls_keys():
    """The components are the reward function's extra outputs (the batch's reward extras); verl's gdpo/<key>/*
    statistics are logged. A listed component the function does not return is named, with those it does."""
    batch = rollout_batch()
    set_reward_extras(batch, {"accuracy_reward": [1.0, 0.0, 1.0, 1.0], "format_reward": [0.5, 1.0, None, 0.0]})
    cfg = load_config(["algorithm.adv_estimator=gdpo", "algorithm.gdpo_reward_keys=[accuracy_reward,format_reward]",
                       "algorithm.gdpo_reward_weights=[1.0,2.0]"])
    compute_token_rewards(batch, cfg.algorithm, None, None)
    metrics = compute_advantages(batch, cfg.algorithm, cfg.algorithm.adv_estimator)
    direct = gdpo(batch["token_level_rewards"], batch["response_mask"], uid=batch["uid"],
                  reward_extras={"accuracy_reward": [1.0, 0.0, 1.0, 1.0], "format_reward": [0.5, 1.0, 0.0, 0.0]},
                  gdpo_reward_keys=["accuracy_reward", "format_reward"], gdpo_reward_weights=[1.0, 2.0])
    assert torch.equal(batch["advantages"], direct.advantages)  # a response without the component (None): 0
    assert metrics["gdpo/format_reward/mean"] == pytest.approx(0.375)
    assert metrics["gdpo/format_reward/std"] == pytest.approx(float(np.std([0.5, 1.0, 0.0, 0.0])))
    assert (metrics["gdpo/accuracy_reward/min"], metrics["gdpo/accuracy_reward/max"]) == (0.0, 1.0)
    cfg = load_config(["algorithm.adv_estimator=gdpo", "algorithm.gdpo_reward_keys=[accuracy_reward,length_reward]"])
    with pytest.raises(ValueError, match=r"\['length_reward'\].*\['accuracy_reward', 'format_reward'\]"):
        compute_advantages(batch, cfg.algorithm, cfg.algorithm.adv_estimator)


def test_optimal_token_baseline_takes_old_log_probs_sum_pi_squared_and_rollout_is_weights():
    batch = rollout_batch()
    cfg = load_config(["algorithm.adv_estimator=optimal_token_baseline"])
    compute_token_rewards(batch, cfg.algorithm, None, None)
    with pytest.raises(ValueError, match="sum_pi_squared"):  # the actor gives it with calculate_sum_pi_squared
        compute_advantages(batch, cfg.algorithm, cfg.algorithm.adv_estimator)
    batch.set("sum_pi_squared", torch.full((4, 4), 0.3))
    compute_advantages(batch, cfg.algorithm, cfg.algorithm.adv_estimator)
    inputs = dict(uid=batch["uid"], old_log_probs=batch["old_log_probs"], sum_pi_squared=batch["sum_pi_squared"])
    plain = optimal_token_baseline(batch["token_level_rewards"], batch["response_mask"], **inputs)
    assert torch.equal(batch["advantages"], plain.advantages) and torch.equal(batch["returns"], plain.returns)
    weights = torch.tensor([[1.0, 2.0, 0.5, 1.0], [2.0, 1.0, 1.0, 1.0], [1.0] * 4, [0.5] * 4])
    batch.set("rollout_is_weights", weights)
    compute_advantages(batch, cfg.algorithm, cfg.algorithm.adv_estimator)
    weighted = optimal_token_baseline(batch["token_level_rewards"], batch["response_mask"], **inputs,
                                      rollout_is_weights=weights)
    assert torch.equal(batch["advantages"], weighted.advantages)
    assert not torch.equal(weighted.advantages, plain.advantages)
