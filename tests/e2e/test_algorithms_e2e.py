"""Two real RL steps per algorithm on CPU (tiny Llama, real GSM8K prompts, Ray + Megatron + vLLM).

Step-1 invariants (slime's CI checks): before any update the recomputed policy log-probs equal the
reference's exactly and the KL is exactly 0; the engine's sampled-token log-probs agree with the
trainer's recomputation. After one update the policy has moved (KL > 0, non-zero gradient).
"""

import json

import pytest
from e2e_checks import non_finite, with_extended

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600), pytest.mark.usefixtures("ray_session")]

# One mini-batch per step (ppo_mini_batch_size = train_batch_size) so the step-1 KL is measured
# before any optimizer step.
ONE_MINI_BATCH = ["actor_rollout_ref.actor.ppo_mini_batch_size=4"]

CASES = {
    # sampled at T = 0.7: every log-prob (old, reference, update) is that of softmax(logits / 0.7)
    "grpo": ["algorithm.adv_estimator=grpo", "actor_rollout_ref.actor.use_kl_loss=True",
             "actor_rollout_ref.actor.kl_loss_type=low_var_kl", "actor_rollout_ref.rollout.temperature=0.7"],
    # + verl's rollout correction, decoupled (the KL in the reward runs the old-log-prob pass anyway): token IS
    # weights, batch-normalised, and token rejection (verl's token_is_rs)
    "remax": ["algorithm.adv_estimator=remax", "algorithm.use_kl_in_reward=True", "algorithm.kl_penalty=kl",
              "actor_rollout_ref.rollout.n=1", "actor_rollout_ref.actor.policy_loss.loss_mode=reinforce",
              *(f"algorithm.rollout_correction.{key}" for key in (
                  "rollout_is=token", "rollout_is_threshold=2.0", "rollout_is_batch_normalize=True",
                  "rollout_rs=token_k1", "rollout_rs_threshold=0.5_2.0"))],
    # with a bf16 actor on CPU: the reference follows it, and the bf16 weights reach the fp32 engine
    "gpg": ["algorithm.adv_estimator=gpg", "actor_rollout_ref.actor.policy_loss.loss_mode=gpg",
            "actor_rollout_ref.actor.use_kl_loss=True", "actor_rollout_ref.actor.megatron.dtype=bfloat16"],
    "rloo": ["algorithm.adv_estimator=rloo", "algorithm.use_kl_in_reward=True", "algorithm.kl_ctrl.type=adaptive"],
    # the critic on its own schedule (verl's critic.ppo_mini_batch_size / ppo_epochs): 2 epochs × 2 mini-batches;
    # use_dynamic_bsz=False: micro-batches of ppo_micro_batch_size_per_gpu sequences, 4 responses by 3 → 2
    # + verl's rollout correction in bypass mode (old_log_probs are the engine's; PPO's ratio is π_θ/π_rollout) with
    # sequence rejection (verl's bypass_ppo_clip_k3_rs preset)
    "ppo": ["algorithm.adv_estimator=gae", "actor_rollout_ref.actor.use_kl_loss=True", "critic.optim.lr=1e-4",
            "actor_rollout_ref.rollout.n=1", "critic.ppo_mini_batch_size=2", "critic.ppo_epochs=2",
            "critic.shuffle=True", "actor_rollout_ref.actor.use_dynamic_bsz=False",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3",
            *(f"algorithm.rollout_correction.{key}" for key in (
                "bypass_mode=True", "loss_type=ppo_clip", "rollout_rs=seq_mean_k3", "rollout_rs_threshold=0.01"))],
}
# test_two_steps' layouts: GRPO's policy and reference under context parallelism (two processes, each sequence split
# over them, their outputs summed), synced into two engines
LAYOUTS = {"grpo": ["trainer.n_gpus_per_node=2", "actor_rollout_ref.actor.megatron.context_parallel_size=2",
                    "actor_rollout_ref.ref.megatron.context_parallel_size=2"]}
# Rollout correction in bypass mode: no trainer log-probs of the policy before the update (old_log_probs are the
# engine's); the actor compares the policy it trains with the engine (rollout_corr/kl, ...) instead.
BYPASS = {"ppo"}
# verl's rollout_corr/* names the decoupled correction logs (IS weights, rejection, off-policy diagnostics)
DECOUPLED_NAMES = {f"rollout_corr/{name}" for name in (
    "rollout_is_mean", "rollout_is_max", "rollout_is_min", "rollout_is_std", "rollout_is_eff_sample_size",
    "rollout_is_ratio_fraction_high", "rollout_is_seq_mean", "rollout_is_batch_norm_factor",
    "rollout_rs_token_k1_mean", "rollout_rs_token_k1_masked_fraction", "rollout_rs_masked_fraction",
    "rollout_rs_seq_masked_fraction", "kl", "k3_kl", "training_ppl", "rollout_ppl", "log_ppl_diff", "ppl_ratio",
    "chi2_token", "chi2_seq")}
# `make test-extended`: RLOO's step is GRPO's with another advantage function (checked against verl's in
# tests/algorithms/test_verl_reference.py); its KL in the reward under the adaptive controller trains in
# tests/e2e/test_reliability_e2e.py's resume test, which compares the controller's coefficient after a resume.
EXTENDED = {"rloo"}
# |engine - trainer| log-probs of the sampled tokens; the bf16 actor's (gpg) against the engine's fp32 computation
# from its bf16-rounded weights
ROLLOUT_TOLERANCE = {"gpg": 0.1}


def verl_trainer_keys(tmp_path):
    """verl's data / trainer / checkpoint keys, on the run with a critic (each one's unit test is in tests/data or
    tests/trainer; here the real workers save, export and dump)."""
    contents = "[model,optimizer,extra,hf_model]"
    return ["trainer.save_freq=1", "trainer.max_actor_ckpt_to_keep=2", "trainer.max_critic_ckpt_to_keep=1",
            f"actor_rollout_ref.actor.checkpoint.save_contents={contents}",
            f"critic.checkpoint.save_contents={contents}",
            f"trainer.rollout_data_dir={tmp_path / 'rollouts'}", f"trainer.validation_data_dir={tmp_path / 'val'}",
            "trainer.log_val_generations=2", "data.train_max_samples=8", "data.reward_fn_key=ability",
            "+data.apply_chat_template_kwargs.enable_thinking=false"]


def check_verl_trainer_keys(tmp_path):
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    run_dir = tmp_path / "run"
    # max_critic_ckpt_to_keep=1 took the critic from step 1, which keeps its actor (max_actor_ckpt_to_keep=2)
    assert (run_dir / "global_step_1" / "actor").is_dir() and not (run_dir / "global_step_1" / "critic").exists()
    assert json.loads((run_dir / "global_step_1" / "PRUNED").read_text()) == ["critic"]
    export = run_dir / "global_step_2"
    actor = AutoModelForCausalLM.from_pretrained(export / "actor" / "huggingface")
    critic = AutoModelForTokenClassification.from_pretrained(export / "critic" / "huggingface")
    assert critic.config.num_labels == 1 and actor.config.vocab_size == critic.config.vocab_size
    assert sorted(p.name for p in (tmp_path / "rollouts").iterdir()) == ["1.jsonl", "2.jsonl"]
    rollout = [json.loads(line) for line in (tmp_path / "rollouts" / "2.jsonl").read_text().splitlines()]
    assert len(rollout) == 4 and list(rollout[0])[:5] == ["input", "output", "gts", "score", "step"]
    assert sorted(p.name for p in (tmp_path / "val").iterdir()) == ["0.jsonl", "2.jsonl"]
    logged = [json.loads(line) for line in (run_dir / "val_generations.jsonl").read_text().splitlines()]
    assert [line["step"] for line in logged] == [0, 0, 2, 2]


@pytest.mark.parametrize("name", with_extended(CASES, EXTENDED))
def test_two_steps(train, tmp_path, name):
    _, steps = train(*ONE_MINI_BATCH, *CASES[name], *LAYOUTS.get(name, []),
                     *(verl_trainer_keys(tmp_path) if name == "ppo" else []))
    first, second = steps[1], steps[2]
    # step-1 invariants (bypass mode: "old" is the engine's, a rounding away from the reference)
    if name not in BYPASS:
        assert first["actor/ref_log_prob_max_abs_diff"] == 0.0
        assert first["actor/ref_kl_k1"] == 0.0
    if "actor/kl_loss" in first:
        assert first["actor/kl_loss"] == 0.0
    if "actor/reward_kl_penalty" in first:
        assert first["actor/reward_kl_penalty"] == 0.0
    tolerance = ROLLOUT_TOLERANCE.get(name, 1e-3)
    assert first["actor/ref_log_prob_max_abs_diff"] < tolerance
    if name not in BYPASS:
        assert first["rollout/log_prob_max_abs_diff"] < tolerance
    # the update did something, and the engine serves the updated weights
    assert first["actor/grad_norm"] > 0
    assert second["actor/ref_log_prob_max_abs_diff"] > 0
    if name not in BYPASS:
        assert second["rollout/log_prob_max_abs_diff"] < tolerance
    for step in (first, second):
        assert not non_finite(step), non_finite(step)
        assert step["dynamic_batch/num_oversized"] == 0
        # the update's memory: the worker's peak, in GiB, within the machine's used memory
        assert 0.1 < step["perf/max_rss_gb"] < step["perf/cpu_memory_used_gb"]
    assert "val/score" in second and "val/score" in steps[0]
    if name == "ppo":
        assert first["critic/grad_norm"] > 0 and "critic/vf_loss" in second
        assert first["critic/optimizer_steps"] == 4 and first["actor/optimizer_steps"] == 1
        assert first["dynamic_batch/num_micro_batches"] == 2 and first["dynamic_batch/samples_max"] == 2
        assert "dynamic_batch/budget_utilisation_min" not in first  # no token budget
        check_verl_trainer_keys(tmp_path)
    if name == "remax":
        assert "greedy_score/mean" in first
        for step in (first, second):
            assert DECOUPLED_NAMES <= set(step), DECOUPLED_NAMES - set(step)
            # fp32 trainer and engine serving the same weights: every IS weight is 1, nothing is rejected
            assert abs(step["rollout_corr/rollout_is_max"] - 1) < 1e-5
            assert abs(step["rollout_corr/rollout_is_min"] - 1) < 1e-5
            assert step["rollout_corr/rollout_rs_masked_fraction"] == 0.0
    if name in BYPASS:
        for step in (first, second):
            # the actor's comparison of π_θ before its step with the engine's policy (verl's bypass-mode metrics)
            assert abs(step["rollout_corr/kl"]) < 1e-5 and step["rollout_corr/k3_kl"] < 1e-5
            assert step["rollout_corr/rollout_rs_masked_fraction"] == 0.0
            assert not {key for key in step if key.startswith("rollout/log_prob")}


@pytest.mark.extended  # the same claim on one worker, without the driver: tests/workers/test_worker_inprocess.py
def test_on_policy_step_skips_the_old_log_prob_pass(train, tmp_path):
    """One optimizer step per RL step: the step without the old-log-prob pass has the loss, gradient norm
    and diagnostics of the step with it (same weights, same samples; fp32 rounding apart)."""
    common = [*ONE_MINI_BATCH, *CASES["grpo"], "trainer.total_training_steps=1", "trainer.val_before_train=False",
              "trainer.test_freq=-1"]
    _, skipped = train(*common, run_dir=tmp_path / "skipped")
    _, recomputed = train(*common, "actor_rollout_ref.actor.skip_on_policy_old_log_prob=False",
                          run_dir=tmp_path / "recomputed")
    skip, full = skipped[1], recomputed[1]
    assert "timing/old_log_prob_s" not in skip and full["timing/old_log_prob_s"] > 0
    assert skip["score/mean"] == full["score/mean"] and skip["response_length/mean"] == full["response_length/mean"]
    compared = sorted(k for k in full if k.startswith("actor/") and k != "actor/lr")
    assert {"actor/pg_loss", "actor/loss", "actor/grad_norm", "actor/kl_loss"} <= set(compared) <= set(skip)
    for key in compared:
        assert skip[key] == pytest.approx(full[key], rel=1e-5, abs=1e-7), key
    # the update's forward pass is the policy before the step: the step-1 invariants hold on it too
    assert skip["actor/ref_log_prob_max_abs_diff"] == 0.0
    assert skip["rollout/log_prob_max_abs_diff"] == pytest.approx(full["rollout/log_prob_max_abs_diff"], abs=1e-6)


def test_a_kept_worker_trains_as_a_fresh_one_without_importing_its_libraries_again(train, tmp_path):
    """``meshrl.workers.pool.keep_workers``: a run of the shape of one that ended takes its released policy worker
    (no new process: nothing to import again); its step is the fresh worker's to the last bit (the release left
    nothing behind: weights, optimizer, engine, RNG, process groups). A failed run's workers are not kept."""
    from meshrl.workers.pool import keep_workers

    common = [*ONE_MINI_BATCH, *CASES["grpo"], "trainer.total_training_steps=1", "trainer.val_before_train=False",
              "trainer.test_freq=-1"]
    with keep_workers(max_idle=1) as pool:  # empty: the first run starts its own processes
        _, fresh = train(*common, run_dir=tmp_path / "fresh")
        assert pool.idle_processes() == 1 and pool.taken == 0
        _, kept = train(*common, run_dir=tmp_path / "kept")
        assert pool.taken == 1 and pool.idle_processes() == 1
        # a run that fails once its workers are up (every reward call raises) kills the workers it took
        failing = tmp_path / "failing_reward.py"
        failing.write_text("def compute_score(*args, **kwargs):\n    raise ValueError('no score')\n")
        with pytest.raises(Exception, match="no score"):
            train(*common, f"custom_reward_function.path={failing}", "reward_model.max_failed_batches=1",
                  run_dir=tmp_path / "failed")
        assert pool.taken == 2 and pool.idle_processes() == 0
    compared = sorted(k for k in fresh[1] if not k.startswith(("timing/", "perf/", "startup/", "time/"))
                      and not k.endswith(("seconds", "_s")))
    assert {"actor/pg_loss", "actor/grad_norm", "score/mean", "rollout/log_prob_max_abs_diff"} <= set(compared)
    assert [k for k in compared if kept[1][k] != fresh[1][k]] == []
    # the kept process had imported torch, Megatron and vLLM already (the time saved: bench-free, docs/features.md)
    assert kept[1]["startup/actor_rollout_ref/imports_s"] < 0.5 < fresh[1]["startup/actor_rollout_ref/imports_s"]
