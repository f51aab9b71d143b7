"""verl's interaction config (``interaction_config_path``) read as verl writes it, verl's GSM8K-with-interaction
example through meshrl's config, and what is refused, at config time."""

import json

import pytest

from test_agent_config import VERL_EXAMPLE as TOOL_EXAMPLE

from meshrl.config import ConfigError, load_config
from meshrl.config.validate import validate_config
from meshrl.rollout.engines import unsupported_rollout_features
from meshrl.rollout.interactions.base import Interaction, InteractionConfigError
from meshrl.rollout.interactions.config import load_interactions
from meshrl.rollout.interactions.gsm8k import Gsm8kInteraction

# verl's examples/sglang_multiturn/config/interaction_config/gsm8k_interaction_config.yaml
VERL_INTERACTIONS = """\
interaction:
  - name: "gsm8k"
    class_name: "verl.interactions.gsm8k_interaction.Gsm8kInteraction"
    config: {}
"""
# verl's examples/sglang_multiturn/config/gsm8k_multiturn_grpo_w_interaction.yaml: its Megatron tool example's file
# on verl's FSDP defaults, with max_user_turns
VERL_EXAMPLE = TOOL_EXAMPLE.replace("ppo_megatron_trainer", "ppo_trainer").replace("max_assistant_turns",
                                                                                   "max_user_turns")
# The trainer arguments of verl's examples/sglang_multiturn/run_qwen2.5-0.5b_gsm8k_multiturn_w_interaction.sh with
# its defaults (TRAIN_BATCH_SIZE=512, MICRO_BATCH_SIZE=8, OFFLOAD=False, PROJECT_DIR=/verl)
VERL_SCRIPT = """
algorithm.adv_estimator=grpo data.train_batch_size=512 data.max_prompt_length=1024 data.max_response_length=3072
data.filter_overlong_prompts=True data.truncation=error data.return_raw_chat=True
actor_rollout_ref.model.path=Qwen/Qwen2.5-0.5B-Instruct actor_rollout_ref.model.use_remove_padding=True
actor_rollout_ref.model.enable_gradient_checkpointing=True actor_rollout_ref.model.enable_activation_offload=True
actor_rollout_ref.actor.optim.lr=1e-6 actor_rollout_ref.actor.ppo_mini_batch_size=512
actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8 actor_rollout_ref.actor.use_kl_loss=True
actor_rollout_ref.actor.kl_loss_coef=0.001 actor_rollout_ref.actor.kl_loss_type=low_var_kl
actor_rollout_ref.actor.entropy_coeff=0 actor_rollout_ref.actor.fsdp_config.param_offload=False
actor_rollout_ref.actor.fsdp_config.optimizer_offload=False actor_rollout_ref.actor.fsdp_config.model_dtype=bfloat16
actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8 actor_rollout_ref.rollout.tensor_model_parallel_size=2
actor_rollout_ref.rollout.name=sglang actor_rollout_ref.rollout.gpu_memory_utilization=0.7 actor_rollout_ref.rollout.n=8
actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8 actor_rollout_ref.ref.fsdp_config.param_offload=False
algorithm.use_kl_in_reward=False trainer.critic_warmup=0 trainer.logger=["console","wandb"]
trainer.project_name=gsm8k_async_rl trainer.experiment_name=qwen2.5-0.5b_function_rm-gsm8k-sgl-multi-w-interaction-n8
trainer.n_gpus_per_node=8 trainer.nnodes=1 trainer.save_freq=-1 trainer.test_freq=20
data.train_files=/home/user/data/gsm8k_verl_sgl_multi_turn_w_interaction/train.parquet
data.val_files=/home/user/data/gsm8k_verl_sgl_multi_turn_w_interaction/test.parquet
actor_rollout_ref.rollout.multi_turn.interaction_config_path=/verl/examples/sglang_multiturn/config/interaction_config/gsm8k_interaction_config.yaml
trainer.total_epochs=15
""".split()


def swapped(tmp_path):
    """Paths and sizes of a 2-process CPU run (verl's SGLang engine becomes vLLM, meshrl's)."""
    (tmp_path / "interactions.yaml").write_text(VERL_INTERACTIONS)
    return ["actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.model.path=tiny:llama",
            "data.train_files=embedded:gsm8k/train", "data.val_files=embedded:gsm8k/test", "data.train_batch_size=4",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.rollout.n=2",
            "actor_rollout_ref.rollout.tensor_model_parallel_size=1", "trainer.device=cpu",
            "trainer.n_gpus_per_node=2", "trainer.logger=[console]",
            f"actor_rollout_ref.rollout.multi_turn.interaction_config_path={tmp_path / 'interactions.yaml'}"]


def test_verls_gsm8k_interaction_example_runs_through_meshrls_config(tmp_path):
    (tmp_path / "gsm8k_multiturn_grpo_w_interaction.yaml").write_text(VERL_EXAMPLE)
    cfg = load_config(VERL_SCRIPT + swapped(tmp_path), recipe=tmp_path / "gsm8k_multiturn_grpo_w_interaction.yaml")
    validate_config(cfg)
    multi_turn = cfg.actor_rollout_ref.rollout.multi_turn
    assert multi_turn.enable and multi_turn.max_user_turns == 5 and cfg.data.max_response_length == 3072
    assert unsupported_rollout_features(cfg.actor_rollout_ref.rollout) == []  # the interaction file is built here


def test_verls_interaction_file_maps_verls_gsm8k_class_to_meshrls(tmp_path):
    path = tmp_path / "i.yaml"
    path.write_text(VERL_INTERACTIONS + "  - class_name: verl.interactions.base.BaseInteraction\n"
                    "    config: {timeout_s: 5}\n")
    interactions = load_interactions(path)
    assert list(interactions) == ["gsm8k", "base"]  # a name derived as verl derives it
    assert type(interactions["gsm8k"]) is Gsm8kInteraction and interactions["gsm8k"].name == "gsm8k"
    assert type(interactions["base"]) is Interaction and interactions["base"].timeout_s == 5


def test_a_users_interaction_by_dotted_path(tmp_path, monkeypatch):
    (tmp_path / "my_interactions.py").write_text(
        "from meshrl.rollout.interactions.base import Interaction\n"
        "class TutorInteraction(Interaction):\n"
        "    CONFIG_KEYS = frozenset({'hint'})\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    path = tmp_path / "i.yaml"
    path.write_text(json.dumps({"interaction": [{"class_name": "my_interactions.TutorInteraction",
                                                 "config": {"hint": "think"}}]}))
    (tutor,) = load_interactions(path).values()
    assert tutor.name == "tutor" and tutor.config == {"hint": "think", "name": "tutor"}


@pytest.mark.parametrize("entries,match", [
    ([{"class_name": "no_such_module_xyz.Thing"}], r"interaction\[0\].*importing no_such_module_xyz failed: "
                                                   r"ModuleNotFoundError"),
    ([{"class_name": "broken_interactions.Thing"}], r"importing broken_interactions failed: ZeroDivisionError"),
    ([{"class_name": "verl_interactions.Mine"}], r"No module named 'verl'; subclass meshrl's Interaction"),
    ([{"class_name": "json.JSONDecoder"}], "JSONDecoder is not a subclass of .*Interaction"),
    ([{"class_name": "json.Nope"}], "json has no Nope"),
    ([{"class_name": "verl.interactions.weather_interaction.WeatherInteraction"}], "importing verl.interactions"),
    ([{"class_name": "verl.interactions.base.BaseInteraction", "config": {"timeout": 3}}],
     r"config key\(s\) \['timeout'\] are not read"),
    ([{"name": "a", "class_name": "verl.interactions.base.BaseInteraction"}] * 2, "'a' is taken"),
    ([{"class_name": "verl.interactions.base.BaseInteraction", "config": [1]}], "config must be a mapping"),
    ([], "non-empty 'interaction:' list"),
    ([{"class_name": "broken_interactions_init.Lazy"}], r"Lazy.__init__ must call super\(\).__init__\(config\)"),
])
def test_what_an_interaction_file_cannot_hold_is_refused_with_the_entry(tmp_path, monkeypatch, entries, match):
    (tmp_path / "broken_interactions.py").write_text("1 / 0\n")
    (tmp_path / "verl_interactions.py").write_text("from verl.interactions.base import BaseInteraction\n")
    (tmp_path / "broken_interactions_init.py").write_text(
        "from meshrl.rollout.interactions.base import Interaction\n"
        "class Lazy(Interaction):\n    def __init__(self, config):\n        self.config = config\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    path = tmp_path / "i.yaml"
    path.write_text(json.dumps({"interaction": entries}))
    with pytest.raises(InteractionConfigError, match=match):
        load_interactions(path)
    rollout = {"multi_turn": {"enable": True, "interaction_config_path": str(path)}}
    (problem,) = unsupported_rollout_features(rollout)
    assert problem.startswith(f"actor_rollout_ref.rollout.multi_turn.interaction_config_path={path}: ")


@pytest.mark.parametrize("overrides,key", [
    (["actor_rollout_ref.rollout.multi_turn.enable=False"], "interaction_config_path"),
    (["data.return_raw_chat=False"], "data.return_raw_chat"),
])
def test_interactions_without_multi_turn_or_chat_messages_are_refused(tmp_path, overrides, key):
    cfg = load_config(swapped(tmp_path) + ["actor_rollout_ref.rollout.multi_turn.enable=True"] + overrides,
                      recipe="cpu_tiny_grpo")
    with pytest.raises(ConfigError, match=key):
        validate_config(cfg)


def test_rows_that_name_no_interaction_stop_the_run_before_any_worker(tmp_path):
    from meshrl.trainer.main import load_inputs

    rows = [{"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": f"{i} + 1?"}],
             "reward_model": {"ground_truth": str(i + 1)},
             "extra_info": {"interaction_kwargs": {"name": name, "ground_truth": str(i + 1)}}}
            for i, name in enumerate(["gsm8k", "chess", "gsm8k", "gsm8k"])]
    (tmp_path / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    cfg = load_config(swapped(tmp_path) + ["actor_rollout_ref.rollout.multi_turn.enable=True",
                                           f"data.train_files={tmp_path / 'train.jsonl'}",
                                           f"data.val_files={tmp_path / 'train.jsonl'}"], recipe="cpu_tiny_grpo")
    with pytest.raises(ConfigError, match=r"train\.jsonl row 1: .*name='chess' is not an interaction"):
        load_inputs(cfg)


def test_the_gsm8k_interaction_task_writes_verls_rows_and_interaction_file(tmp_path):
    from meshrl.data.gsm8k_interaction import INTERACTION_CONFIG, interaction_row
    from meshrl.data.preprocess import build_rows
    from meshrl.rollout.interactions.config import interaction_for, row_problems

    rows = [interaction_row(r) for r in build_rows("gsm8k", "test")[:3]]
    (tmp_path / "i.yaml").write_text(json.dumps(INTERACTION_CONFIG))
    interactions = load_interactions(tmp_path / "i.yaml")
    assert row_problems(interactions, [(str(i), r["extra_info"]) for i, r in enumerate(rows)]) == []
    first = rows[0]
    assert [m["role"] for m in first["prompt"]] == ["system", "user"]
    kwargs = first["extra_info"]["interaction_kwargs"]
    assert kwargs == {"name": "gsm8k", "query": first["prompt"][1]["content"],
                      "ground_truth": first["reward_model"]["ground_truth"]}
    assert isinstance(interaction_for(interactions, kwargs), Gsm8kInteraction)
