"""algorithm.rollout_correction on the driver: the run plan's decisions, what the correction puts in the batch,
and what the advantages and the step's diagnostics then read (the tensors against verl's formulas:
tests/algorithms/test_verl_reference.py; the loss: tests/workers/test_objectives.py)."""

import pytest
import torch

from meshrl.config import ConfigError, load_config
from meshrl.config.run_plan import build_run_plan, on_policy_update
from meshrl.protocol import Batch
from meshrl.trainer.advantage import compute_advantages
from meshrl.trainer.rl_trainer import batch_metrics
from meshrl.trainer.rollout_correction import apply_rollout_correction, use_rollout_log_probs
from meshrl.workers.sequences import ATTENTION_MASK, SAMPLED_MASK, sampled

ON_POLICY = ["actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_epochs=1"]
KEY = "algorithm.rollout_correction."


def plan_of(*overrides: str):
    return build_run_plan(load_config([*ON_POLICY, *overrides], recipe="cpu_tiny_grpo"))


@pytest.mark.parametrize("overrides, on_policy, recompute", [
    ([], True, False),  # metrics only: the update's forward gives the old log-probs, as without the section
    ([f"{KEY}rollout_is=token"], False, True),  # the weights need logπ_old before the update
    ([f"{KEY}rollout_rs=token_k1", f"{KEY}rollout_rs_threshold=2.0"], False, True),
    ([f"{KEY}bypass_mode=True"], False, False),  # logπ_old is the engine's: no pass, and not the on-policy update
])
def test_when_the_old_log_prob_pass_runs(overrides, on_policy, recompute):
    plan = plan_of(*overrides)
    assert on_policy_update(load_config([*ON_POLICY, *overrides], recipe="cpu_tiny_grpo")) is on_policy
    assert plan.on_policy is on_policy and plan.old_log_prob_pass is recompute


def test_bypass_mode_plan():
    """verl's apply_bypass_mode: the loss becomes bypass_mode whatever loss_mode says (said at start-up); the
    train/rollout alarm has nothing to compare."""
    plan = plan_of(f"{KEY}bypass_mode=True", f"{KEY}loss_type=reinforce", f"{KEY}rollout_is=sequence",
                   "actor_rollout_ref.actor.policy_loss.loss_mode=gspo")
    assert plan.policy_loss == "bypass_mode" and plan.mismatch_tolerance is None
    assert plan.rollout_correction.loss_type == "reinforce" and plan.rollout_correction.rollout_is == "sequence"
    assert any("loss_mode=gspo is not used" in w for w in plan.warnings)
    assert any("alarm (trainer.on_mismatch) is off" in w for w in plan.warnings)


@pytest.mark.parametrize("overrides, message", [
    ([f"{KEY}rollout_rs=token_k3"], "rollout_rs_threshold must be set"),
    ([f"{KEY}rollout_is=tokens"], "rollout_is must be null, token or sequence"),
    (["actor_rollout_ref.actor.policy_loss.loss_mode=bypass_mode"], "bypass_mode=True instead"),
])
def test_refused_at_load_time(overrides, message):
    with pytest.raises(ConfigError, match=message):
        plan_of(*overrides)


def test_settings_without_effect_are_named():
    plan = plan_of(f"{KEY}rollout_rs_threshold=0.5_2.0", f"{KEY}loss_type=reinforce")
    assert any("rollout_rs_threshold (rollout_rs is null), loss_type (bypass_mode is False): no effect" in w
               for w in plan.warnings)


def grpo_batch() -> Batch:
    """Two groups of two responses; the engine's log-probs of response 1 are far off the trainer's."""
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0], [1.0, 0.0, 0.0, 0.0]])
    old = torch.full((4, 4), -1.0)
    rollout = old.clone()
    rollout[1, :2] = -3.0  # δ = 2 on response 1's tokens
    rollout[2, 1] = -1.1  # δ = 0.1
    scores = torch.zeros(4, 4)
    for row, score in enumerate((1.0, 1.0, 0.0, 1.0)):
        scores[row, int(mask[row].sum()) - 1] = score
    return Batch(tensors={"response_mask": mask, "old_log_probs": old, "rollout_log_probs": rollout,
                          "token_level_rewards": scores, "uid": torch.tensor([0, 0, 1, 1])},
                 non_tensors={"prompt_ids": [[1]] * 4})


def test_decoupled_correction_weighs_and_rejects_and_the_advantages_see_every_sampled_token():
    plan = plan_of(f"{KEY}rollout_is=token", f"{KEY}rollout_is_threshold=2.0", f"{KEY}rollout_rs=seq_sum_k1",
                   f"{KEY}rollout_rs_threshold=0.5_2.0")
    batch = grpo_batch()
    sampled_mask = batch["response_mask"].clone()
    metrics = apply_rollout_correction(batch, plan.rollout_correction)
    # response 1 (Σδ = 4 > log 2) is rejected whole; the model still reads it, the estimators still see it
    assert batch["response_mask"][1].sum() == 0
    assert torch.equal(batch["response_mask"][[0, 2, 3]], sampled_mask[[0, 2, 3]])
    assert torch.equal(batch[ATTENTION_MASK], sampled_mask) and torch.equal(sampled(batch), sampled_mask)
    ratio = torch.exp(batch["old_log_probs"] - batch["rollout_log_probs"])
    expected_weights = torch.where(sampled_mask.bool(), ratio.clamp(max=2.0), 0.0)
    assert torch.allclose(batch["rollout_is_weights"], expected_weights)
    assert metrics["rollout_corr/rollout_rs_seq_sum_k1_seq_masked_fraction"] == 0.25
    assert metrics["rollout_corr/rollout_is_max"] == 2.0 and "rollout_corr/kl" not in metrics  # kl: batch_metrics
    # GRPO as verl: response 1's score still counts in its group (verl sums every token's reward), so the
    # advantages of the kept responses are those without the rejection
    algorithm = load_config([], recipe="cpu_tiny_grpo").algorithm
    untouched = grpo_batch()
    compute_advantages(batch, algorithm, "grpo")
    compute_advantages(untouched, algorithm, "grpo")
    assert torch.allclose(batch["advantages"], untouched["advantages"])

    diagnostics = batch_metrics(batch, plan)  # on every sampled token, the rejected ones included
    assert diagnostics["rollout/log_prob_max_abs_diff"] == pytest.approx(2.0)
    assert diagnostics["rollout_corr/kl"] == pytest.approx(-(2.0 * 2 + 0.1) / 10)


def test_nothing_to_correct_leaves_the_batch_alone_and_still_logs_the_diagnostics():
    plan = plan_of()
    batch = grpo_batch()
    assert apply_rollout_correction(batch, plan.rollout_correction) == {}
    assert set(batch.keys()) == set(grpo_batch().keys())
    logged = batch_metrics(batch, plan)
    assert {"rollout_corr/kl", "rollout_corr/k3_kl", "rollout_corr/chi2_seq", "rollout_corr/training_ppl",
            "rollout_corr/ppl_ratio"} <= set(logged)


def test_bypass_mode_takes_the_engine_log_probs_and_logs_no_comparison():
    plan = plan_of(f"{KEY}bypass_mode=True", f"{KEY}rollout_is=token")
    batch = grpo_batch()
    use_rollout_log_probs(batch)
    assert torch.equal(batch["old_log_probs"], batch["rollout_log_probs"])
    assert apply_rollout_correction(batch, plan.rollout_correction) == {}  # the loss corrects, per micro-batch
    assert "rollout_is_weights" not in batch and SAMPLED_MASK not in batch
    assert not {k for k in batch_metrics(batch, plan) if k.startswith(("rollout/", "rollout_corr/"))}


def test_rejecting_every_token_says_so():
    plan = plan_of(f"{KEY}rollout_rs=token_k2", f"{KEY}rollout_rs_threshold=1e-9")
    batch = grpo_batch()
    batch.set("rollout_log_probs", batch["rollout_log_probs"] - 0.5)
    with pytest.raises(ValueError, match="rejects every token"):
        apply_rollout_correction(batch, plan.rollout_correction)
