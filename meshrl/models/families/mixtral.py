"""Mixtral (8x7B, 8x22B): Mistral's attention with a mixture of ``num_local_experts`` experts of width
``intermediate_size`` in every layer; the router's softmax over the top ``num_experts_per_tok`` logits weights
them (softmax, top-k, renormalise). The checkpoint names them ``block_sparse_moe.gate`` (router) and
``block_sparse_moe.experts.N.w1 / w3 / w2`` (gate / up / down). Refused: a window that slides (as Mistral's),
router jitter noise (a training-time perturbation meshrl does not apply) and HF's own load-balancing loss."""

from meshrl.models.families import Family, Refusal
from meshrl.models.families.mistral import FAMILY as MISTRAL
from meshrl.models.families.qwen2_moe import MOE_REFUSALS


def mixtral_fields(hf_config) -> dict:
    return dict(num_experts=hf_config.num_local_experts, moe_ffn_hidden_size=hf_config.intermediate_size,
                moe_topk=hf_config.num_experts_per_tok, moe_norm_topk=True, expert_names="mixtral")


FAMILY = Family(
    model_type="mixtral",
    hf_prefix="Mixtral",
    refusals=MISTRAL.refusals + tuple(r for r in MOE_REFUSALS if r.field == "output_router_logits") + (
        Refusal("router_jitter_noise", lambda v, c: not v,
                "router jitter noise is not implemented; set it to 0.0"),
    ),
    spec_fields=mixtral_fields,
    tiny_shape=dict(tie_word_embeddings=False, norm_scale=0.1),
    tiny_config=dict(sliding_window=None, num_local_experts=8, num_experts_per_tok=2, router_jitter_noise=0.0,
                     output_router_logits=False),
)
