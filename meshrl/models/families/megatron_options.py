"""megatron-core options of a ``ModelSpec``: the ``TransformerConfig`` fields and the layer-spec arguments that
build its structure (``meshrl.parallel.model_builder`` applies them)."""

from __future__ import annotations

from typing import Any

from meshrl.models.families.spec import ModelSpec


def gelu_tanh(x):
    """GELU with the tanh approximation: HF's ``gelu_pytorch_tanh``."""
    import torch.nn.functional as F

    return F.gelu(x, approximate="tanh")


def transformer_options(spec: ModelSpec) -> dict[str, Any]:
    """megatron-core ``TransformerConfig`` options of the spec's structure: RMSNorm (zero-centred gamma or
    not), a gated MLP with SiLU or tanh-GELU, no bias except the family's QKV bias, q/k RMSNorm (eps
    ``rms_norm_eps``, as HF's q_norm / k_norm), the softmax scale, and the sliding-window layers
    (``window_size=(window - 1, 0)``: ``window`` keys including the query's own; ``window_attn_skip_freq``
    as a per-layer list, 1 = windowed), interleaved RoPE pairs (``rotary_interleaved``; the rotated fraction of
    each head is ``GPTModel``'s ``rotary_percent``, set by ``meshrl.parallel.model_builder``), M-RoPE's sections."""
    import torch.nn.functional as F

    options = dict(normalization="RMSNorm", layernorm_epsilon=spec.rms_norm_eps, gated_linear_unit=True,
                   activation_func=F.silu if spec.activation == "silu" else gelu_tanh, add_bias_linear=False,
                   add_qkv_bias=spec.qkv_bias, qk_layernorm=spec.qk_norm,
                   layernorm_zero_centered_gamma=spec.zero_centered_norms, softmax_scale=spec.softmax_scale,
                   rotary_interleaved=spec.rotary_interleaved)
    if spec.mrope_section:  # GPTModel's position_embedding_type "mrope" (meshrl.parallel.model_builder) reads it
        options.update(mrope_section=list(spec.mrope_section))
    if spec.sliding_window is not None:
        options.update(window_size=(spec.sliding_window - 1, 0),
                       window_attn_skip_freq=[int(i in spec.sliding_layers) for i in range(spec.num_layers)])
    if spec.moe:
        # Softmax then top-k (pre_softmax) keeps the probabilities as they are; top-k of the logits then a
        # softmax over those k equals softmax, top-k, renormalise. Sigmoid scores are always renormalised.
        options.update(num_moe_experts=spec.num_experts, moe_ffn_hidden_size=spec.moe_ffn_hidden_size,
                       moe_router_topk=spec.moe_topk, moe_router_score_function=spec.moe_score,
                       moe_router_pre_softmax=not spec.moe_norm_topk,
                       moe_router_enable_expert_bias=spec.moe_expert_bias, moe_router_num_groups=spec.moe_groups,
                       moe_router_group_topk=spec.moe_group_topk,
                       moe_router_topk_scaling_factor=spec.moe_scaling_factor,
                       moe_shared_expert_intermediate_size=spec.shared_expert_ffn_hidden_size,
                       moe_shared_expert_gate=spec.shared_expert_gate, moe_grouped_gemm=False)
        if spec.dense_layers:  # megatron's per-layer pattern: 0 dense, 1 MoE
            options["moe_layer_freq"] = [int(spec.moe_layer(i)) for i in range(spec.num_layers)]
    if spec.mla:
        # megatron's MLA de-interleaves the RoPE pairs itself (HF's rope_interleave)
        options.update(multi_latent_attention=True, q_lora_rank=spec.q_lora_rank, kv_lora_rank=spec.kv_lora_rank,
                       qk_head_dim=spec.qk_nope_head_dim, qk_pos_emb_head_dim=spec.qk_rope_head_dim,
                       v_head_dim=spec.v_head_dim, rope_type="yarn" if spec.yarn else "rope",
                       rotary_base=spec.rope_theta)
        if spec.yarn:
            factor, original, fast, slow, mscale, mscale_all_dim = spec.yarn
            options.update(rotary_scaling_factor=factor, original_max_position_embeddings=int(original),
                           beta_fast=fast, beta_slow=slow, mscale=mscale, mscale_all_dim=mscale_all_dim)
    return options


def layer_spec_options(spec: ModelSpec) -> dict[str, Any]:
    """Arguments of megatron's ``get_gpt_layer_local_spec`` / ``get_gpt_layer_with_transformer_engine_spec``:
    both build ``q_layernorm`` / ``k_layernorm`` (torch RMSNorm / TE's ``TENorm``, parameter ``weight``) only
    when asked, and an MoE layer (router, token dispatcher, one ``SequentialMLP`` of per-expert MLPs: grouped
    GEMMs need CUDA kernels) when given ``num_experts`` (a model with ``dense_layers`` also builds the dense
    layer spec: ``num_experts`` dropped). MLA layers: ``multi_latent_attention``, with the latent norms."""
    options: dict[str, Any] = dict(qk_layernorm=spec.qk_norm)
    if spec.moe:
        options.update(num_experts=spec.num_experts, moe_grouped_gemm=False)
    if spec.mla:  # MLA's latent norms (q_layernorm on the q latent, kv_layernorm) come with qk_layernorm
        options.update(multi_latent_attention=True, qk_layernorm=True)
    return options
