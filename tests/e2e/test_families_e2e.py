"""One GRPO step per model family whose structure differs most from Llama, through the whole path: the HF
checkpoint converted to Megatron at TP2, a TP2 vLLM engine colocated on the same two ranks, the policy's weights
resharded into it, rollout, update. At step 1 the engine's log-probs must be the trainer's (the engine serves what
the trainer holds): ``rollout/log_prob_max_abs_diff`` < 1e-3 (the run's alarm also checks the mean)."""

import pytest
from e2e_checks import with_extended

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600), pytest.mark.usefixtures("ray_session")]

TP2 = ["trainer.n_gpus_per_node=2", "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
       "actor_rollout_ref.ref.megatron.tensor_model_parallel_size=2",
       "actor_rollout_ref.rollout.tensor_model_parallel_size=2", "trainer.total_training_steps=1",
       "trainer.test_freq=-1", "trainer.val_before_train=False", "actor_rollout_ref.actor.use_kl_loss=True"]


# `make test-extended`: Qwen3 and GLM-4. What the path does per family is checked apart in `make test`: the TP2
# model against HF and its export back (tests/parallel/test_parallel_multiproc.py, every family), and the resharded
# weights against vLLM's own model code (tests/models/test_family_vllm.py); vLLM shards the HF tensors it is sent
# by itself. Gemma 3 (the most unlike Llama: sliding windows, soft-capping, post norms) runs the whole path here.
EXTENDED = {"qwen3", "glm4"}


@pytest.mark.parametrize("family", with_extended(["qwen3", "gemma3", "glm4"], EXTENDED))  # q/k norms; post norms,
# soft-capping, sliding window; GLM-4: half-head interleaved RoPE, q/k/v biases, its own post norms, fused gate_up
def test_one_grpo_step_through_megatron_tp2_and_vllm_tp2(train, tmp_path, family):
    _, steps = train(f"actor_rollout_ref.model.path=tiny:{family}", *TP2, run_dir=tmp_path / family)
    step = steps[1]
    assert step["rollout/log_prob_max_abs_diff"] < 1e-3, step["rollout/log_prob_max_abs_diff"]
    assert step["actor/ref_log_prob_max_abs_diff"] < 1e-5  # the reference is the policy's exact copy at step 1
    assert step["actor/grad_norm"] > 0 and step["actor/optimizer_steps"] > 0
