"""The DeepSeek-V3 family (Moonlight-16B-A3B's architecture): its HF config read into megatron's MLA and sigmoid-router
options, the HF tensors of its dense and MoE layers, and the configs megatron-core or vLLM would run otherwise,
refused with the reason (parity under expert parallelism: tests/parallel/test_moe_parallel.py; vLLM:
tests/models/test_moe_vllm.py)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from meshrl.models.families import hf_layout, layer_spec_options, model_spec, transformer_options
from meshrl.models.tiny import tiny_config, tiny_model_dir, tiny_spec
from meshrl.parallel import model_builder
from meshrl.parallel.state import ParallelConfig


def config(**fields):
    hf_config = tiny_config(tiny_spec("deepseek_v3"))
    for key, value in fields.items():
        setattr(hf_config, key, value)
    return hf_config


def test_router_attention_and_dense_layers_map_onto_megatrons_options() -> None:
    hf_config = config()
    options = transformer_options(model_spec(hf_config))
    assert options["moe_router_score_function"] == "sigmoid" and options["moe_router_enable_expert_bias"]
    assert (options["moe_router_num_groups"], options["moe_router_group_topk"]) == (hf_config.n_group,
                                                                                   hf_config.topk_group)
    assert options["moe_router_topk_scaling_factor"] == hf_config.routed_scaling_factor
    assert options["moe_layer_freq"] == [0, 1]  # first_k_dense_replace = 1 of 2 layers
    assert (options["moe_shared_expert_intermediate_size"]
            == hf_config.n_shared_experts * hf_config.moe_intermediate_size)
    assert not options["moe_shared_expert_gate"]
    assert (options["q_lora_rank"], options["kv_lora_rank"], options["qk_head_dim"], options["qk_pos_emb_head_dim"],
            options["v_head_dim"]) == (32, 512, 64, 64, 64)
    assert options["multi_latent_attention"] and options["rope_type"] == "rope"
    assert layer_spec_options(model_spec(hf_config))["qk_layernorm"]  # the latent norms


# DeepSeek-V3's rope_parameters
YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=40.0, original_max_position_embeddings=4096, beta_fast=32.0,
            beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)


def test_yarn_maps_onto_megatrons_mla_yarn_as_transformers_reads_it() -> None:
    options = transformer_options(model_spec(config(rope_parameters=dict(YARN))))
    assert options["rope_type"] == "yarn"
    assert [options[key] for key in ("rotary_scaling_factor", "original_max_position_embeddings", "beta_fast",
                                     "beta_slow", "mscale", "mscale_all_dim")] == [40.0, 4096, 32.0, 1.0, 1.0, 1.0]
    # without mscale_all_dim transformers scales cos / sin by m(1) whatever mscale says: megatron's (1, 0)
    spec = model_spec(config(rope_parameters=dict(YARN, mscale=0.707, mscale_all_dim=None)))
    assert spec.yarn[-2:] == (1.0, 0.0)
    assert transformer_options(model_spec(config()))["rope_type"] == "rope"


def test_one_group_or_every_group_routes_ungrouped() -> None:
    for n_group, topk_group in ((1, 1), (2, 2)):
        spec = model_spec(config(n_group=n_group, topk_group=topk_group))
        assert spec.moe_groups is None and spec.moe_group_topk is None
    spec = model_spec(config(n_group=4, topk_group=2, num_experts_per_tok=4))  # DeepSeek-V3's top-8 of 4 of 8 groups
    assert (spec.moe_groups, spec.moe_group_topk) == (4, 2)


def test_dense_first_layer_and_moe_layers_name_the_checkpoints_tensors() -> None:
    layout = hf_layout(model_spec(config()))
    dense = {p.hf_name for p in layout if p.layer == 0}
    moe = {p.hf_name: p for p in layout if p.layer == 1}
    assert {"model.layers.0.mlp.gate_proj.weight", "model.layers.0.self_attn.q_a_proj.weight",
            "model.layers.0.self_attn.q_a_layernorm.weight", "model.layers.0.self_attn.q_b_proj.weight",
            "model.layers.0.self_attn.kv_a_proj_with_mqa.weight", "model.layers.0.self_attn.kv_a_layernorm.weight",
            "model.layers.0.self_attn.kv_b_proj.weight"} <= dense
    assert not any(".experts." in name or "mlp.gate.weight" in name for name in dense)
    bias = moe["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert bias.buffer and bias.mcore.endswith("mlp.router.expert_bias") and bias.shape == (8,)
    assert {"model.layers.1.mlp.shared_experts.down_proj.weight",
            "model.layers.1.mlp.experts.7.up_proj.weight"} <= set(moe)
    # Moonlight: queries straight from the hidden state
    moonlight = {p.hf_name for p in hf_layout(model_spec(config(q_lora_rank=None))) if p.layer == 0}
    assert "model.layers.0.self_attn.q_proj.weight" in moonlight and not any("q_a_" in n for n in moonlight)


@pytest.mark.parametrize("fields,message", [
    (dict(rope_interleave=False), "rope_interleave=False: megatron's multi-latent attention rotates adjacent"),
    (dict(norm_topk_prob=False), "norm_topk_prob=False: megatron renormalises the top-k sigmoid scores"),
    (dict(n_group=4, topk_group=2), "topk_group=2: megatron's group-limited routing"),  # top-2 // 2 groups = 1
    (dict(scoring_func="softmax"), "scoring_func='softmax'"),
    (dict(topk_method="greedy"), "topk_method='greedy'"),
    (dict(num_key_value_heads=2), "num_key_value_heads=2"),
    (dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}), "rope_type='linear'"),
    (dict(rope_parameters=dict(YARN, attention_factor=1.0)), "rope_type='yarn': only plain RoPE and YaRN as megatron"),
    (dict(rope_parameters=dict(YARN, truncate=False)), "rope_type='yarn'"),
    (dict(rope_parameters=dict(YARN, mscale=None)), "rope_type='yarn'"),  # mscale_all_dim alone
])
def test_what_megatron_or_vllm_would_run_otherwise_is_refused(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match="deepseek_v3 config not supported by meshrl") as err:
        model_spec(config(**fields))
    assert message in str(err.value)


def test_latent_widths_tp_cannot_split_are_refused() -> None:
    with pytest.raises(ValueError, match="TP=2 does not divide q_lora_rank=33"):
        model_builder.check_layout(model_spec(config(q_lora_rank=33)), ParallelConfig(tensor_parallel=2))
    model_builder.check_layout(model_spec(config()), ParallelConfig(tensor_parallel=2, expert_parallel=2))


def test_the_expert_bias_step_is_read_for_deepseek_and_refused_without_an_expert_bias() -> None:
    import torch

    from meshrl.config import load_config
    from meshrl.config.validate import validate_config

    key = "+actor_rollout_ref.actor.megatron.override_transformer_config.moe_router_bias_update_rate=0.0"
    validate_config(load_config(["actor_rollout_ref.model.path=tiny:deepseek_v3", key], recipe="cpu_tiny_grpo"))
    built = model_builder.transformer_config(model_spec(config()), ParallelConfig(), torch.float32,
                                             moe_router_bias_update_rate=0.0)
    assert built.moe_router_bias_update_rate == 0.0 and built.moe_router_enable_expert_bias
    with pytest.raises(ValueError, match="qwen2_moe's router has no expert bias to move"):
        model_builder.transformer_config(model_spec(tiny_config(tiny_spec("qwen2_moe"))), ParallelConfig(),
                                         torch.float32, moe_router_bias_update_rate=0.0)


def test_what_vllm_on_cpu_or_lora_cannot_serve_is_refused_before_the_run() -> None:
    from meshrl.config import ConfigError, load_config
    from meshrl.rollout.serving_limits import vllm_cpu_mla_problem
    from meshrl.trainer.main import preflight

    assert vllm_cpu_mla_problem(config()) is None  # kv_lora_rank 512 + qk_rope_head_dim 64
    assert "kv_lora_rank 512 and qk_rope_head_dim 64 only" in vllm_cpu_mla_problem(config(kv_lora_rank=256))
    assert vllm_cpu_mla_problem(tiny_config(tiny_spec("qwen2_moe"))) is None
    cfg = load_config(["actor_rollout_ref.model.path=tiny:deepseek_v3", "actor_rollout_ref.model.lora_rank=8"],
                      recipe="cpu_tiny_grpo")
    with pytest.raises(ConfigError, match="LoRA on deepseek_v3's multi-latent attention is not built yet"):
        preflight(cfg)


def test_sequence_parallelism_with_mla_is_refused_when_the_config_is_built() -> None:
    import torch

    with pytest.raises(ValueError, match="sequence_parallel with multi-latent attention is not built"):
        model_builder.transformer_config(model_spec(config()), ParallelConfig(tensor_parallel=2), torch.float32,
                                         sequence_parallel=True)


def test_released_and_transformers_written_configs_load_as_transformers_computes_them(tmp_path) -> None:
    """DeepSeek-V3 ships one multi-token-prediction layer: the policy is the main layers (noted once at start, an HF
    export says 0); a config transformers wrote has no scoring_func / topk_method: the model is transformers'
    (sigmoid, noaux_tc), and vLLM and the export are told so, since vLLM's defaults are softmax and no bias."""
    from meshrl.config import load_config
    from meshrl.models.families import config_notes, implicit_fields
    from meshrl.parallel.hf_conversion import _config_for_export
    from meshrl.trainer.main import preflight

    released = config(num_nextn_predict_layers=1)
    assert model_spec(released) == model_spec(config())
    (note,) = config_notes(released)
    assert note.startswith("num_nextn_predict_layers=1: the checkpoint's multi-token-prediction layer(s) are neither")
    written = config()
    del written.scoring_func, written.topk_method  # as transformers' DeepseekV3Config writes a config
    assert getattr(written, "scoring_func", None) is None and model_spec(written) == model_spec(config())
    assert implicit_fields(written) == {"scoring_func": "sigmoid", "topk_method": "noaux_tc"}
    assert implicit_fields(released) == {"num_nextn_predict_layers": 0} and implicit_fields(config()) == {}
    exported = _config_for_export(released, critic=False, dtype=torch.float32)
    assert exported.num_nextn_predict_layers == 0 and released.num_nextn_predict_layers == 1
    # the note reaches the run's start-up notes: the tiny model's folder with DeepSeek-V3's MTP count in its config
    folder = tmp_path / "released"
    shutil.copytree(tiny_model_dir(tiny_spec("deepseek_v3")), folder)
    fields = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**fields, "num_nextn_predict_layers": 1}))
    plan = preflight(load_config([f"actor_rollout_ref.model.path={folder}"], recipe="cpu_tiny_grpo"))
    assert any(w.startswith("num_nextn_predict_layers=1") for w in plan.warnings)


def test_an_fp32_mla_engine_on_a_cpu_with_amx_asks_vllm_for_its_reference_mla_backend(monkeypatch) -> None:
    """vLLM-cpu prefers an AMX MLA kernel on a CPU with AMX, which takes 16-bit weights only (an fp32 engine failed to
    start in the workers on an Intel CPU with amx_bf16): an fp32 MLA engine there asks for vLLM's reference CPU_MLA
    backend (served and measured by tests/models/test_moe_vllm.py on whatever CPU runs it); a bf16 engine, a CPU
    without AMX and a model without MLA leave vLLM its own choice, and the run loads either way."""
    from meshrl.config import load_config
    from meshrl.rollout import serving_limits
    from meshrl.trainer.main import preflight

    base = ["actor_rollout_ref.model.path=tiny:deepseek_v3"]
    monkeypatch.setattr(serving_limits, "cpu_has_amx", lambda: True)
    assert serving_limits.vllm_cpu_mla_backend(config(), "auto") == "CPU_MLA"
    assert serving_limits.vllm_cpu_mla_backend(config(), "float32") == "CPU_MLA"
    assert serving_limits.vllm_cpu_mla_backend(config(), "bfloat16") is None
    assert serving_limits.vllm_cpu_mla_backend(tiny_config(tiny_spec("qwen2_moe")), "auto") is None
    preflight(load_config(base, recipe="cpu_tiny_grpo"))
    monkeypatch.setattr(serving_limits, "cpu_has_amx", lambda: False)
    assert serving_limits.vllm_cpu_mla_backend(config(), "auto") is None
