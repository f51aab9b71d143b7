"""Activations saved for the backward, per token and layer, and the experts' all-to-all volume."""

from __future__ import annotations


def all_to_all_bytes_per_token(spec, ep: int, act_bytes: int) -> float:
    """Bytes one token's MoE layers send to other expert-parallel ranks in one forward pass: the dispatch and the
    combine all-to-all each move the token's ``moe_topk`` hidden-state copies, of which ``(ep - 1) / ep`` land on
    another rank under balanced routing (twice that for a forward plus backward)."""
    if not spec.moe:
        return 0.0
    moe_layers = sum(spec.moe_layer(i) for i in range(spec.num_layers))
    return moe_layers * 2 * spec.moe_topk * spec.hidden_size * act_bytes * (ep - 1) / ep


def activation_bytes_per_token(spec, tp: int, act_bytes: int, sequence_parallel: bool = False, cp: int = 1) -> int:
    """Bytes one layer keeps for its backward, per token of the rank (see the module docstring); ``sequence_parallel``
    splits the ``4h`` replicated part over TP as well. Under context parallelism (``cp`` > 1) attention keeps the keys
    and values gathered over the CP group: each rank's ``2·kv`` per token becomes ``2·kv·cp``."""
    h, f = spec.hidden_size, mlp_width(spec)
    q, kv = spec.num_attention_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    split = 2 * q + 2 * kv * cp + 4 * f
    replicated = 4 * h
    if spec.qk_norm:  # the q/k layernorms' inputs
        split += q + kv
    if spec.mla:  # queries and keys of nope + rope dims, values and outputs of v_head_dim, per head; the latents
        # (the gathered kv down projection, its norm's output, the q latent and its norm's output) whole on each rank
        qk = spec.num_attention_heads * (spec.qk_nope_head_dim + spec.qk_rope_head_dim)
        split = 2 * qk + 2 * spec.num_attention_heads * spec.v_head_dim + 4 * f
        replicated += 2 * spec.kv_lora_rank + spec.qk_rope_head_dim + 2 * (spec.q_lora_rank or 0)
    if sequence_parallel:
        return act_bytes * ((replicated + split) // tp)
    return act_bytes * (replicated + split // tp)


def mlp_width(spec) -> int:
    """The SwiGLU width one token runs through in a layer: the dense MLP's, or an MoE layer's ``moe_topk`` routed
    experts plus its shared expert (the dispatched copies of the hidden state are counted in the all-to-all)."""
    if not spec.moe:
        return spec.ffn_hidden_size
    return spec.moe_topk * spec.moe_ffn_hidden_size + (spec.shared_expert_ffn_hidden_size or 0)
