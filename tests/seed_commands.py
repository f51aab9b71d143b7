"""The seed's ReMax example commands (shared/seeds/001, "实战示例"), in one place for every test that uses them.

``tests/foundation/test_config.py`` parses and validates them; ``tests/e2e/test_seed_commands.py`` runs
them for one step on CPU. Both import from here (``tests/`` is on ``sys.path`` through its conftest).
"""

import shlex

# The five example commands, verbatim after the module name (``$HOME`` stays literal: shlex does not expand it).
SEED_COMMANDS = [
    """algorithm.adv_estimator=remax data.train_files=$HOME/data/gsm8k/train.parquet
    data.val_files=$HOME/data/gsm8k/test.parquet data.train_batch_size=1024
    actor_rollout_ref.model.path=Qwen/Qwen2.5-7B-Instruct actor_rollout_ref.actor.use_dynamic_bsz=True
    actor_rollout_ref.actor.ppo_max_token_len_per_gpu=24000 actor_rollout_ref.rollout.n=4 trainer.total_epochs=10""",
    """algorithm.adv_estimator=remax algorithm.use_kl_in_reward=False data.train_files=$HOME/data/gsm8k/train.parquet
    actor_rollout_ref.model.path=Qwen/Qwen2.5-7B-Instruct actor_rollout_ref.actor.use_dynamic_bsz=True
    actor_rollout_ref.actor.use_kl_loss=False actor_rollout_ref.rollout.n=4 trainer.total_epochs=10""",
    """algorithm.adv_estimator=remax data.train_batch_size=512 actor_rollout_ref.model.path=Qwen/Qwen2.5-14B-Instruct
    actor_rollout_ref.actor.optim.lr=5e-7 actor_rollout_ref.actor.ppo_max_token_len_per_gpu=16000
    actor_rollout_ref.rollout.tensor_model_parallel_size=4 actor_rollout_ref.rollout.n=4 trainer.n_gpus_per_node=8""",
    """algorithm.adv_estimator=remax data.max_prompt_length=1024 data.max_response_length=2048
    data.train_batch_size=512 actor_rollout_ref.actor.use_dynamic_bsz=True
    actor_rollout_ref.actor.ppo_max_token_len_per_gpu=12000 actor_rollout_ref.rollout.n=4 trainer.total_epochs=15""",
    """algorithm.adv_estimator=remax data.train_batch_size=2048 actor_rollout_ref.actor.ppo_max_token_len_per_gpu=20000
    actor_rollout_ref.rollout.tensor_model_parallel_size=2 trainer.n_gpus_per_node=8 trainer.nnodes=4
    trainer.total_epochs=10""",
]

# Example 1 with the other algorithms of issue 5: only the estimator changes, plus what that algorithm
# needs to be itself — GRPO's k3 KL loss to the reference (as verl's GRPO examples run it), GPG's own
# policy loss, PPO's critic (``gae`` builds it from the policy's model).
ALGORITHM_SWAPS = {
    "grpo": "algorithm.adv_estimator=grpo actor_rollout_ref.actor.use_kl_loss=True "
            "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
    "gpg": "algorithm.adv_estimator=gpg actor_rollout_ref.actor.policy_loss.loss_mode=gpg",
    "ppo": "algorithm.adv_estimator=gae",
}


def example_1_as(algorithm: str) -> str:
    """Seed example 1 with ``algorithm.adv_estimator=remax`` replaced by ``ALGORITHM_SWAPS[algorithm]``."""
    words = shlex.split(SEED_COMMANDS[0])
    assert words[0] == "algorithm.adv_estimator=remax", words[0]
    return " ".join([ALGORITHM_SWAPS[algorithm], *words[1:]])


def overrides(command: str) -> dict[str, str]:
    """``key=value`` words of a command → {key: value}, in order."""
    return dict(word.split("=", 1) for word in shlex.split(command))
