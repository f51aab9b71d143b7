"""Tiny random models of every registered family (``meshrl.models.families``), for tests and CPU smoke runs.

They keep every structural feature the parallel and rollout layers must handle — grouped-query
attention, Qwen2's QKV bias, Qwen3's q/k norms and independent head_dim, Gemma's zero-centred norms, GeGLU,
embedding scaling, post norms, soft-capping and sliding-window layers, tied or untied embeddings, rope
theta, RMSNorm eps — at a size that runs in milliseconds. ``head_dim`` defaults to 64 because vLLM's CPU
attention kernel only accepts head_dim in {32, 64, 80, 96, 112, 128, ...}. The tokenizer is the embedded
SmolLM2 one, so prompts, chat template and vocabulary are real. ``tiny_spec(model_type)`` is the shape
``tiny:<model_type>`` resolves to (the family's ``tiny_shape`` over ``TinySpec``'s defaults).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from meshrl.atomic_io import cached_dir
from meshrl.runtime import cache_dir


@dataclass(frozen=True)
class TinySpec:
    """Shape of a tiny model. ``vocab_size`` must cover the tokenizer's (49,152 for SmolLM2)."""

    arch: str = "llama"  # a registered model_type
    hidden_size: int = 128
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    vocab_size: int = 49152
    tie_word_embeddings: bool = True
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 2048
    # std of the norms' gammas around 1 (0: all ones, HF's init); > 0 lets a test tell one norm from another
    norm_scale: float = 0.0
    seed: int = 0

    def name(self) -> str:
        """Cache folder name: readable shape plus a hash of every field, so distinct specs never collide."""
        tie = "tied" if self.tie_word_embeddings else "untied"
        digest = hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:10]
        return (f"tiny-{self.arch}-h{self.hidden_size}-l{self.num_hidden_layers}-"
                f"a{self.num_attention_heads}kv{self.num_key_value_heads}-d{self.head_dim}-{tie}-{digest}")


def tiny_spec(model_type: str, **changes) -> TinySpec:
    """The tiny model of ``model_type``'s family: its ``tiny_shape``, then ``changes``."""
    from meshrl.models.families import family

    return TinySpec(arch=model_type, **{**family(model_type).tiny_shape, **changes})


def tiny_config(spec: TinySpec):
    """Hugging Face config for ``spec`` (the family's config class and ``tiny_config`` fields)."""
    import transformers

    from meshrl.models.families import family

    fam = family(spec.arch)
    shape = dict(
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        vocab_size=spec.vocab_size,
        tie_word_embeddings=spec.tie_word_embeddings,
        rms_norm_eps=spec.rms_norm_eps,
        max_position_embeddings=spec.max_position_embeddings,
        rope_theta=spec.rope_theta,
    )
    if fam.derives_head_dim:
        if spec.hidden_size != spec.num_attention_heads * spec.head_dim:
            raise ValueError(f"{spec.arch} derives head_dim = hidden_size / num_attention_heads; "
                             f"got hidden {spec.hidden_size}, heads {spec.num_attention_heads}, "
                             f"head_dim {spec.head_dim}")
    else:
        shape["head_dim"] = spec.head_dim
    return getattr(transformers, fam.config_class)(**shape, **fam.tiny_config)


def build_tiny_model(spec: TinySpec = TinySpec()):
    """A randomly initialised fp32 ``*ForCausalLM`` for ``spec`` (deterministic in ``spec.seed``)."""
    import torch
    from transformers import AutoModelForCausalLM

    from meshrl.models.families import family, model_spec

    config = tiny_config(spec)
    # A zero-centred gamma w scales by 1 + w: drawn around 0 so that the scale is around 1 as elsewhere.
    gamma_centre = 0.0 if model_spec(config).zero_centered_norms else 1.0
    with torch.random.fork_rng():
        torch.manual_seed(spec.seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        # The default init (std 0.02) makes a near-uniform next-token distribution; a larger scale
        # gives peaked, seed-dependent distributions so greedy decoding and log-prob tests bite.
        with torch.no_grad():
            for name, param in model.named_parameters():
                if param.dim() >= 2:
                    param.normal_(0.0, 0.08)
                elif name.endswith("bias"):
                    param.normal_(0.0, 0.05)
                elif spec.norm_scale:  # a norm's gamma
                    param.normal_(gamma_centre, spec.norm_scale)
            for name, buffer in model.named_buffers():
                if name.endswith(family(spec.arch).tiny_buffers):
                    buffer.normal_(0.0, 0.05)
    return model.eval()


def tiny_model_dir(spec: TinySpec = TinySpec()) -> Path:
    """Local HF folder (config, safetensors, SmolLM2 tokenizer) of the tiny model, built once and cached."""
    from meshrl.models.embedded import smollm2_hf_dir
    from transformers import AutoTokenizer

    def build(tmp: Path) -> None:
        tokenizer = AutoTokenizer.from_pretrained(smollm2_hf_dir())
        if len(tokenizer) > spec.vocab_size:
            raise ValueError(f"vocab_size {spec.vocab_size} is smaller than the tokenizer's {len(tokenizer)}")
        model = build_tiny_model(spec)
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        model.config.eos_token_id = tokenizer.eos_token_id
        model.config.bos_token_id = tokenizer.bos_token_id
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / "meshrl_tiny_spec.json").write_text(json.dumps(asdict(spec), indent=1))

    return cached_dir(cache_dir() / "models" / spec.name(), "model.safetensors", build)
