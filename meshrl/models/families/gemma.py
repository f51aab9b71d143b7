"""Gemma (1): Llama's decoder with three differences, and the helpers Gemma 2 / 3 share.

- RMSNorm gammas are stored zero-centred: HF's ``GemmaRMSNorm`` scales by ``1 + w`` (megatron-core's
  ``layernorm_zero_centered_gamma``). megatron's local-spec torch norm refuses that option, so meshrl's CPU
  spec uses ``meshrl.parallel.layers.RMSNorm``, which honours it; the checkpoint's ``w`` is loaded as is (no
  ``w + 1`` conversion, so export is bit-exact and a bf16 gamma keeps its precision near 0).
- GeGLU: the gated MLP's activation is tanh-GELU (HF ``hidden_act`` ``gelu_pytorch_tanh``).
- The embeddings are multiplied by ``sqrt(hidden_size)`` rounded to the model's dtype (HF's ``normalizer``).

head_dim is its own field (Gemma-7B: 16 heads x 256 on 3072), embeddings are tied.
"""

from meshrl.models.families import ACTIVATIONS, Family, Refusal

GELU_TANH = ACTIVATIONS["gelu_tanh"]


def activation_refusal(field: str) -> Refusal:
    """Only tanh-GELU, read from ``field`` (Gemma 1 ``hidden_act``, Gemma 2 / 3 ``hidden_activation``)."""
    return Refusal(field, lambda v, c: v in GELU_TANH,
                   f"meshrl implements Gemma's GeGLU with {' / '.join(GELU_TANH)} only")


# Refused by every Gemma generation.
GEMMA_REFUSALS = (
    Refusal("attention_bias", lambda v, c: not v, "Gemma with q/k/v/o biases is not implemented"),
    Refusal("use_bidirectional_attention", lambda v, c: not v,
            "bidirectional (encoder) attention is not implemented; meshrl trains causal decoders"),
)


def gemma_fields(hf_config) -> dict:
    """The ``ModelSpec`` fields every Gemma generation sets."""
    return dict(activation="gelu_tanh", zero_centered_norms=True, embedding_scale=True)


# The tiny models draw the zero-centred gammas around 0 (scale 1 + w around 1), so a norm mix-up shows.
TINY_SHAPE = dict(norm_scale=0.1)

FAMILY = Family(
    model_type="gemma",
    hf_prefix="Gemma",
    activation_refusal=activation_refusal("hidden_act"),
    refusals=GEMMA_REFUSALS,
    spec_fields=gemma_fields,
    tiny_shape=TINY_SHAPE,
    tiny_config=dict(hidden_act="gelu_pytorch_tanh", attention_bias=False),
)
