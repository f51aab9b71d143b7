"""Gemma 3 (text; HF ``model_type`` ``gemma3_text``, ``Gemma3ForCausalLM``): Gemma 2's decoder without
attention soft-capping by default (the field stays supported), plus

- q/k RMSNorms (zero-centred, over head_dim) before RoPE, as Qwen3's (``qk_norm``);
- its own RoPE base for the sliding-window layers: ``rope_parameters`` holds one entry per layer type,
  ``full_attention`` (Gemma-3-270M: theta 1e6) and ``sliding_attention`` (theta 1e4; the older
  ``rope_local_base_freq``) — ``ModelSpec.rope_theta`` / ``local_rope_theta``. Only default RoPE is
  implemented for either (Gemma-3-4B and larger scale the global one linearly: refused).

transformers has no ``Gemma3*ForTokenClassification``; the critic's HF class is meshrl's
``Gemma3TextForTokenClassification`` (``meshrl.models.hf_classes``: transformers' generic token-classification
head on ``Gemma3TextModel``, the same ``score`` layout as every other family).

The tiny model alternates sliding / full layers every other layer (HF's default is five sliding, one full).
"""

from meshrl.models.families import Family, Refusal
from meshrl.models.families.gemma import GEMMA_REFUSALS, TINY_SHAPE, activation_refusal
from meshrl.models.families.gemma2 import LAYER_TYPES, gemma2_fields, layer_types_refusal


def _rope(hf_config, layer_type: str) -> dict:
    return (getattr(hf_config, "rope_parameters", None) or {}).get(layer_type) or {}


def _rope_types(hf_config) -> dict:
    return {t: _rope(hf_config, t).get("rope_type", "default") for t in LAYER_TYPES}


def gemma3_fields(hf_config) -> dict:
    """Gemma 2's fields plus q/k norms and the per-layer-type RoPE bases."""
    return dict(gemma2_fields(hf_config), rope_theta=_rope(hf_config, "full_attention").get("rope_theta"),
                local_rope_theta=_rope(hf_config, "sliding_attention").get("rope_theta"))


FAMILY = Family(
    model_type="gemma3_text",
    hf_prefix="Gemma3",
    config_name="Gemma3TextConfig",
    critic_name="Gemma3TextForTokenClassification",
    qk_norm=True,
    activation_refusal=activation_refusal("hidden_activation"),
    refusals=GEMMA_REFUSALS + (
        layer_types_refusal(),
        Refusal("rope_parameters", lambda v, c: set(v.values()) == {"default"},
                "only 'default' RoPE is implemented for each layer type (no linear / yarn / ... scaling of "
                "full_attention or sliding_attention)", read=_rope_types),
    ),
    spec_fields=gemma3_fields,
    tiny_shape=dict(TINY_SHAPE, rope_theta=1000000.0),
    tiny_config=dict(hidden_activation="gelu_pytorch_tanh", attention_bias=False, query_pre_attn_scalar=32,
                     final_logit_softcapping=3.0, sliding_window=4, sliding_window_pattern=2,
                     rope_local_base_freq=10000.0),
)
