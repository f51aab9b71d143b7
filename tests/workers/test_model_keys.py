"""verl's Megatron model keys reach the model: override_transformer_config, use_dist_checkpointing."""

import pytest
import torch
from transformers import AutoConfig

from meshrl.config import ConfigError, load_config
from meshrl.config.validate import validate_config
from meshrl.parallel import state
from meshrl.parallel.convert_cli import hf_to_mcore
from meshrl.parallel.hf_conversion import load_hf_weights
from meshrl.parallel.model_builder import build_model, model_config
from meshrl.workers.actor_rollout_ref import load_initial_weights, transformer_overrides

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
    chunks = build_model(AutoConfig.from_pretrained(tiny_llama_dir), **transformer_overrides(arr.model, arr.actor.megatron))
    config = model_config(chunks)
    assert config.recompute_granularity == "selective" and config.recompute_modules == ["core_attn"]
    plain = actor_cfg("actor_rollout_ref.model.enable_gradient_checkpointing=True")
    assert transformer_overrides(plain.model, plain.actor.megatron) == {
        "recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}


@pytest.mark.parametrize("override, message", [
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
    converted = hf_to_mcore(tiny_llama_dir, tmp_path / "converted")
    arr = actor_cfg(f"{MEGATRON}.use_dist_checkpointing=True", f"{MEGATRON}.dist_checkpointing_path={converted}")
    load_initial_weights(from_ckpt, arr.actor.megatron, str(tiny_llama_dir), hf_config)
    for a, c in zip(from_ckpt[0].parameters(), from_hf[0].parameters()):
        assert torch.equal(a, c)
