"""Issue 5: the seed's five ReMax example commands, and GRPO / GPG / PPO versions of example 1, each run for
one real training step on CPU (Ray driver, Megatron policy, colocated vLLM engine — in process, like the
other end-to-end tests, which is ``python -m meshrl.trainer.main <overrides>`` minus argparse).

Every key of a command is kept as the seed writes it, starting from the schema's defaults (no recipe, as
the command line has none). Only these values change:
- the paths and GPU counts (``PATH_AND_GPU_SWAPS``, the model via ``tiny_model_for``);
- what CPU scale needs (``CPU_SCALE``): one step, 2 prompts, 8-token responses, 2 validation prompts,
  a small KV cache;
- the reward: the ``train`` fixture's reward with spread, because the rule-based GSM8K reward is 0 for
  every response of a random model, which leaves every advantage and gradient at zero.
The checks read each expectation from the command (or the resolved config), never from a constant.
"""

import pytest
import ray
from e2e_checks import non_finite, with_extended
from omegaconf import OmegaConf
from seed_commands import ALGORITHM_SWAPS, SEED_COMMANDS, example_1_as, overrides

from meshrl.config import load_config

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600), pytest.mark.usefixtures("ray_session")]

PATH_AND_GPU_SWAPS = {
    "data.train_files": "embedded:gsm8k/train",
    # Commands without it validate on the default ~/data/gsm8k/test.parquet, as in verl: swapped too.
    "data.val_files": "embedded:gsm8k/test",
    "trainer.device": "cpu",
    "trainer.n_gpus_per_node": "1",
    "trainer.nnodes": "1",
    "actor_rollout_ref.rollout.tensor_model_parallel_size": "1",
}
CPU_SCALE = {
    "trainer.total_training_steps": "1",  # wins over the command's total_epochs
    "data.train_batch_size": "2",
    # The default (256 prompts) exceeds the batch; equal to it gives one mini-batch, one optimizer step.
    "actor_rollout_ref.actor.ppo_mini_batch_size": "2",
    "data.max_response_length": "8",  # data.max_prompt_length stays (512 by default, 1024 in example 4)
    "data.val_max_samples": "2",  # validation runs before training (val_before_train), on 2 prompts
    "data.train_max_samples": "16",  # only these are tokenized at load (all 7,473 take ~2 s)
    "actor_rollout_ref.rollout.kv_cache_memory_bytes": "268435456",  # as the CPU recipes (default: 1 GiB)
}
LR_KEY = "actor_rollout_ref.actor.optim.lr"
TOKEN_BUDGET_KEY = "actor_rollout_ref.actor.ppo_max_token_len_per_gpu"

COMMANDS = {f"seed_example_{i + 1}": command for i, command in enumerate(SEED_COMMANDS)}
COMMANDS.update({f"example_1_{name}": example_1_as(name) for name in ALGORITHM_SWAPS})
# `make test-extended` (see the Makefile): at CPU scale every example is example 1's ReMax path with other sizes
# (its sizes, parallel layouts and lengths are swapped for CPU ones; that every key reaches the config as written
# is tests/foundation/test_config.py's check of all five): example 2 is example 1 validated on the default test
# file; 3 is example 1 at its own lr (its rollout TP4 is swapped for 1); 4 and 5 are example 1 with other token
# budgets. Example 1's GRPO / GPG / PPO runs train as test_algorithms_e2e's do.
EXTENDED = {"seed_example_2", "seed_example_3", "seed_example_4", "seed_example_5",
            *(f"example_1_{name}" for name in ALGORITHM_SWAPS)}


def tiny_model_for(seed_path: str | None) -> str:
    """Same architecture, tiny: Qwen2.5 checkpoints → tiny Qwen2 (QKV bias, untied embeddings); the
    default model (the embedded SmolLM2, a Llama) → tiny Llama."""
    return "tiny:qwen2" if seed_path and "qwen" in seed_path.lower() else "tiny:llama"


def cpu_command(command: str) -> tuple[dict[str, str], dict[str, str], list[str]]:
    """(the command's overrides, the swaps applied, the CPU overrides): swapped keys replaced in place, the
    others appended."""
    seed = overrides(command)
    swaps = {**PATH_AND_GPU_SWAPS, **CPU_SCALE,
             "actor_rollout_ref.model.path": tiny_model_for(seed.get("actor_rollout_ref.model.path"))}
    words = [f"{key}={swaps.get(key, value)}" for key, value in seed.items()]
    words += [f"{key}={value}" for key, value in swaps.items() if key not in seed]
    return seed, swaps, words


@pytest.mark.parametrize("name", with_extended(COMMANDS, EXTENDED))
def test_seed_command_runs_one_step_on_cpu(train, name):
    seed, swaps, words = cpu_command(COMMANDS[name])
    cfg = load_config(words)
    # Every key of the command that is not a swap reaches the config unchanged.
    for key, value in seed.items():
        if key not in swaps:
            got = OmegaConf.select(cfg, key)
            assert str(got).lower() == value.lower() or float(got) == float(value), (key, got, value)

    _, steps = train(*words, recipe=None)
    assert ray.is_initialized(), "run() shut down a Ray session it did not start"
    # Validation before training (data.val_files honoured), then exactly one training step.
    assert sorted(steps) == [0, 1], sorted(steps)
    assert "val/score" in steps[0]
    step = steps[1]
    assert not non_finite(steps[0]) and not non_finite(step), (non_finite(steps[0]), non_finite(step))

    actor, algo = cfg.actor_rollout_ref.actor, cfg.algorithm
    # The learning rate the optimizer used is the command's (constant schedule, no warm-up by default).
    assert step["actor/lr"] == pytest.approx(float(seed.get(LR_KEY, actor.optim.lr)), rel=1e-9)
    # Dynamic batching ran with the command's token budget: budget = tokens / utilisation of a micro-batch.
    assert step["dynamic_batch/num_oversized"] == 0
    budget = step["dynamic_batch/tokens_min"] / step["dynamic_batch/budget_utilisation_min"]
    assert budget == pytest.approx(float(seed.get(TOKEN_BUDGET_KEY, actor.ppo_max_token_len_per_gpu)), rel=1e-6)
    # rollout.n responses per prompt reached the update (one mini-batch = the whole batch).
    updated = step["dynamic_batch/samples_mean"] * step["dynamic_batch/num_micro_batches"]
    assert updated == cfg.data.train_batch_size * cfg.actor_rollout_ref.rollout.n
    # The update did something, and the engine's sampled-token log-probs match the trainer's.
    assert step["actor/grad_norm"] > 0
    assert step["rollout/log_prob_max_abs_diff"] < 1e-3

    # KL off (every seed command: use_kl_in_reward and use_kl_loss are False) → no reference model, no KL
    # metrics; on (GRPO's KL loss) → reference log-probs equal the policy's before the first update.
    uses_reference = algo.use_kl_in_reward or actor.use_kl_loss
    assert ("actor/ref_kl_k1" in step) == uses_reference and ("timing/ref_s" in step) == uses_reference
    assert ("actor/kl_loss" in step) == actor.use_kl_loss
    assert ("actor/reward_kl_penalty" in step) == algo.use_kl_in_reward
    if uses_reference:
        assert step["actor/ref_log_prob_max_abs_diff"] == 0.0 and step["actor/ref_kl_k1"] == 0.0
    if actor.use_kl_loss:
        assert step["actor/kl_loss"] == 0.0
    # The estimator named by the command ran: ReMax scores a greedy baseline, GPG reports its α, PPO
    # trains a critic; the clipped PPO loss reports clipfrac, GPG's plain policy gradient does not.
    assert ("greedy_score/mean" in step) == (algo.adv_estimator == "remax")
    assert ("algo/gpg_alpha" in step) == (algo.adv_estimator == "gpg")
    assert ("critic/vf_loss" in step) == (algo.adv_estimator == "gae")
    if algo.adv_estimator == "gae":
        assert step["critic/grad_norm"] > 0
    assert ("actor/clipfrac" in step) == (actor.policy_loss.loss_mode == "vanilla")
