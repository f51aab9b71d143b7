"""The train/rollout log-prob alarm (meshrl.trainer.alarms): its rule, its state across a resume, the metric it
reads, and the run plan's decision of when it applies and with what tolerance (meshrl.config.run_plan)."""

from __future__ import annotations

import logging

import pytest
import torch

from meshrl.config import ConfigError, load_config
from meshrl.config.run_plan import build_run_plan
from meshrl.protocol import Batch
from meshrl.trainer.alarms import (ALARM_KEY, HISTORY, MAX_KEY, MEAN_KEY, LogProbMismatchError, MismatchAlarm,
                                   mismatch_verdict)
from meshrl.trainer.rl_trainer import batch_metrics


# ------------------------------------------------------------------------------- the rule
def test_the_first_check_compares_with_the_tolerance():
    assert mismatch_verdict(2e-3, [], tolerance=1e-3, first=True).startswith("it exceeds the tolerance 0.001")
    assert mismatch_verdict(5e-4, [], tolerance=1e-3, first=True) is None
    # later steps judge jumps only: a slowly grown gap (a peakier policy in bf16) is no alarm by itself
    assert mismatch_verdict(2e-3, [1e-3, 1.5e-3, 1.8e-3], tolerance=1e-3, first=False) is None


def test_a_jump_is_ten_times_the_running_median_above_a_floor():
    history = [0.010, 0.012, 0.011, 0.5]  # one outlier does not lift the median (0.0115)
    assert "jumped above 10x the median 0.0115" in mismatch_verdict(0.12, history, tolerance=0.2, first=False)
    assert mismatch_verdict(0.11, history, tolerance=0.2, first=False) is None
    # float32 rounding noise: 50x a median of 1e-7 is still under the floor tolerance / 10 = 1e-4
    assert mismatch_verdict(5e-6, [1e-7] * 5, tolerance=1e-3, first=False) is None
    assert mismatch_verdict(2e-4, [1e-7] * 5, tolerance=1e-3, first=False) is not None
    # too little history to call anything a jump
    assert mismatch_verdict(1.0, [1e-7] * 2, tolerance=1e-3, first=False) is None


def test_the_median_spans_the_last_history_steps_only():
    old_level, new_level = [1e-1] * HISTORY, [1e-3] * HISTORY
    assert mismatch_verdict(2e-2, old_level + new_level, tolerance=1e-3, first=False) is not None
    assert mismatch_verdict(2e-2, new_level + old_level, tolerance=1e-3, first=False) is None


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_non_finite_gap_is_always_an_alarm(value):
    assert mismatch_verdict(value, [], tolerance=1.0, first=False) == f"the mean is {value}"


# ------------------------------------------------------------------------------- the tracker
def step(mean: float) -> dict[str, float]:
    return {MEAN_KEY: mean, MAX_KEY: 4 * mean}


def test_stop_raises_at_the_first_check_naming_the_causes():
    alarm = MismatchAlarm(tolerance=1e-3, action="stop")
    with pytest.raises(LogProbMismatchError) as stopped:
        alarm.check(1, step(0.5))
    message = str(stopped.value)
    assert "at step 1" in message and "is 0.5 (max 2)" in message
    for cause in ("stale or partial weight sync", "conversion", "rollout.logprobs_mode", "rollout.dtype",
                  "trainer.mismatch_tolerance", "trainer.on_mismatch=warn"):
        assert cause in message, cause


def test_warn_logs_and_flags_the_step_and_training_goes_on(caplog):
    alarm = MismatchAlarm(tolerance=1e-3, action="warn")
    with caplog.at_level(logging.WARNING, logger="meshrl.trainer.alarms"):
        assert alarm.check(1, step(0.5)) == {ALARM_KEY: 1.0}
        assert alarm.check(2, step(0.5)) == {ALARM_KEY: 0.0}  # no jump against its own history
    assert len(caplog.records) == 1 and "trainer.on_mismatch=warn" in caplog.records[0].getMessage()


def test_a_non_finite_step_stays_out_of_the_history():
    alarm = MismatchAlarm(tolerance=1e-3, action="warn")
    for i, mean in enumerate([1e-5, float("nan"), 2e-5, 1e-5], start=1):
        alarm.check(i, step(mean))
    assert alarm.state_dict() == {"history": [1e-5, 2e-5, 1e-5]}
    assert alarm.check(5, step(5e-4)) == {ALARM_KEY: 1.0}  # the median (1e-5) is still defined


def test_steps_without_the_metric_leave_the_first_check_to_the_first_step_with_it():
    alarm = MismatchAlarm(tolerance=1e-3, action="stop")
    assert alarm.check(1, {}) == {}  # e.g. trainer.critic_warmup with an on-policy update: no old_log_probs
    with pytest.raises(LogProbMismatchError, match="at step 2"):
        alarm.check(2, step(2e-3))


def test_no_tolerance_means_no_alarm():
    assert MismatchAlarm(tolerance=None, action="stop").check(1, step(10.0)) == {}


def test_a_resumed_alarm_checks_strictly_again_and_judges_jumps_on_the_saved_history():
    before = MismatchAlarm(tolerance=1e-3, action="stop")
    for i, mean in enumerate([1e-5, 2e-5, 1.5e-5], start=1):
        assert before.check(i, step(mean)) == {ALARM_KEY: 0.0}
    resumed = MismatchAlarm(tolerance=1e-3, action="stop")
    resumed.load_state_dict(before.state_dict())
    with pytest.raises(LogProbMismatchError, match="exceeds the tolerance"):  # the re-synced engine's first step
        resumed.check(4, step(2e-3))
    resumed = MismatchAlarm(tolerance=1e-3, action="stop")
    resumed.load_state_dict(before.state_dict())
    resumed.check(4, step(1e-5))
    with pytest.raises(LogProbMismatchError, match=r"jumped above 10x the median 1.25e-05 of the last 4 steps"):
        resumed.check(5, step(5e-4))  # under the tolerance, but a jump against the run's history
    fresh = MismatchAlarm(tolerance=1e-3, action="stop")
    fresh.check(1, step(1e-5))
    assert fresh.check(2, step(5e-4)) == {ALARM_KEY: 0.0}  # without that history, no jump can be told


# ------------------------------------------------------------------------------- the metric
def test_batch_metrics_average_the_gap_over_response_tokens_only():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    old = torch.tensor([[-1.0, -2.0, -9.0], [-0.5, -7.0, 0.0]])
    rollout = torch.tensor([[-1.25, -1.5, 0.0], [-0.5, 0.0, 0.0]])  # gaps 0.25, 0.5, 0 on the 3 response tokens
    batch = Batch(tensors={"response_mask": mask, "old_log_probs": old, "rollout_log_probs": rollout},
                  non_tensors={"prompt_ids": [[1], [2]]})
    out = batch_metrics(batch, build_run_plan(load_config([], recipe="cpu_tiny_grpo")))
    assert out[MEAN_KEY] == pytest.approx(0.25) and out[MAX_KEY] == pytest.approx(0.5)


# ------------------------------------------------------------------------------- the plan
def plan_of(*overrides: str):
    return build_run_plan(load_config(list(overrides), recipe="cpu_tiny_grpo"))  # trainer.device=cpu


@pytest.mark.parametrize("overrides, tolerance", [
    ((), 1e-3),  # float32 trainer and engine on CPU
    (("actor_rollout_ref.actor.megatron.dtype=bfloat16",), 0.2),
    (("actor_rollout_ref.rollout.dtype=bfloat16",), 0.2),
    (("trainer.device=auto",), 0.2),  # the workers may land on GPUs, in bf16
    (("trainer.device=auto", "actor_rollout_ref.actor.megatron.dtype=float32",
      "actor_rollout_ref.rollout.dtype=float32"), 1e-3),
    (("trainer.mismatch_tolerance=0.05", "actor_rollout_ref.actor.megatron.dtype=bfloat16"), 0.05),
    # raw log-probs at temperature 1 are the trainer's whatever top-k / top-p keep
    (("actor_rollout_ref.rollout.logprobs_mode=raw_logprobs", "actor_rollout_ref.rollout.top_k=20"), 1e-3),
    (("actor_rollout_ref.rollout.temperature=0.7",), 1e-3),  # processed: both at softmax(logits / 0.7)
])
def test_the_plan_sets_the_tolerance_by_precision(overrides, tolerance):
    plan = plan_of(*overrides)
    assert plan.mismatch_tolerance == tolerance
    assert not [w for w in plan.warnings if "on_mismatch" in w]


@pytest.mark.parametrize("overrides, why", [
    (("actor_rollout_ref.rollout.top_k=20",), "rollout.top_k=20: the engine renormalises"),
    (("actor_rollout_ref.rollout.top_p=0.9",), "rollout.top_p=0.9: the engine renormalises"),
    (("actor_rollout_ref.rollout.logprobs_mode=raw_logprobs", "actor_rollout_ref.rollout.temperature=0.7"),
     "raw_logprobs reports log softmax(logits), the trainer log softmax(logits / 0.7)"),
    (("actor_rollout_ref.rollout.do_sample=False", "actor_rollout_ref.rollout.temperature=0.7"),
     "a greedy rollout (rollout.do_sample=False) reports log softmax(logits)"),
])
def test_incomparable_log_probs_turn_the_alarm_off_with_one_note(overrides, why):
    plan = plan_of(*overrides)
    notes = [w for w in plan.warnings if "on_mismatch" in w]
    assert plan.mismatch_tolerance is None and len(notes) == 1 and why in notes[0]


def test_ignore_turns_it_off_without_a_note():
    plan = plan_of("trainer.on_mismatch=ignore", "actor_rollout_ref.rollout.top_k=20")
    assert plan.mismatch_tolerance is None and not [w for w in plan.warnings if "on_mismatch" in w]


@pytest.mark.parametrize("override, problem", [
    ("trainer.on_mismatch=loud", "trainer.on_mismatch: must be one of stop, warn, ignore, got 'loud'"),
    ("trainer.on_mismatch=off", "got 'False' (YAML reads off as False; write ignore)"),
    ("trainer.mismatch_tolerance=0", "trainer.mismatch_tolerance: must be > 0"),
])
def test_bad_values_stop_at_load_time(override, problem):
    with pytest.raises(ConfigError) as refused:
        plan_of(override)
    assert problem in str(refused.value)
