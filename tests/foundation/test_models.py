"""Embedded SmolLM2 and tiny models: the cached HF copy is the GGUF model; tiny layouts are real."""

import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer


@pytest.mark.slow
def test_cached_smollm2_matches_gguf_logits(smollm2_dir):
    from meshrl.models.embedded import load_smollm2_from_gguf

    gguf_model, gguf_tok = load_smollm2_from_gguf()
    cached = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    text = tok.apply_chat_template([{"role": "user", "content": "What is 12 * 7?"}],
                                   add_generation_prompt=True, tokenize=False)
    ids = tok(text, return_tensors="pt").input_ids
    assert torch.equal(ids, gguf_tok(text, return_tensors="pt").input_ids)
    with torch.no_grad():
        a = gguf_model.eval()(ids).logits
        b = cached(ids).logits
    assert torch.equal(a, b)


def test_smollm2_cache_layout(smollm2_dir):
    cfg = AutoConfig.from_pretrained(smollm2_dir)
    assert (cfg.model_type, cfg.num_hidden_layers, cfg.hidden_size) == ("llama", 30, 576)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.vocab_size) == (9, 3, 49152)
    assert cfg.tie_word_embeddings and not hasattr(cfg, "quantization_config")
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    assert tok.eos_token == "<|im_end|>"
    assert "<|im_start|>assistant" in tok.apply_chat_template([{"role": "user", "content": "hi"}],
                                                              add_generation_prompt=True, tokenize=False)


def test_smollm2_cache_is_reused(smollm2_dir):
    from meshrl.models.embedded import smollm2_hf_dir

    before = (smollm2_dir / "model.safetensors").stat().st_mtime_ns
    assert smollm2_hf_dir() == smollm2_dir
    assert (smollm2_dir / "model.safetensors").stat().st_mtime_ns == before


def test_tiny_layouts(tiny_llama_dir, tiny_qwen2_dir):
    llama = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    qwen = AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir)
    assert llama.config.tie_word_embeddings and llama.lm_head.weight is llama.model.embed_tokens.weight
    assert not qwen.config.tie_word_embeddings
    assert qwen.model.layers[0].self_attn.q_proj.bias is not None  # Qwen2's QKV bias
    for model in (llama, qwen):
        c = model.config
        assert c.num_key_value_heads < c.num_attention_heads  # GQA
        assert getattr(c, "head_dim", c.hidden_size // c.num_attention_heads) >= 32  # vLLM CPU kernel
    spec = json.loads((tiny_llama_dir / "meshrl_tiny_spec.json").read_text())
    assert spec["arch"] == "llama"


def test_tiny_models_are_seeded():
    from meshrl.models.tiny import TinySpec, build_tiny_model

    a = build_tiny_model(TinySpec(seed=3))
    b = build_tiny_model(TinySpec(seed=3))
    c = build_tiny_model(TinySpec(seed=4))
    wa, wb, wc = (m.model.layers[0].mlp.up_proj.weight for m in (a, b, c))
    assert torch.equal(wa, wb) and not torch.equal(wa, wc)


def test_tiny_qwen2_refuses_inconsistent_head_dim():
    from meshrl.models.tiny import TinySpec, tiny_config

    with pytest.raises(ValueError, match="head_dim"):
        tiny_config(TinySpec(arch="qwen2", hidden_size=128, head_dim=64, num_attention_heads=4))


def test_tiny_cache_names_differ_for_any_field():
    from meshrl.models.tiny import TinySpec

    base = TinySpec()
    assert base.name() == TinySpec().name()
    assert base.name() != TinySpec(intermediate_size=512).name()
    assert base.name() != TinySpec(rope_theta=1e6).name()
