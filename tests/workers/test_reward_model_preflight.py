"""A reward model that cannot score stops at preflight, naming the key, before Ray or any worker starts."""

import pytest

from meshrl.config import ConfigError, load_config
from meshrl.trainer.main import preflight
from meshrl.config.run_plan import build_run_plan
from meshrl.workers.reward_model_checks import reward_model_problems as problems_in_plan_layout


def cfg_with(*overrides):
    return load_config(["reward_model.enable=True", *overrides], recipe="cpu_tiny_grpo")


def reward_model_problems(cfg):
    """The reward model's problems in the layout its run plan gives it."""
    return problems_in_plan_layout(cfg, build_run_plan(cfg).reward_model_layout)


def test_a_tiny_reward_model_passes():
    assert reward_model_problems(cfg_with("reward_model.model.path=tiny-rm:llama")) == []


def test_problems_name_what_to_fix():
    (missing,) = reward_model_problems(cfg_with())
    assert missing.startswith("reward_model.model.path") and "ForSequenceClassification" in missing
    (causal_lm,) = reward_model_problems(cfg_with("reward_model.model.path=tiny:llama"))
    assert "no score.weight" in causal_lm and "not a reward model" in causal_lm
    layout = reward_model_problems(cfg_with("reward_model.model.path=tiny-rm:llama",
                                            "reward_model.megatron.tensor_model_parallel_size=3"))
    assert layout[0] == ("reward_model.megatron.tensor_model_parallel_size: TP=3 does not divide "
                         "num_attention_heads=4 (the reward model's)")
    assert len(layout) == 3  # and its KV heads and its MLP's width: every constraint at once


def test_preflight_refuses_before_ray():
    with pytest.raises(ConfigError, match="no score.weight") as info:
        preflight(cfg_with("reward_model.model.path=tiny:llama"))
    assert info.value.keys == ("reward_model.model.path",)
