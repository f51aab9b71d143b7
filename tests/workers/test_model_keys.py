"""verl's Megatron model keys reach the model: override_transformer_config, use_dist_checkpointing."""

import pytest
import torch
from transformers import AutoConfig

from meshrl.config import ConfigError, load_config
from meshrl.models.tiny import tiny_model_dir, tiny_spec
from meshrl.config.validate import validate_config
from meshrl.parallel import state
from meshrl.parallel.convert_cli import hf_to_mcore
from meshrl.parallel.hf_conversion import load_hf_weights
from meshrl.parallel.model_builder import build_model, model_config
from meshrl.workers.model_setup import load_initial_weights, transformer_overrides

MEGATRON = "actor_rollout_ref.actor.megatron"


@pytest.fixture(scope="module")
def one_rank():
    state.initialize(state.ParallelConfig())
    yield
    state.destroy()


def actor_cfg(*overrides):
    cfg = load_config(list(overrides), recipe="cpu_tiny_grpo")
    validate_config(cfg)
    return cfg.actor_rollout_ref


def test_override_transformer_config_reaches_megatron_and_wins(one_rank, tiny_llama_dir):
    arr = actor_cfg("actor_rollout_ref.model.enable_gradient_checkpointing=True",
                    f"+{MEGATRON}.override_transformer_config.recompute_granularity=selective",
                    f"+{MEGATRON}.override_transformer_config.recompute_modules=[core_attn]")
    chunks = build_model(AutoConfig.from_pretrained(tiny_llama_dir),
                         **transformer_overrides(arr.model, arr.actor.megatron))
    config = model_config(chunks)
    assert config.recompute_granularity == "selective" and config.recompute_modules == ["core_attn"]
    plain = actor_cfg("actor_rollout_ref.model.enable_gradient_checkpointing=True")
    assert transformer_overrides(plain.model, plain.actor.megatron) == {
        "recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}


def test_moe_router_dtype_reaches_megatrons_router_and_fused_permutation_is_off_on_cpu(one_rank):
    """verl's Qwen3-MoE scripts' fp32 router: megatron's config holds it and meshrl's router (megatron's TopKRouter
    subclassed) computes its logits in fp32 in a bf16 model; moe_permute_fusion and apply_rope_fusion (Transformer
    Engine's CUDA kernels) are turned off in a process without them, where megatron would refuse to build."""
    from meshrl.models.tiny import tiny_config, tiny_spec
    from meshrl.parallel.layers import mean_aux_loss_router_class, tp_split_moe_layer_class
    from meshrl.parallel.model_builder import fused_kernels_run

    arr = actor_cfg("actor_rollout_ref.model.path=tiny:qwen3_moe",
                    f"+{MEGATRON}.override_transformer_config.moe_router_dtype=fp32",
                    f"+{MEGATRON}.override_transformer_config.moe_permute_fusion=True",
                    f"+{MEGATRON}.override_transformer_config.apply_rope_fusion=True")
    overrides = transformer_overrides(arr.model, arr.actor.megatron)
    assert overrides["moe_router_dtype"] == "fp32" and overrides["moe_permute_fusion"] is True
    hf_config = tiny_config(tiny_spec("qwen3_moe"))
    logits = {}
    for dtype_name, settings in (("fp32", overrides), ("default", {})):
        chunks = build_model(hf_config, dtype=torch.bfloat16, **settings)
        config = model_config(chunks)
        assert config.moe_router_dtype == (None if dtype_name == "default" else "fp32")
        assert config.moe_permute_fusion is False and not fused_kernels_run("moe_permute_fusion")
        assert config.apply_rope_fusion is False and not fused_kernels_run("apply_rope_fusion")
        routers = [m for m in chunks[0].modules() if isinstance(m, mean_aux_loss_router_class())]
        assert routers
        hidden = torch.randn(3, 1, hf_config.hidden_size, dtype=torch.bfloat16)
        logits[dtype_name] = routers[0].gating(hidden)
        # the whole MoE layer runs with it: the routed output comes back in the model's dtype
        layer = next(m for m in chunks[0].modules() if isinstance(m, tp_split_moe_layer_class()))
        output, _ = layer(hidden)
        assert output.dtype == torch.bfloat16 and output.shape == hidden.shape and output.isfinite().all()
    assert logits["fp32"].dtype == torch.float32 and logits["default"].dtype == torch.bfloat16


def test_the_expert_layers_speed_switches_build_the_same_model(one_rank):
    """verl's Qwen3-30B-A3B scripts' grouped GEMM, DeepEP and flex dispatcher: read (the run notes them once) and not
    taken, so the model is the one built without them: the same megatron config, the same expert modules and, from
    the same seed, the same outputs."""
    from meshrl.models.tiny import tiny_config, tiny_spec
    from meshrl.parallel.layers import tp_split_moe_layer_class

    arr = actor_cfg("actor_rollout_ref.model.path=tiny:qwen3_moe",
                    f"+{MEGATRON}.override_transformer_config.moe_grouped_gemm=True",
                    f"+{MEGATRON}.override_transformer_config.moe_enable_deepep=True",
                    f"+{MEGATRON}.override_transformer_config.moe_token_dispatcher_type=flex")
    overrides = transformer_overrides(arr.model, arr.actor.megatron)
    assert overrides["moe_grouped_gemm"] is True and overrides["moe_token_dispatcher_type"] == "flex"
    hf_config = tiny_config(tiny_spec("qwen3_moe"))
    built = {}
    for name, settings in (("asked", overrides), ("plain", {})):
        torch.manual_seed(0)
        chunks = build_model(hf_config, dtype=torch.float32, **settings)
        config = model_config(chunks)
        layer = next(m for m in chunks[0].modules() if isinstance(m, tp_split_moe_layer_class()))
        hidden = torch.randn(3, 1, hf_config.hidden_size, generator=torch.Generator().manual_seed(1))
        built[name] = ({f: getattr(config, f) for f in ("moe_grouped_gemm", "moe_enable_deepep",
                                                         "moe_token_dispatcher_type")},
                       type(layer.experts).__name__, layer(hidden)[0])
    assert built["asked"][0] == built["plain"][0] == {"moe_grouped_gemm": False, "moe_enable_deepep": False,
                                                      "moe_token_dispatcher_type": "alltoall"}
    assert built["asked"][1] == built["plain"][1] == "SequentialMLP"
    assert torch.equal(built["asked"][2], built["plain"][2])


@pytest.mark.parametrize("override, message", [
    (f"+{MEGATRON}.override_transformer_config.moe_router_dtype=bf16", "moe_router_dtype: 'bf16' is not one of fp32"),
    (f"+{MEGATRON}.override_transformer_config.recompute_granularty=full", "recompute_granularity"),
    (f"+{MEGATRON}.override_transformer_config.attention_backend=flashy", "attention_backend"),
    (f"{MEGATRON}.use_dist_checkpointing=True", "dist_checkpointing_path"),
])
def test_bad_megatron_keys_are_refused_at_config_time(override, message):
    with pytest.raises(ConfigError, match=message):
        actor_cfg(override)


def test_use_dist_checkpointing_starts_from_the_megatron_checkpoint(one_rank, tiny_llama_dir, tmp_path):
    """A checkpoint from `meshrl convert hf-to-mcore` of a perturbed model: the policy starts from its weights,
    not the HF folder's."""
    hf_config = AutoConfig.from_pretrained(tiny_llama_dir)
    source = build_model(hf_config)
    load_hf_weights(source, tiny_llama_dir, hf_config)
    with torch.no_grad():
        for p in source[0].parameters():
            p.add_(0.125)
    from meshrl.parallel.checkpoint import save_checkpoint

    folder = save_checkpoint(tmp_path / "mcore", 0, source)
    arr = actor_cfg(f"{MEGATRON}.use_dist_checkpointing=True", f"{MEGATRON}.dist_checkpointing_path={folder}")
    from_ckpt, from_hf = build_model(hf_config), build_model(hf_config)
    load_initial_weights(from_ckpt, arr.actor.megatron, str(tiny_llama_dir), hf_config)
    load_initial_weights(from_hf, arr.ref.megatron, str(tiny_llama_dir), hf_config)
    for (name, a), b, c in zip(from_ckpt[0].named_parameters(), source[0].parameters(), from_hf[0].parameters()):
        assert torch.equal(a, b), name
        assert not torch.equal(a, c), name
    # the converter's own output loads the same way
    converted = hf_to_mcore(tiny_llama_dir, hf_config, tmp_path / "converted")
    arr = actor_cfg(f"{MEGATRON}.use_dist_checkpointing=True", f"{MEGATRON}.dist_checkpointing_path={converted}")
    load_initial_weights(from_ckpt, arr.actor.megatron, str(tiny_llama_dir), hf_config)
    for a, c in zip(from_ckpt[0].parameters(), from_hf[0].parameters()):
        assert torch.equal(a, c)


def test_one_language_model_checkpoint_starts_the_critic_too(one_rank, tiny_llama_dir, tmp_path):
    """verl's MoE PPO script points the policy, the reference and the critic at one converted checkpoint: the critic
    takes its decoder and a zero value head, as a critic built from the HF causal LM does. A critic's checkpoint does
    not start a policy (it has no output layer)."""
    from meshrl.parallel.checkpoint import load_checkpoint
    from meshrl.parallel.model_builder import unwrap

    hf_config = AutoConfig.from_pretrained(tiny_llama_dir)
    converted = hf_to_mcore(tiny_llama_dir, hf_config, tmp_path / "lm")
    from_checkpoint, from_hf = build_model(hf_config, critic=True), build_model(hf_config, critic=True)
    load_checkpoint(converted, from_checkpoint)
    load_hf_weights(from_hf, tiny_llama_dir, hf_config)
    for (name, a), b in zip(from_checkpoint[0].named_parameters(), from_hf[0].parameters()):
        assert torch.equal(a, b), name
    assert not unwrap(from_checkpoint[0]).output_layer.weight.any()
    critic_checkpoint = hf_to_mcore(tiny_llama_dir, hf_config, tmp_path / "critic", critic=True)
    with pytest.raises(ValueError, match="critic: True vs False"):
        load_checkpoint(critic_checkpoint, build_model(hf_config))


def test_a_dist_checkpoint_the_run_cannot_start_from_stops_it_naming_the_command(one_rank, tiny_llama_dir, tmp_path):
    """verl's MoE scripts start from converted checkpoints: a path without one (the script's step 1 not run), a
    critic's for the policy, another model's are refused before any worker starts, naming `meshrl convert`."""
    from meshrl.trainer.early_checks import dist_checkpoint_problems

    hf_config = AutoConfig.from_pretrained(tiny_llama_dir)
    keys = ["actor_rollout_ref.actor.megatron.use_dist_checkpointing=True",
            "critic.megatron.use_dist_checkpointing=True"]

    def problems(actor, critic):
        cfg = load_config([*keys, f"actor_rollout_ref.actor.megatron.dist_checkpointing_path={actor}",
                           f"critic.megatron.dist_checkpointing_path={critic}", "algorithm.adv_estimator=gae"],
                          recipe="cpu_tiny_grpo")
        return dist_checkpoint_problems(cfg, use_reference=False, use_critic=True, hf_config=hf_config)

    (missing,) = problems(tmp_path / "nothing", hf_to_mcore(tiny_llama_dir, hf_config, tmp_path / "lm"))
    assert missing.startswith("actor_rollout_ref.actor.megatron.dist_checkpointing_path=") and \
        "no meshrl checkpoint there" in missing and \
        f"`meshrl convert hf-to-mcore --hf {tiny_llama_dir} --out " in missing
    critic = hf_to_mcore(tiny_llama_dir, hf_config, tmp_path / "critic", critic=True)
    (wrong,) = problems(critic, tmp_path / "lm")
    assert "is a critic's checkpoint" in wrong and "(without --critic)" in wrong
    qwen2 = tiny_model_dir(tiny_spec("qwen2"))
    (other,) = problems(hf_to_mcore(qwen2, AutoConfig.from_pretrained(qwen2), tmp_path / "qwen2"), tmp_path / "lm")
    assert "is another model's checkpoint than tiny:llama" in other
    assert problems(tmp_path / "lm", tmp_path / "lm") == []  # one language model's checkpoint for both
