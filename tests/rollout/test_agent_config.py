"""verl's multi-turn config as verl writes it: its example config file, its keys, and what is refused."""

import pytest

from meshrl.config import ConfigError, load_config
from meshrl.config.validate import validate_config
from meshrl.rollout.engines import unsupported_rollout_features

# verl's examples/sglang_multiturn/config/gsm8k_multiturn_megatron_grpo.yaml
VERL_EXAMPLE = """\
hydra:
  searchpath:
    - file://verl/trainer/config

defaults:
  - ppo_megatron_trainer
  - _self_

data:
  max_prompt_length: 1024
  max_response_length: 1024
  train_batch_size: 256
  return_raw_chat: True

actor_rollout_ref:
  hybrid_engine: True
  rollout:
    name: sglang
    multi_turn:
      enable: True
      max_assistant_turns: 5
"""
TOOLS = """\
tools:
  - class_name: "verl.tools.gsm8k_tool.Gsm8kTool"
    config: {type: native}
    tool_schema: {type: function, function: {name: calc_gsm8k_reward, parameters: {type: object}}}
"""


def test_verls_multi_turn_example_config_loads_with_paths_and_sizes_swapped(tmp_path):
    (tmp_path / "gsm8k_multiturn_megatron_grpo.yaml").write_text(VERL_EXAMPLE)
    (tmp_path / "tools.yaml").write_text(TOOLS)
    cfg = load_config(["actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.model.path=tiny:llama",
                       "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
                       "actor_rollout_ref.rollout.n=2", "trainer.device=cpu", "trainer.n_gpus_per_node=1",
                       f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tmp_path / 'tools.yaml'}"],
                      recipe=tmp_path / "gsm8k_multiturn_megatron_grpo.yaml")
    validate_config(cfg)
    multi_turn = cfg.actor_rollout_ref.rollout.multi_turn
    assert multi_turn.enable and multi_turn.max_assistant_turns == 5 and cfg.data.max_response_length == 1024
    assert unsupported_rollout_features(cfg.actor_rollout_ref.rollout) == []


def test_self_places_the_files_own_values_among_its_defaults(tmp_path):
    (tmp_path / "base.yaml").write_text("data:\n  train_batch_size: 8\n")
    (tmp_path / "first.yaml").write_text("defaults: [_self_, base]\ndata:\n  train_batch_size: 3\n")
    (tmp_path / "last.yaml").write_text("defaults: [base]\ndata:\n  train_batch_size: 3\n")
    assert load_config(recipe=tmp_path / "first.yaml").data.train_batch_size == 8
    assert load_config(recipe=tmp_path / "last.yaml").data.train_batch_size == 3


def test_a_search_path_outside_verls_config_folder_is_refused(tmp_path):
    (tmp_path / "c.yaml").write_text(VERL_EXAMPLE.replace("file://verl/trainer/config", "pkg://my_engine.config"))
    with pytest.raises(ConfigError, match="searchpath to verl's own config folder"):
        load_config(recipe=tmp_path / "c.yaml")


@pytest.mark.parametrize("override,key", [
    ("actor_rollout_ref.rollout.tensor_model_parallel_size=2", "actor_rollout_ref.rollout.tensor_model_parallel_size"),
    ("+data.apply_chat_template_kwargs.enable_thinking=false", "data.apply_chat_template_kwargs"),
])
def test_what_multi_turn_cannot_run_with_is_refused_at_load_time(override, key):
    cfg = load_config(["actor_rollout_ref.rollout.multi_turn.enable=True", "trainer.n_gpus_per_node=2", override],
                      recipe="cpu_tiny_grpo")
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        validate_config(cfg)


def test_a_tool_file_without_multi_turn_is_refused(tmp_path):
    """Single-turn rollouts call no tool: a tool file there would be silently unused (verl ignores it)."""
    (tmp_path / "tools.yaml").write_text(TOOLS)
    key = "actor_rollout_ref.rollout.multi_turn.tool_config_path"
    cfg = load_config([f"{key}={tmp_path / 'tools.yaml'}"], recipe="cpu_tiny_grpo")
    with pytest.raises(ConfigError, match=r"multi_turn\.tool_config_path.*multi_turn\.enable=True"):
        validate_config(cfg)
