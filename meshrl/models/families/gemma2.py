"""Gemma 2: Gemma's decoder (zero-centred norms, GeGLU, scaled embeddings) plus

- four norms per layer: HF's ``input_layernorm`` (before attention), ``post_attention_layernorm`` (on the
  attention output, before the residual add), ``pre_feedforward_layernorm`` (before the MLP) and
  ``post_feedforward_layernorm`` (on the MLP output) — ``ModelSpec.post_norms``;
- attention scores scaled by ``query_pre_attn_scalar ** -0.5`` instead of ``head_dim ** -0.5``;
- attention logit soft-capping (``attn_logit_softcapping``) and final logit soft-capping
  (``final_logit_softcapping``): ``c * tanh(x / c)``;
- alternating sliding-window / global layers (``layer_types``; window ``sliding_window``), one RoPE base.

The tiny model keeps them at a size where they bite: window 4 (the test sequences are up to 16 tokens), caps
near the tiny model's score and logit magnitudes, a pre-attention scalar unlike head_dim.
"""

from meshrl.models.families import Family, Refusal
from meshrl.models.families.gemma import GEMMA_REFUSALS, TINY_SHAPE, activation_refusal, gemma_fields

LAYER_TYPES = ("sliding_attention", "full_attention")


def layer_types_refusal() -> Refusal:
    return Refusal("layer_types", lambda v, c: v is None or set(v) <= set(LAYER_TYPES),
                   f"meshrl builds {' and '.join(LAYER_TYPES)} layers only")


def gemma2_fields(hf_config) -> dict:
    """Gemma's fields plus post norms, the pre-attention scalar, soft-capping and the sliding layers."""
    window = hf_config.sliding_window
    types = hf_config.layer_types or ()
    return dict(gemma_fields(hf_config), post_norms=True,
                softmax_scale=float(hf_config.query_pre_attn_scalar) ** -0.5,
                attn_logit_softcap=_cap(hf_config.attn_logit_softcapping),
                final_logit_softcap=_cap(hf_config.final_logit_softcapping),
                sliding_window=window,
                sliding_layers=tuple(i for i, t in enumerate(types) if t == "sliding_attention") if window else ())


def _cap(value) -> float | None:
    return None if value is None else float(value)


FAMILY = Family(
    model_type="gemma2",
    hf_prefix="Gemma2",
    activation_refusal=activation_refusal("hidden_activation"),
    refusals=GEMMA_REFUSALS + (layer_types_refusal(),),
    spec_fields=gemma2_fields,
    tiny_shape=TINY_SHAPE,
    tiny_config=dict(hidden_activation="gelu_pytorch_tanh", attention_bias=False, query_pre_attn_scalar=32,
                     attn_logit_softcapping=2.0, final_logit_softcapping=3.0, sliding_window=4),
)
