"""Qwen3 (dense): Llama's layer without QKV bias, plus an RMSNorm over head_dim of every query and key head
before RoPE (HF ``self_attn.q_norm`` / ``k_norm``, megatron ``qk_layernorm``); head_dim is its own field
(Qwen3-0.6B: 16 heads x 128 = 2048 on a 1024-wide residual stream).

The tiny model keeps that: 4 heads x 64 = 256 on a width of 128, tied embeddings as Qwen3-0.6B..4B, and
norm gammas drawn around 1, so that a q_norm / k_norm mix-up shows."""

from meshrl.models.families import Family, Refusal

FAMILY = Family(
    model_type="qwen3",
    hf_prefix="Qwen3",
    qk_norm=True,
    refusals=(
        # HF puts the bias on o_proj too, which megatron's add_qkv_bias does not cover
        Refusal("attention_bias", lambda v, c: not v, "Qwen3 with q/k/v/o biases is not implemented"),
        Refusal("use_sliding_window", lambda v, c: not v,
                "sliding-window attention is not implemented in meshrl yet; set it to false"),
    ),
    tiny_shape=dict(norm_scale=0.1),
    tiny_config=dict(attention_bias=False, use_sliding_window=False),
)
