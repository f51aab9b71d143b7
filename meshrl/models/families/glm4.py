"""GLM-4 (GLM-4-9B-0414, GLM-Z1): a Llama-like decoder with

- q/k/v biases (``attention_bias``; o_proj has none);
- four norms per layer like Gemma 2, under GLM's names (``ModelSpec.post_norm_names`` "glm4"):
  ``post_self_attn_layernorm`` on the attention output and ``post_mlp_layernorm`` on the MLP output, before each
  residual add, and ``post_attention_layernorm`` as the MLP's input norm; plain (not zero-centred) RMSNorms;
- RoPE on the first half of each head (``partial_rotary_factor`` 0.5: megatron's ``rotary_percent``) with
  adjacent pairs rotated together (megatron's ``rotary_interleaved``);
- a fused ``gate_up_proj`` HF tensor ([gate; up] rows, ``ModelSpec.hf_fused``).

The tiny model keeps all of it (bias, half rotary, interleaving, the four norms at distinguishable scales).
"""

from meshrl.models.families import Family, Refusal


def glm4_fields(hf_config) -> dict:
    params = getattr(hf_config, "rope_parameters", None) or {}
    fraction = params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", 1.0))
    return dict(post_norms=True, post_norm_names="glm4", hf_fused=("gate_up",), rotary_fraction=float(fraction),
                rotary_interleaved=True)


def _rotary_fraction(hf_config):
    params = getattr(hf_config, "rope_parameters", None) or {}
    return params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", None))


FAMILY = Family(
    model_type="glm4",
    hf_prefix="Glm4",
    qkv_bias=True,
    refusals=(
        Refusal("attention_bias", lambda v, c: v is True, "GLM-4 without q/k/v biases is not implemented"),
        # megatron's rotary_percent needs a whole number of rotated pairs per head
        Refusal("partial_rotary_factor", lambda v, c: v is not None and 0 < v <= 1
                and (getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads) * v % 2 == 0,
                "RoPE on a fraction of each head that is an even number of dimensions only", read=_rotary_fraction),
    ),
    lifts=("partial_rotary_factor",),
    spec_fields=glm4_fields,
    tiny_shape=dict(tie_word_embeddings=False, norm_scale=0.1),
    tiny_config=dict(attention_bias=True, partial_rotary_factor=0.5, pad_token_id=0),
)
