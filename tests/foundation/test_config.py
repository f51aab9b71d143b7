"""Config: every key of the seed's commands and YAML blocks parses; typos and bad values fail clearly."""

import re
import shlex

import pytest
import torch
from omegaconf import OmegaConf

from meshrl.config import ConfigError, load_config
from meshrl.config.loader import default_config
from meshrl.config.run_plan import build_run_plan
from meshrl.config.refusals import Checked
from meshrl.config.validate import validate_config
from seed_commands import SEED_COMMANDS

# The seed's five ReMax example commands live in tests/seed_commands.py (the e2e test runs them too).

# The seed's YAML blocks, merged (dotted keys inside YAML are how the seed writes them).
SEED_YAML = """
algorithm:
  adv_estimator: remax
  use_kl_in_reward: True
  kl_penalty: kl
  kl_ctrl.kl_coef: 0.001
data:
  train_files: $HOME/data/gsm8k/train.parquet
  val_files: $HOME/data/gsm8k/test.parquet
  train_batch_size: 1024
  max_prompt_length: 512
  max_response_length: 1024
  filter_overlong_prompts: True
  truncation: 'error'
actor_rollout_ref:
  model:
    path: Qwen/Qwen2.5-7B-Instruct
    use_remove_padding: True
  actor:
    optim.lr: 1e-6
    ppo_mini_batch_size: 256
    use_dynamic_bsz: True
    ppo_max_token_len_per_gpu: 24000
    use_kl_loss: False
    fsdp_config:
      param_offload: False
      optimizer_offload: False
  rollout:
    name: vllm
    tensor_model_parallel_size: 2
    gpu_memory_utilization: 0.8
    n: 4
  ref:
    fsdp_config:
      param_offload: True
trainer:
  critic_warmup: 0
  logger: ["console","wandb"]
  project_name: verl_remax_example_gsm8k
  experiment_name: qwen2.5_7b_function_rm_kl1e-3
  n_gpus_per_node: 8
  nnodes: 1
  save_freq: -1
  test_freq: 5
  total_epochs: 10
"""


@pytest.mark.parametrize("command", SEED_COMMANDS)
def test_seed_commands_parse_and_validate(command):
    overrides = shlex.split(command)
    cfg = load_config(overrides)
    validate_config(cfg)
    for item in overrides:
        key, value = item.split("=", 1)
        got = OmegaConf.select(cfg, key)
        assert str(got) == value or float(got) == float(value) or str(got).lower() == value.lower(), (key, got)


def test_seed_yaml_blocks_parse(tmp_path):
    recipe = tmp_path / "seed.yaml"
    recipe.write_text(SEED_YAML)
    cfg = load_config(recipe=recipe)
    validate_config(cfg)
    assert cfg.algorithm.kl_ctrl.kl_coef == 0.001
    assert cfg.actor_rollout_ref.actor.optim.lr == pytest.approx(1e-6)
    assert cfg.actor_rollout_ref.ref.fsdp_config.param_offload is True
    assert list(cfg.trainer.logger) == ["console", "wandb"]
    assert cfg.trainer.default_local_dir == "checkpoints/verl_remax_example_gsm8k/qwen2.5_7b_function_rm_kl1e-3"


def test_overrides_win_over_recipe(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("actor_rollout_ref:\n  rollout:\n    n: 4\n")
    cfg = load_config(["actor_rollout_ref.rollout.n=8"], recipe=recipe)
    assert cfg.actor_rollout_ref.rollout.n == 8


def test_recipe_defaults_chain(tmp_path):
    (tmp_path / "base.yaml").write_text("data:\n  train_batch_size: 16\n  max_prompt_length: 64\n")
    (tmp_path / "child.yaml").write_text("defaults: [base]\ndata:\n  train_batch_size: 32\n")
    cfg = load_config(recipe=tmp_path / "child.yaml")
    assert (cfg.data.train_batch_size, cfg.data.max_prompt_length) == (32, 64)


@pytest.mark.parametrize("override, suggestion", [
    ("actor_rollout_ref.actor.ppo_max_tokens_len_per_gpu=1", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu"),
    ("actor_rollout_ref.ppo_max_token_len_per_gpu=1", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu"),
    ("algorithm.adv_estimater=grpo", "algorithm.adv_estimator"),
    ("trainer.n_gpu_per_node=8", "trainer.n_gpus_per_node"),
    ("actor_rollout_ref.rollout.temprature=0.7", "actor_rollout_ref.rollout.temperature"),
])
def test_typo_key_fails_with_suggestion(override, suggestion):
    with pytest.raises(ConfigError) as err:
        load_config([override])
    message = str(err.value)
    assert "unknown config key" in message and f"Did you mean: {suggestion}" in message


def test_typo_in_recipe_names_the_file(tmp_path):
    recipe = tmp_path / "bad.yaml"
    recipe.write_text("data:\n  train_batch_sise: 4\n")
    with pytest.raises(ConfigError, match=r"data.train_batch_sise.*bad.yaml.*data.train_batch_size"):
        load_config(recipe=recipe)


def test_wrong_type_names_key_and_type():
    with pytest.raises(ConfigError, match=r"data.train_batch_size.*expected int"):
        load_config(["data.train_batch_size=lots"])


def test_free_form_sections_accept_new_keys():
    cfg = load_config(["actor_rollout_ref.model.override_config.attention_dropout=0.1"])
    assert cfg.actor_rollout_ref.model.override_config.attention_dropout == 0.1


@pytest.mark.parametrize("overrides, key", [
    (["actor_rollout_ref.actor.ppo_max_token_len_per_gpu=-5"], "ppo_max_token_len_per_gpu"),
    (["actor_rollout_ref.rollout.n=0"], "actor_rollout_ref.rollout.n"),
    (["data.truncation=center"], "data.truncation"),
    (["actor_rollout_ref.rollout.top_p=1.5"], "top_p"),
    (["data.train_batch_size=8"], "ppo_mini_batch_size"),
    (["trainer.n_gpus_per_node=3", "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2"], "TP×PP×CP"),
    (["actor_rollout_ref.actor.strategy=veomni"], "actor_rollout_ref.actor.strategy"),
    (["trainer.logger=[console,wandbb]"], "trainer.logger"),
    (["trainer.resume_mode=resume_path"], "trainer.resume_from_path"),
    (["actor_rollout_ref.actor.use_dynamic_bsz=False"], "ppo_micro_batch_size_per_gpu"),
    (["actor_rollout_ref.actor.megatron.dtype=float16"], "use bfloat16"),
    (["actor_rollout_ref.ref.megatron.dtype=bf16"], "actor_rollout_ref.ref.megatron.dtype"),
    (["algorithm.adv_estimator=gae", "critic.megatron.dtype=fp32"], "critic.megatron.dtype"),
    (["actor_rollout_ref.actor.policy_loss.loss_mode=dro"], "actor_rollout_ref.actor.policy_loss.dro_beta"),
    (["actor_rollout_ref.actor.loss_scale_factor=0"], "actor_rollout_ref.actor.loss_scale_factor"),
    (["actor_rollout_ref.actor.policy_loss.loss_mode=sapo", "actor_rollout_ref.actor.tau_neg=0"],
     "actor_rollout_ref.actor.tau_neg"),
])
def test_impossible_values_name_the_key(overrides, key):
    cfg = load_config(overrides)
    with pytest.raises(ConfigError) as err:
        validate_config(cfg)
    assert key in str(err.value)


@pytest.mark.parametrize("estimator", ["grpo_passk", "rloo_vectorized"])
def test_group_estimators_without_a_solo_advantage_refuse_one_response_per_prompt(estimator):
    # verl's grpo_passk refuses a group of one (it credits the best of >= 2 samples); its rloo_vectorized gives it 0
    cfg = load_config([f"algorithm.adv_estimator={estimator}", "actor_rollout_ref.rollout.n=1"])
    with pytest.raises(ConfigError) as err:
        validate_config(cfg)
    message = str(err.value)
    assert f"actor_rollout_ref.rollout.n: {estimator} baselines each response against the other responses" in message
    assert "actor_rollout_ref.rollout.n=2 or more" in message
    assert message.endswith("pick an estimator that trains on groups of one: gae, gdpo, gpg, grpo, grpo_vectorized, "
                            "opo, optimal_token_baseline, reinforce_plus_plus, reinforce_plus_plus_baseline, remax, "
                            "rloo, tir_optimal_token_baseline")
    validate_config(load_config([f"algorithm.adv_estimator={estimator}", "actor_rollout_ref.rollout.n=2"]))


@pytest.mark.parametrize("estimator", ["optimal_token_baseline", "tir_optimal_token_baseline"])
def test_optimal_token_baselines_need_verls_sum_pi_squared_key(estimator):
    cfg = load_config([f"algorithm.adv_estimator={estimator}"], recipe="cpu_tiny_grpo")
    with pytest.raises(ConfigError, match=r"actor_rollout_ref.actor.calculate_sum_pi_squared: .*set it True") as err:
        validate_config(cfg)
    assert "problems" not in str(err.value)  # the one problem alone
    plan = validate_config(load_config([f"algorithm.adv_estimator={estimator}",
                                        "actor_rollout_ref.actor.calculate_sum_pi_squared=True"],
                                       recipe="cpu_tiny_grpo"))
    assert plan.sum_pi_squared and not plan.on_policy
    assert not validate_config(load_config([], recipe="cpu_tiny_grpo")).sum_pi_squared  # off unless asked


def test_gdpo_needs_its_reward_keys_and_one_weight_each():
    with pytest.raises(ConfigError, match=r"algorithm.gdpo_reward_keys: gdpo normalises each reward component"):
        validate_config(load_config(["algorithm.adv_estimator=gdpo"], recipe="cpu_tiny_grpo"))
    keys = "algorithm.gdpo_reward_keys=[accuracy_reward,format_reward]"
    with pytest.raises(ConfigError, match=r"algorithm.gdpo_reward_weights: one weight per .*2 keys, 3 weights"):
        validate_config(load_config(["algorithm.adv_estimator=gdpo", keys, "algorithm.gdpo_reward_weights=[1,2,3]"],
                                    recipe="cpu_tiny_grpo"))
    # verl's GDPO script: +algorithm.gdpo_reward_keys and its reward manager's name
    cfg = load_config(["algorithm.adv_estimator=gdpo", f"+{keys}", "reward.reward_manager.name=gdpo"],
                      recipe="cpu_tiny_grpo")
    assert validate_config(cfg).warnings == () and cfg.reward_model.reward_manager == "gdpo"
    assert list(cfg.algorithm.gdpo_reward_keys) == ["accuracy_reward", "format_reward"]


@pytest.mark.parametrize("estimator", ["gae", "remax", "reinforce_plus_plus"])
def test_estimators_without_groups_take_one_response_per_prompt(estimator):
    validate_config(load_config([f"algorithm.adv_estimator={estimator}", "actor_rollout_ref.rollout.n=1"]))


@pytest.mark.parametrize("estimator, advantage", [
    ("rloo", "raw score"), ("grpo", "raw score"), ("grpo_vectorized", "raw score"), ("opo", "raw score"),
    ("gpg", "raw score times GPG's alpha"), ("reinforce_plus_plus_baseline", "raw score whitened over the batch"),
])
def test_group_estimators_at_one_response_per_prompt_train_on_the_raw_score_with_a_note(estimator, advantage):
    # verl's rollout-correction examples run RLOO and GRPO at n=1: a group of one (mean 0, std 1 in verl) keeps its
    # score as its advantage
    plan = validate_config(load_config([f"algorithm.adv_estimator={estimator}", "actor_rollout_ref.rollout.n=1"]))
    (note,) = [note for note in plan.warnings if "rollout.n=1" in note]
    assert f"whose {estimator} advantage is its {advantage}" in note and "as in verl" in note, note


def test_all_problems_reported_at_once():
    cfg = load_config(["actor_rollout_ref.rollout.n=0", "data.truncation=center"])
    with pytest.raises(ConfigError, match=r"2 problem"):
        validate_config(cfg)


def test_tp_must_divide_model_heads():
    from transformers import LlamaConfig

    from meshrl.parallel.model_builder import layouts_shard_the_model

    hf = LlamaConfig(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, num_hidden_layers=30,
                     intermediate_size=1536, vocab_size=49152)
    cfg = load_config(["actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2"])
    assert "actor_rollout_ref.actor.megatron.tensor_model_parallel_size: TP=2 does not divide num_attention_heads=9" \
        in layouts_shard_the_model(Checked(cfg, build_run_plan(cfg), hf))
    cfg = load_config(["actor_rollout_ref.actor.megatron.tensor_model_parallel_size=3"])
    assert layouts_shard_the_model(Checked(cfg, build_run_plan(cfg), hf)) == []


@pytest.mark.parametrize("model_type, reason", [("qwen2_moe", "mixture-of-experts"),
                                                ("deepseek_v3", "multi-latent attention")])
def test_context_parallelism_on_a_model_it_does_not_split_yet_is_refused(model_type, reason):
    from meshrl.models.tiny import tiny_config, tiny_spec
    from meshrl.parallel.model_builder import layouts_shard_the_model

    cfg = load_config(["actor_rollout_ref.actor.megatron.context_parallel_size=2", "trainer.n_gpus_per_node=2"])
    problems = layouts_shard_the_model(Checked(cfg, build_run_plan(cfg), tiny_config(tiny_spec(model_type))))
    assert any(p.startswith("actor_rollout_ref.actor.megatron.context_parallel_size: CP=2 on") and reason in p
               for p in problems), problems
    assert layouts_shard_the_model(Checked(cfg, build_run_plan(cfg), tiny_config(tiny_spec("qwen2")))) == []


def test_unknown_recipe_suggests(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(recipe="no_such_recipe_anywhere")


def test_megatron_dtype_names_are_the_model_builders():
    from meshrl.config.schema import MEGATRON_DTYPES
    from meshrl.parallel.model_builder import PARAM_DTYPES, default_dtype, param_dtype

    assert set(MEGATRON_DTYPES) == {"auto", *PARAM_DTYPES}
    assert param_dtype("auto") == default_dtype() and param_dtype("bfloat16") == torch.bfloat16
    validate_config(load_config(["actor_rollout_ref.actor.megatron.dtype=bfloat16"]))


# ---- verl's asynchronous trainers' keys (meshrl.config.async_keys): present with verl's defaults, refused ----

ASYNC_NOTE = "the asynchronous trainers' sections are read by those trainers only"
V1_NOTE = "V1 trainer's asynchronous modes"


def test_verls_async_keys_are_in_the_schema_with_verls_defaults():

    cfg = default_config()
    # verl/experimental/fully_async_policy/config/fully_async_ppo_trainer.yaml (verl-project, 2026-08-22)
    assert dict(cfg.async_training) | {"checkpoint_engine": None} == {
        "staleness_threshold": 0.1, "trigger_parameter_sync_step": 4, "require_batches": 1, "partial_rollout": True,
        "use_trainer_do_validate": False, "use_dynamic_resource_scheduling": False,
        "dynamic_schedule_policy": "default", "dynamic_schedule_deactivate_ratio": 0.3,
        "dynamic_schedule_enable_rebalance": True, "concurrent_samples_per_replica": 16,
        "use_rollout_log_probs": True, "compute_prox_log_prob": False, "checkpoint_engine": None}  # the older verl's
    assert (cfg.rollout.nnodes, cfg.rollout.n_gpus_per_node, cfg.rollout.total_rollout_steps) == (1, 8, 100)
    # verl/trainer/config/ppo_trainer.yaml, rollout/rollout.yaml, workers/config/actor.py
    assert cfg.trainer.use_v1 is True and cfg.trainer.v1.trainer_mode == "sync" and cfg.trainer.v1.sync == {}
    assert (cfg.trainer.v1.separate_async.parameter_sync_step, cfg.trainer.v1.colocate_async.num_warmup_batches,
            cfg.trainer.v1.sampler.max_off_policy_threshold, cfg.trainer.v1.sampler.max_off_policy_strategy) == \
        (4, 1, 8, "drop")
    assert cfg.actor_rollout_ref.rollout.nnodes == 0 and cfg.actor_rollout_ref.actor.use_rollout_log_probs is False


@pytest.mark.parametrize("overrides", [
    ["async_training.staleness_threshold=0.1"],  # verl's default value still asks for the fully async trainer
    ["async_training.partial_rollout=False", "rollout.total_rollout_steps=51200"],
    ["rollout.nnodes=1", "rollout.n_gpus_per_node=8"],  # one-step-off's rollouter
])
def test_a_key_of_verls_async_sections_is_refused_in_a_synchronous_run_in_one_message(overrides):
    with pytest.raises(ConfigError) as info:
        load_config(overrides + ["actor_rollout_ref.rollout.n=0"])  # a load problem of its own would stay apart
    text = str(info.value)
    assert text.count(ASYNC_NOTE) == 1 and "--config-name=fully_async_ppo_trainer" in text
    for item in overrides:
        assert item in text and item.partition("=")[0] in info.value.keys
    # the same keys in a run of the trainer that reads them, in any order
    async_mode = "trainer.async_mode=fully_async"
    assert load_config(overrides + [async_mode]).trainer.async_mode == load_config([async_mode, *overrides]) \
        .trainer.async_mode == "fully_async"


def test_the_one_step_off_trainer_reads_the_rollout_section_not_async_training():
    cfg = load_config(["trainer.async_mode=one_step_off", "rollout.n_gpus_per_node=4"])
    assert cfg.rollout.n_gpus_per_node == 4
    with pytest.raises(ConfigError, match=f"async_training.require_batches=2: {ASYNC_NOTE}"):
        load_config(["trainer.async_mode=one_step_off", "async_training.require_batches=2"])


@pytest.mark.parametrize("overrides, problem", [
    (["actor_rollout_ref.hybrid_engine=False"],
     "actor_rollout_ref.hybrid_engine: must be True outside the asynchronous"),
    (["data.gen_batch_size=8"], "generating more prompts than a train batch is DAPO's dynamic sampling"),
    (["trainer.async_mode=fully_async", "data.gen_batch_size=4", "async_training.require_batches=2"],
     "data.gen_batch_size: must be 1 (or null) with the fully async trainer"),
    (["trainer.async_mode=fully_async", "data.train_batch_size=8", "async_training.require_batches=2"],
     "data.train_batch_size: must be 0 (as verl's fully async scripts set it) or the trainer's batch"),
    (["trainer.async_mode=colocate_async"], "trainer.async_mode: must be null or one of one_step_off, fully_async"),
])
def test_the_asynchronous_trainers_settings_are_checked(overrides, problem):
    with pytest.raises(ConfigError, match=re.escape(problem)):
        validate_config(load_config(overrides, recipe="cpu_tiny_grpo"))


def test_the_asynchronous_trainers_take_verls_separate_rollouter_keys_and_batch():
    """hybrid_engine=False and gen_batch_size=1, as verl's fully async scripts set them; train_batch_size=0 is the
    trainer's batch, ppo_mini_batch_size (2) x require_batches (2)."""
    cfg = load_config(["trainer.async_mode=fully_async", "actor_rollout_ref.hybrid_engine=False",
                       "data.gen_batch_size=1", "data.train_batch_size=0", "async_training.require_batches=2",
                       "algorithm.rollout_correction.bypass_mode=True"], recipe="cpu_tiny_grpo")
    assert cfg.data.train_batch_size == 4
    validate_config(cfg)
    validate_config(load_config(["trainer.async_mode=one_step_off", "actor_rollout_ref.hybrid_engine=False",
                                 "data.gen_batch_size=4"], recipe="cpu_tiny_grpo"))


def test_the_top_level_rollout_section_is_told_apart_from_the_engines():
    with pytest.raises(ConfigError, match=r"rollout\.n: the top-level rollout section is the fully async rollouter's"):
        load_config(["rollout.n=8"])


def test_a_recipe_with_an_async_section_is_refused_unless_it_runs_that_trainer(tmp_path):
    (tmp_path / "mine.yaml").write_text("async_training:\n  require_batches: 1\n")
    with pytest.raises(ConfigError, match=f"async_training.require_batches=1: {ASYNC_NOTE}"):
        load_config(recipe=tmp_path / "mine.yaml")
    (tmp_path / "async.yaml").write_text("defaults:\n  - fully_async_ppo_trainer\n  - _self_\n"
                                         "async_training:\n  require_batches: 2\n")
    assert load_config(recipe=tmp_path / "async.yaml").async_training.require_batches == 2


@pytest.mark.parametrize("name, mode", [
    ("fully_async_ppo_megatron_trainer", "fully_async"), ("fully_async_ppo_trainer.yaml", "fully_async"),
    ("one_step_off_ppo_megatron_trainer.yaml", "one_step_off"), ("one_step_off_ppo_trainer", "one_step_off")])
def test_verls_async_config_names_run_meshrls_asynchronous_trainers(name, mode, tmp_path):
    """Whatever folder --config-path names (a copy of verl's there is not read): verl's config, as meshrl's
    meshrl/config/verl_async/ copy of it; bypass mode, as verl's async configs set it."""
    (tmp_path / "fully_async_ppo_trainer.yaml").write_text("trainer:\n  total_epochs: 3\n")
    cfg = load_config(recipe=tmp_path / name)
    assert cfg.trainer.async_mode == mode and cfg.algorithm.rollout_correction.bypass_mode is True
    assert cfg.trainer.total_epochs == default_config().trainer.total_epochs
    validate_config(cfg)


def test_the_v1_trainers_separate_async_mode_is_refused_with_the_standalone_pool_in_one_message():
    cfg = load_config(["trainer.v1.trainer_mode=separate_async", "actor_rollout_ref.rollout.nnodes=2",
                       "trainer.v1.separate_async.parameter_sync_step=8"])
    with pytest.raises(ConfigError) as info:
        validate_config(cfg)
    text = str(info.value)
    assert "problems" not in text and text.count(V1_NOTE) == 1  # one problem
    for item in ("trainer.v1.trainer_mode=separate_async", "actor_rollout_ref.rollout.nnodes=2",
                 "trainer.v1.separate_async.parameter_sync_step=8"):
        assert item in text
    validate_config(load_config(["trainer.v1.trainer_mode=colocate_async"]))  # built: test_trainer_loop.py


def test_the_v1_sync_mode_is_meshrls_trainer_and_v0_ignores_trainer_v1():
    assert validate_config(load_config(["trainer.use_v1=True", "trainer.v1.trainer_mode=sync"])).warnings == ()
    warnings = validate_config(load_config(["trainer.use_v1=False", "trainer.v1.trainer_mode=colocate_async"])).warnings
    assert any("trainer.v1.trainer_mode=colocate_async has no effect with trainer.use_v1=False" in w for w in warnings)
    for overrides, match in ((["+trainer.v1.sync.parameter_sync_step=2"], "trainer.v1.sync="),
                             (["trainer.v1.sampler.sync_refill_failed_groups=True"], "failed prompt groups"),
                             (["trainer.v1.sampler.custom_sampler.path=x.py"], "custom samplers")):
        with pytest.raises(ConfigError, match=match):
            validate_config(load_config(overrides))


def test_use_rollout_log_probs_points_at_bypass_mode():
    warnings = validate_config(load_config(["actor_rollout_ref.actor.use_rollout_log_probs=True"])).warnings
    assert any("use_rollout_log_probs=True" in w and "bypass_mode=True" in w for w in warnings)


@pytest.mark.parametrize("key, value, bound", [
    ("async_training.staleness_threshold", -0.5, ">= 0"),
    ("async_training.trigger_parameter_sync_step", 0, ">= 1"),
    ("async_training.require_batches", 0, ">= 1"),
    ("async_training.concurrent_samples_per_replica", 0, ">= 1"),
    ("async_training.dynamic_schedule_deactivate_ratio", 1.5, "in (0, 1]"),
    ("rollout.total_rollout_steps", 0, ">= 1"),
    ("rollout.nnodes", -1, ">= 0"),
    ("rollout.n_gpus_per_node", 0, ">= 1"),
    ("actor_rollout_ref.rollout.nnodes", -1, ">= 0"),
    ("trainer.v1.trainer_mode", "fast", "one of sync, colocate_async, separate_async"),
    ("trainer.v1.separate_async.parameter_sync_step", 0, ">= 1"),
    ("trainer.v1.colocate_async.num_warmup_batches", -1, ">= 0"),
    ("trainer.v1.separate_async.hybrid_rollout.switch_threshold_ratio", 0.0, "in (0, 1]"),
    ("trainer.v1.sampler.max_off_policy_threshold", 0, "> 0"),
    ("trainer.v1.sampler.max_off_policy_strategy", "keep", "one of drop, wait"),
])
def test_async_values_out_of_range_name_the_key(key, value, bound):
    """The ranges verl asserts."""
    from meshrl.config.async_keys import COLOCATE_ONLY, async_problems

    cfg = default_config()
    if key in COLOCATE_ONLY:  # read by that trainer only: refused outright in the others
        OmegaConf.update(cfg, "trainer.v1.trainer_mode", "colocate_async")
    OmegaConf.update(cfg, key, value)
    problems, _, _ = async_problems(cfg)
    (problem,) = problems
    assert problem.startswith(f"{key}: must be {bound}") and problem.endswith(f"got {value!r}")


def test_a_negative_learning_rate_is_one_problem():
    with pytest.raises(ConfigError) as err:
        validate_config(load_config(["actor_rollout_ref.actor.optim.lr=-1"], recipe="cpu_tiny_grpo"))
    assert str(err.value) == "actor_rollout_ref.actor.optim.lr: must be >= 0, got -1.0"
    # Against a valid lr the bounds it sets are still checked
    with pytest.raises(ConfigError, match=r"optim.lr_warmup_init: must be in \[0, lr=0.0001\], got 0.5"):
        validate_config(load_config(["actor_rollout_ref.actor.optim.lr_warmup_init=0.5"], recipe="cpu_tiny_grpo"))


@pytest.mark.parametrize("text", ["", "# a recipe still to write\n", "{}\n"])
def test_an_empty_recipe_is_refused(tmp_path, text):
    recipe = tmp_path / "empty.yaml"
    recipe.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config([], recipe=str(recipe))
    assert str(err.value).startswith(f"recipe {recipe} is empty: it sets no key. Write the recipe's sections into it")
