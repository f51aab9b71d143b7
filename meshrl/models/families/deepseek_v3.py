"""DeepSeek-V3 (DeepSeek-V3 / R1, Moonlight-16B-A3B; transformers' ``DeepseekV3ForCausalLM``): multi-latent attention
(``ModelSpec.kv_lora_rank``: queries straight from the hidden state when ``q_lora_rank`` is null, as in Moonlight,
or through a normed latent of width ``q_lora_rank``) and a mixture of ``n_routed_experts`` SwiGLU experts of width
``moe_intermediate_size`` in every layer from ``first_k_dense_replace`` on (the first ones have a dense MLP of width
``intermediate_size``), with ``n_shared_experts`` shared experts (one SwiGLU of their total width, ungated). The
router scores experts with a sigmoid, picks the top ``num_experts_per_tok`` of ``score + e_score_correction_bias``
within the ``topk_group`` best of ``n_group`` groups, weights them by their scores renormalised
(``norm_topk_prob``) times ``routed_scaling_factor``: megatron's sigmoid router with ``moe_router_enable_expert_bias``,
``moe_router_num_groups``, ``moe_router_group_topk`` and ``moe_router_topk_scaling_factor``. As in verl (and
megatron), the expert bias moves after each update by ``moe_router_bias_update_rate`` (megatron's default 1e-3,
verl's ``override_transformer_config`` key) towards balanced loads, and is exported with the weights.

Refused, each with what megatron-core 0.16.1 or vLLM does otherwise:

- RoPE scaling other than YaRN (DeepSeek-V3's; Moonlight has none), and YaRN settings megatron's MLA YaRN would
  compute otherwise than transformers: an explicit ``attention_factor``, ``truncate`` false, ``mscale_all_dim``
  without ``mscale`` (transformers then scales cos / sin by ``m(1)``, megatron by ``m(1) / m(mscale_all_dim)``), no
  ``original_max_position_embeddings``. transformers ignores ``mscale`` without ``mscale_all_dim``; so does meshrl
  (``ModelSpec.yarn`` gets 1 and 0).
- ``rope_interleave`` false: megatron's MLA always rotates adjacent pairs (and vLLM's DeepSeek code too).
- ``norm_topk_prob`` false: megatron renormalises sigmoid top-k weights always (``topk_routing_with_score_function``).
- grouped routing whose ``num_experts_per_tok // topk_group`` is not 2: megatron scores a group by the sum of its top
  ``topk // group_topk`` experts, transformers (and DeepSeek) by its top 2.
- ``scoring_func`` other than sigmoid and ``topk_method`` other than noaux_tc: transformers' class routes that way
  whatever they say, vLLM by what they say (its default is softmax without the bias). The released configs hold
  sigmoid / noaux_tc; a config transformers wrote (``DeepseekV3Config`` has neither field) means what transformers
  computes, and vLLM and the HF export are told so explicitly (``implicit_fields``).
- ``num_key_value_heads`` other than ``num_attention_heads`` (MLA has no grouped keys), ``attention_bias`` and HF's
  own load-balancing loss.

Taken with a note: multi-token-prediction layers (``num_nextn_predict_layers`` > 0, as DeepSeek-V3 ships one). The
policy is the main layers, as transformers' class and vLLM without speculative decoding run it (both skip the MTP
layer's weights, ``model.layers.{num_hidden_layers}.*``); the MTP layer is neither trained nor synced (verl trains it
only in its MTP trainer, whose keys meshrl refuses), and an HF export holds none (its config says 0).

Not refused, said here: the latent norms (``q_a_layernorm``, ``kv_a_layernorm``) normalise with ``rms_norm_eps`` in
megatron (``layernorm_epsilon``, as verl builds them) and in vLLM, but with 1e-6 in transformers' class and
DeepSeek's reference code. Equal for DeepSeek-V3 (1e-6); Moonlight's 1e-5 makes transformers' log-probs differ from
the trainer's and the engine's by about 1e-5 (tiny model at 1e-5: 1.1e-5), while trainer and engine agree.
"""

from meshrl.models.families import Family, Refusal, _rope_type
from meshrl.models.families.qwen2_moe import MOE_REFUSALS


def _rope_parameters(hf_config) -> dict:
    return getattr(hf_config, "rope_parameters", None) or {}


def yarn_values(hf_config) -> tuple[float, ...]:
    """``ModelSpec.yarn`` of the config (empty without YaRN), in ``YARN_FIELDS``' order, as transformers reads them."""
    params = _rope_parameters(hf_config)
    if _rope_type(hf_config) != "yarn":
        return ()
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if not (mscale and mscale_all_dim):  # transformers' cos / sin factor is then m(1), its score factor 1
        mscale, mscale_all_dim = 1.0, 0.0
    return (float(params["factor"]), float(params["original_max_position_embeddings"]),
            float(params.get("beta_fast") or 32), float(params.get("beta_slow") or 1), float(mscale),
            float(mscale_all_dim))


def _rope_supported(rope_type, c) -> bool:
    if rope_type == "default":
        return True
    params = _rope_parameters(c)
    return (rope_type == "yarn" and params.get("attention_factor") is None and params.get("truncate", True)
            and params.get("original_max_position_embeddings") is not None
            and (bool(params.get("mscale")) or not params.get("mscale_all_dim")))


def deepseek_v3_fields(hf_config) -> dict:
    groups, group_topk = hf_config.n_group or 1, hf_config.topk_group or 1
    scaling = hf_config.routed_scaling_factor
    return dict(
        num_experts=hf_config.n_routed_experts, moe_ffn_hidden_size=hf_config.moe_intermediate_size,
        moe_topk=hf_config.num_experts_per_tok, moe_norm_topk=True, expert_names="deepseek",
        shared_expert_ffn_hidden_size=(hf_config.n_shared_experts or 0) * hf_config.moe_intermediate_size or None,
        dense_layers=min(hf_config.first_k_dense_replace or 0, hf_config.num_hidden_layers),
        moe_score="sigmoid", moe_expert_bias=True,
        # one group, or every group chosen, routes as no grouping does
        moe_groups=groups if group_topk < groups else None, moe_group_topk=group_topk if group_topk < groups else None,
        moe_scaling_factor=None if scaling in (None, 1, 1.0) else float(scaling),
        q_lora_rank=hf_config.q_lora_rank, kv_lora_rank=hf_config.kv_lora_rank,
        qk_nope_head_dim=hf_config.qk_nope_head_dim, qk_rope_head_dim=hf_config.qk_rope_head_dim,
        v_head_dim=hf_config.v_head_dim, yarn=yarn_values(hf_config))


# What transformers' DeepseekV3 computes whatever the config says, and vLLM only when it says so (module docstring).
ROUTING = {"scoring_func": "sigmoid", "topk_method": "noaux_tc"}


def implicit_fields(hf_config) -> dict:
    """The routing fields the config leaves out, as transformers computes them; and no MTP layers in an export."""
    fields = {key: value for key, value in ROUTING.items() if getattr(hf_config, key, None) is None}
    if getattr(hf_config, "num_nextn_predict_layers", None):
        fields["num_nextn_predict_layers"] = 0
    return fields


def config_notes(hf_config) -> list[str]:
    layers = getattr(hf_config, "num_nextn_predict_layers", None)
    if not layers:
        return []
    return [f"num_nextn_predict_layers={layers}: the checkpoint's multi-token-prediction layer(s) are neither trained "
            f"nor synced; the policy is its {hf_config.num_hidden_layers} main layers, as transformers and vLLM "
            "without speculative decoding run it (verl trains MTP only in its MTP trainer); an HF export holds none"]


def _grouping_supported(topk_group, c) -> bool:
    groups = c.n_group or 1
    if c.n_routed_experts % groups:
        return False
    return (topk_group or 1) >= groups or c.num_experts_per_tok // (topk_group or 1) == 2


FAMILY = Family(
    model_type="deepseek_v3",
    hf_prefix="DeepseekV3",
    refusals=tuple(r for r in MOE_REFUSALS if r.field == "output_router_logits") + (
        Refusal("rope_type", _rope_supported,
                "only plain RoPE and YaRN as megatron's multi-latent attention computes it: no attention_factor, "
                "truncate true, original_max_position_embeddings set, mscale_all_dim only with mscale",
                read=_rope_type),
        Refusal("rope_interleave", lambda v, c: v in (None, True),
                "megatron's multi-latent attention rotates adjacent RoPE pairs only (rope_interleave true)"),
        Refusal("norm_topk_prob", lambda v, c: v in (None, True) or c.num_experts_per_tok == 1,
                "megatron renormalises the top-k sigmoid scores always; norm_topk_prob false is not implemented"),
        Refusal("topk_group", _grouping_supported,
                "megatron's group-limited routing scores a group by its top num_experts_per_tok // topk_group "
                "experts, transformers' by its top 2 (and n_group must divide n_routed_experts); only configs where "
                "both agree (num_experts_per_tok // topk_group == 2, or topk_group >= n_group) are implemented"),
        Refusal("scoring_func", lambda v, c: v in (None, "sigmoid"),
                "transformers' DeepseekV3 scores experts with a sigmoid whatever this says, vLLM by this field "
                "(default softmax); set scoring_func: sigmoid in config.json, as the released models have"),
        Refusal("topk_method", lambda v, c: v in (None, "noaux_tc"),
                "transformers' DeepseekV3 adds e_score_correction_bias before the top-k whatever this says, vLLM only "
                "with noaux_tc; set topk_method: noaux_tc in config.json, as the released models have"),
        Refusal("num_key_value_heads", lambda v, c: v in (None, c.num_attention_heads),
                "multi-latent attention has one key/value per query head; set it to num_attention_heads"),
        Refusal("attention_bias", lambda v, c: not v, "DeepSeek-V3 with attention biases is not implemented"),
    ),
    implicit_fields=implicit_fields,
    config_notes=config_notes,
    lifts=("rope_type",),
    spec_fields=deepseek_v3_fields,
    # kv_lora_rank 512 / qk_rope_head_dim 64: the only latent vLLM's CPU MLA kernel serves (576 = 512 + 64).
    # rms_norm_eps 1e-6 (DeepSeek-V3's): transformers builds the latent norms with eps 1e-6 whatever rms_norm_eps
    # says, megatron and vLLM with rms_norm_eps (see the module docstring)
    tiny_shape=dict(num_key_value_heads=4, tie_word_embeddings=False, norm_scale=0.1, rms_norm_eps=1e-6),
    tiny_config=dict(moe_intermediate_size=64, n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=2,
                     n_group=2, topk_group=1, routed_scaling_factor=2.5, first_k_dense_replace=1, norm_topk_prob=True,
                     q_lora_rank=32, kv_lora_rank=512, qk_nope_head_dim=64, qk_rope_head_dim=64, v_head_dim=64,
                     rope_interleave=True, scoring_func="sigmoid", topk_method="noaux_tc", output_router_logits=False,
                     num_nextn_predict_layers=0, attention_bias=False),
    tiny_buffers=("e_score_correction_bias",),
)
