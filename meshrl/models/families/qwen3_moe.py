"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (q/k RMSNorm, its own head_dim, no bias) with
a mixture-of-experts MLP in every layer and no shared expert: a softmax router, the top ``num_experts_per_tok``
probabilities renormalised (``norm_topk_prob``, true in the released models). Refusals as Qwen2-MoE's
(``qwen2_moe.MOE_REFUSALS``) plus Qwen3's attention bias."""

from meshrl.models.families import Family, Refusal
from meshrl.models.families.qwen2_moe import MOE_REFUSALS, TINY_MOE, qwen_moe_fields

FAMILY = Family(
    model_type="qwen3_moe",
    hf_prefix="Qwen3Moe",
    qk_norm=True,
    refusals=MOE_REFUSALS + (
        Refusal("attention_bias", lambda v, c: not v, "Qwen3-MoE with q/k/v/o biases is not implemented"),
    ),
    spec_fields=lambda c: qwen_moe_fields(c, shared_expert=False),
    tiny_shape=dict(norm_scale=0.1),
    tiny_config=dict(TINY_MOE, norm_topk_prob=True, attention_bias=False),
)
