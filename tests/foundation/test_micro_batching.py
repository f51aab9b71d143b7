"""Which micro-batches each phase uses, from verl's keys (``meshrl.config.micro_batching``)."""

import pytest

from meshrl.config import ConfigError, load_config
from meshrl.config.micro_batching import MicroBatching, data_parallel_size, micro_batching
from meshrl.config.validate import validate_config

A, R, C = "actor_rollout_ref.actor", "actor_rollout_ref.rollout", "critic"
FIXED = [f"{A}.use_dynamic_bsz=False", f"{A}.ppo_micro_batch_size_per_gpu=4"]


def rule(phase, *overrides, dp=1):
    return micro_batching(load_config(list(overrides)), phase, dp)


def test_dynamic_by_default_with_each_phases_budget():
    assert rule("actor_update") == MicroBatching(max_token_len=16384)
    assert rule("actor_log_prob", f"{R}.log_prob_max_token_len_per_gpu=9000") == MicroBatching(max_token_len=9000)
    assert rule("ref_log_prob") == MicroBatching(max_token_len=16384)  # the actor's budget
    assert rule("critic_values", f"{C}.forward_max_token_len_per_gpu=5000") == MicroBatching(max_token_len=5000)
    assert rule("critic_update") == MicroBatching(max_token_len=32768)


def test_fixed_sizes_and_their_fallbacks():
    assert rule("actor_update", *FIXED) == MicroBatching(micro_batch_size=4)
    # forward-only passes and the critic fall back on the actor's size
    for phase in ("actor_log_prob", "ref_log_prob", "critic_update", "critic_values"):
        assert rule(phase, *FIXED) == MicroBatching(micro_batch_size=4), phase
    assert rule("actor_log_prob", *FIXED, f"{R}.log_prob_micro_batch_size_per_gpu=16").micro_batch_size == 16
    assert rule("critic_values", *FIXED, f"{C}.ppo_micro_batch_size_per_gpu=2").micro_batch_size == 2
    assert rule("critic_values", *FIXED, f"{C}.forward_micro_batch_size_per_gpu=8").micro_batch_size == 8
    # a phase may differ from the actor's choice
    assert rule("actor_log_prob", *FIXED, f"{R}.log_prob_use_dynamic_bsz=True").dynamic
    assert rule("critic_update", *FIXED, f"{C}.use_dynamic_bsz=True").dynamic


def test_global_size_is_divided_over_data_parallel_ranks():
    """verl's deprecated ppo_micro_batch_size is the micro-batch over all DP ranks."""
    assert rule("actor_update", f"{A}.use_dynamic_bsz=False", f"{A}.ppo_micro_batch_size=16",
                dp=4).micro_batch_size == 4
    with pytest.raises(ValueError, match="both set"):
        rule("actor_update", *FIXED, f"{A}.ppo_micro_batch_size=16")
    with pytest.raises(ValueError, match="less than one sequence per data-parallel rank"):
        rule("actor_update", f"{A}.use_dynamic_bsz=False", f"{A}.ppo_micro_batch_size=2", dp=4)
    cfg = load_config(["trainer.n_gpus_per_node=8", f"{A}.megatron.tensor_model_parallel_size=2"])
    assert data_parallel_size(cfg) == 4 and data_parallel_size(cfg, "critic") == 8


@pytest.mark.parametrize("overrides, message", [
    ([f"{A}.use_dynamic_bsz=False"], f"{A}.ppo_micro_batch_size_per_gpu"),
    ([f"{R}.log_prob_use_dynamic_bsz=False"], f"{R}.log_prob_micro_batch_size_per_gpu"),
    (["algorithm.adv_estimator=gae", f"{C}.use_dynamic_bsz=False"], "critic.ppo_micro_batch_size_per_gpu"),
    ([*FIXED, f"{A}.ppo_micro_batch_size=8"], "both set"),
])
def test_validation_names_the_missing_key(overrides, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        validate_config(load_config(overrides))
