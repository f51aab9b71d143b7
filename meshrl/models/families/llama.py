"""Llama (and Llama-shaped models: SmolLM2, DeepSeek-LLM): GQA, SwiGLU, RMSNorm, no biases."""

from meshrl.models.families import Family, Refusal

FAMILY = Family(
    model_type="llama",
    hf_prefix="Llama",
    refusals=(
        Refusal("attention_bias", lambda v, c: not v, "Llama with q/k/v/o biases is not implemented"),
        Refusal("mlp_bias", lambda v, c: not v, "Llama with MLP biases is not implemented"),
    ),
    tiny_config=dict(attention_bias=False, mlp_bias=False),
)
