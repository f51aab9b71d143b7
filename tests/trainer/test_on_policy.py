"""When the old-log-prob recompute is skipped (the update is exactly on-policy), and what the step then logs."""

import pytest
import torch

from meshrl.config import load_config
from meshrl.protocol import Batch
from meshrl.config.run_plan import build_run_plan, on_policy_update
from meshrl.trainer.rl_trainer import batch_metrics

# One mini-batch of the whole batch (4 prompts), one epoch: the tiny recipe's on-policy form.
ON_POLICY = ["actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_epochs=1"]


@pytest.mark.parametrize("overrides, expected", [
    (ON_POLICY, True),
    (ON_POLICY + ["actor_rollout_ref.rollout.n=8"], True),  # n scales mini-batch and batch alike
    (ON_POLICY + ["actor_rollout_ref.actor.use_kl_loss=True"], True),  # the KL loss reads logπ, not logπ_old
    (ON_POLICY + ["algorithm.adv_estimator=gae"], True),
    (["actor_rollout_ref.actor.ppo_mini_batch_size=2"], False),  # two optimizer steps: the second is off-policy
    (ON_POLICY[:1] + ["actor_rollout_ref.actor.ppo_epochs=2"], False),
    (ON_POLICY + ["algorithm.use_kl_in_reward=True"], False),  # the reward needs logπ_old before the update
    (ON_POLICY + ["actor_rollout_ref.actor.skip_on_policy_old_log_prob=False"], False),
    # Σπ² comes from the old-log-prob pass, and the optimal token baselines read it and logπ_old before the update
    (ON_POLICY + ["actor_rollout_ref.actor.calculate_sum_pi_squared=True"], False),
    (ON_POLICY + ["algorithm.adv_estimator=tir_optimal_token_baseline",
                  "actor_rollout_ref.actor.calculate_sum_pi_squared=True"], False),
])
def test_decision_rule(overrides, expected):
    assert on_policy_update(load_config(overrides, recipe="cpu_tiny_grpo")) is expected


def test_the_bench_job_is_on_policy():
    """bench/vs_trl.py's meshrl side: ppo_mini_batch_size = train_batch_size, one epoch, no KL."""
    cfg = load_config(["data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
                       "actor_rollout_ref.actor.ppo_epochs=1", "algorithm.use_kl_in_reward=False"],
                      recipe="cpu_smollm2_grpo")
    assert on_policy_update(cfg)


def _batch(with_old: bool) -> Batch:
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    tensors = {"response_mask": mask, "rollout_log_probs": torch.full((2, 3), -1.0),
               "ref_log_probs": torch.full((2, 3), -1.5)}
    if with_old:
        tensors["old_log_probs"] = torch.full((2, 3), -1.25)
    return Batch(tensors=tensors, non_tensors={"prompt_ids": [[1, 2], [3]]})


def test_log_prob_diagnostics_only_where_old_log_probs_exist():
    plan = build_run_plan(load_config(ON_POLICY + ["actor_rollout_ref.actor.use_kl_loss=True"], recipe="cpu_tiny_grpo"))
    assert plan.use_reference and plan.on_policy and not plan.use_critic
    with_old = batch_metrics(_batch(with_old=True), plan)
    assert with_old["actor/ref_kl_k1"] == pytest.approx(0.25)
    assert with_old["actor/ref_log_prob_max_abs_diff"] == pytest.approx(0.25)
    assert with_old["rollout/log_prob_max_abs_diff"] == pytest.approx(0.25)
    # A step without an actor update (critic warm-up) has no logπ_old when the recompute is skipped.
    without = batch_metrics(_batch(with_old=False), plan)
    assert not {"actor/ref_kl_k1", "actor/ref_log_prob_max_abs_diff", "rollout/log_prob_max_abs_diff"} & set(without)
    assert without["response_length/mean"] == 1.5
