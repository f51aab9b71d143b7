"""Qwen2 / Qwen2.5: Llama's layer with biases on the q/k/v projections; head_dim = hidden / heads."""

from meshrl.models.families import Family, Refusal

FAMILY = Family(
    model_type="qwen2",
    hf_prefix="Qwen2",
    qkv_bias=True,
    refusals=(
        Refusal("use_sliding_window", lambda v, c: not v,
                "sliding-window attention is not implemented in meshrl yet; set it to false"),
    ),
    derives_head_dim=True,
    tiny_shape=dict(hidden_size=256, tie_word_embeddings=False),
    tiny_config=dict(use_sliding_window=False),
)
