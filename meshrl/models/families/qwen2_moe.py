"""Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Qwen2's attention (QKV bias) with a mixture-of-experts MLP in
every layer: a softmax router over ``num_experts`` experts of width ``moe_intermediate_size``, the top
``num_experts_per_tok`` probabilities renormalised when ``norm_topk_prob`` (Qwen1.5-MoE: not), plus a shared
expert of width ``shared_expert_intermediate_size`` that every token runs, scaled by ``sigmoid(shared_expert_gate)``.

Refused: dense layers among the MoE ones (``mlp_only_layers``, ``decoder_sparse_step`` > 1), sliding windows, and
HF's own training-time load-balancing loss (``output_router_logits``): meshrl's comes from megatron's router,
set by verl's ``megatron.override_transformer_config.moe_aux_loss_coeff``. ``router_aux_loss_coef`` is read by
nothing: as in verl, the load-balancing loss is off unless ``moe_router_load_balancing_type`` turns it on.

The tiny model keeps every feature at a size where routing matters: 8 experts, top 2, a shared expert wider
than the routed ones, and norm gammas around 1.
"""

from meshrl.models.families import Family, Refusal

MOE_REFUSALS = (
    Refusal("mlp_only_layers", lambda v, c: not v,
            "dense MLP layers among the MoE layers are not implemented; every layer must be an MoE layer"),
    Refusal("decoder_sparse_step", lambda v, c: v in (None, 1),
            "an MoE layer every n-th layer is not implemented; every layer must be an MoE layer (step 1)"),
    Refusal("output_router_logits", lambda v, c: not v,
            "HF's load-balancing loss is not used; set it to false and give the loss through "
            "megatron.override_transformer_config.moe_router_load_balancing_type / moe_aux_loss_coeff (verl's keys)"),
    Refusal("use_sliding_window", lambda v, c: not v,
            "sliding-window attention is not implemented in meshrl yet; set it to false"),
)
# An HF config of these families holds the MoE sizes under these names; the tiny models' values.
TINY_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, output_router_logits=False,
                mlp_only_layers=[], decoder_sparse_step=1, use_sliding_window=False)


def qwen_moe_fields(hf_config, shared_expert: bool) -> dict:
    """The MoE fields of a Qwen-MoE config (Qwen2-MoE's shared expert and its gate when ``shared_expert``)."""
    fields = dict(num_experts=hf_config.num_experts, moe_ffn_hidden_size=hf_config.moe_intermediate_size,
                  moe_topk=hf_config.num_experts_per_tok, moe_norm_topk=bool(hf_config.norm_topk_prob),
                  expert_names="qwen")
    if shared_expert:
        fields.update(shared_expert_ffn_hidden_size=hf_config.shared_expert_intermediate_size, shared_expert_gate=True)
    return fields


FAMILY = Family(
    model_type="qwen2_moe",
    hf_prefix="Qwen2Moe",
    qkv_bias=True,
    refusals=MOE_REFUSALS + (
        Refusal("qkv_bias", lambda v, c: v in (None, True), "Qwen2-MoE without q/k/v biases is not implemented"),
    ),
    spec_fields=lambda c: qwen_moe_fields(c, shared_expert=True),
    derives_head_dim=True,
    tiny_shape=dict(hidden_size=256, tie_word_embeddings=False, norm_scale=0.1),
    tiny_config=dict(TINY_MOE, shared_expert_intermediate_size=192, norm_topk_prob=False),
)
