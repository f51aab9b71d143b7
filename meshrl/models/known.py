"""Architecture configs of the hub models meshrl's recipes and verl's example scripts name, so that
``meshrl plan`` needs no download.

Source: each model's ``config.json`` on the Hugging Face hub, copied by hand (only the fields that differ
from the family's transformers config defaults or that meshrl reads). ``tests/launch/test_launch_plan.py``
checks every total against the parameter count the hub publishes for the checkpoint, which catches a
mistyped shape.
"""

from __future__ import annotations

from typing import Any

# Fields every KNOWN_MODELS entry of a model_type shares (its release's config.json), under the entry's own.
_SHARED: dict[str, dict[str, Any]] = {
    # Qwen2 / Qwen2.5: QKV bias, SwiGLU, RMSNorm eps 1e-6, rope_theta 1e6; the small ones tied.
    "qwen2": dict(rope_theta=1000000.0, rms_norm_eps=1e-6, max_position_embeddings=32768, use_sliding_window=False),
    # Qwen3: Qwen2 without QKV bias, with per-head q/k RMSNorm and an explicit head_dim of 128.
    "qwen3": dict(rope_theta=1000000.0, rms_norm_eps=1e-6, max_position_embeddings=40960, head_dim=128,
                  vocab_size=151936, attention_bias=False, use_sliding_window=False),
    "llama": dict(rms_norm_eps=1e-6, attention_bias=False, mlp_bias=False),
    # Mistral v0.3: Llama's structure, no sliding window, 32768-token vocabulary.
    "mistral": dict(rope_theta=1000000.0, rms_norm_eps=1e-5, max_position_embeddings=32768, sliding_window=None,
                    vocab_size=32768, head_dim=128, tie_word_embeddings=False),
    # Gemma 2: 256k vocabulary (tied), head_dim 256, soft-capping, alternating 4096-token sliding window.
    "phi3": dict(resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0),
    "glm4": dict(attention_dropout=0.0),
    # Mixture-of-experts (every layer sparse): Qwen1.5-MoE (qwen2_moe: QKV bias, a gated shared expert,
    # unnormalised top-k weights), Qwen3-MoE (q/k norms, normalised top-k, no shared expert), Mixtral.
    "qwen2_moe": dict(rope_theta=1000000.0, rms_norm_eps=1e-6, max_position_embeddings=8192, vocab_size=151936,
                      tie_word_embeddings=False, decoder_sparse_step=1, norm_topk_prob=False, use_sliding_window=False),
    "qwen3_moe": dict(rope_theta=1000000.0, rms_norm_eps=1e-6, max_position_embeddings=40960, head_dim=128,
                      vocab_size=151936, attention_bias=False, tie_word_embeddings=False, decoder_sparse_step=1,
                      mlp_only_layers=[], norm_topk_prob=True, use_sliding_window=False),
    "mixtral": dict(rope_theta=1000000.0, rms_norm_eps=1e-5, max_position_embeddings=32768, vocab_size=32000,
                    sliding_window=None, tie_word_embeddings=False),
    "gemma2": dict(vocab_size=256000, head_dim=256, query_pre_attn_scalar=256, sliding_window=4096,
                   attn_logit_softcapping=50.0, final_logit_softcapping=30.0, max_position_embeddings=8192,
                   rope_theta=10000.0, rms_norm_eps=1e-6, hidden_activation="gelu_pytorch_tanh",
                   tie_word_embeddings=True),
}

KNOWN_MODELS: dict[str, dict[str, Any]] = {
    "Qwen/Qwen2.5-0.5B-Instruct": dict(model_type="qwen2", num_hidden_layers=24, hidden_size=896,
                                       num_attention_heads=14, num_key_value_heads=2, intermediate_size=4864,
                                       vocab_size=151936, tie_word_embeddings=True),
    "Qwen/Qwen2.5-1.5B-Instruct": dict(model_type="qwen2", num_hidden_layers=28, hidden_size=1536,
                                       num_attention_heads=12, num_key_value_heads=2, intermediate_size=8960,
                                       vocab_size=151936, tie_word_embeddings=True),
    "Qwen/Qwen2.5-3B-Instruct": dict(model_type="qwen2", num_hidden_layers=36, hidden_size=2048,
                                     num_attention_heads=16, num_key_value_heads=2, intermediate_size=11008,
                                     vocab_size=151936, tie_word_embeddings=True),
    "Qwen/Qwen2.5-7B-Instruct": dict(model_type="qwen2", num_hidden_layers=28, hidden_size=3584,
                                     num_attention_heads=28, num_key_value_heads=4, intermediate_size=18944,
                                     vocab_size=152064, tie_word_embeddings=False),
    "Qwen/Qwen2.5-14B-Instruct": dict(model_type="qwen2", num_hidden_layers=48, hidden_size=5120,
                                      num_attention_heads=40, num_key_value_heads=8, intermediate_size=13824,
                                      vocab_size=152064, tie_word_embeddings=False),
    "Qwen/Qwen2.5-32B-Instruct": dict(model_type="qwen2", num_hidden_layers=64, hidden_size=5120,
                                      num_attention_heads=40, num_key_value_heads=8, intermediate_size=27648,
                                      vocab_size=152064, tie_word_embeddings=False),
    "Qwen/Qwen2.5-72B-Instruct": dict(model_type="qwen2", num_hidden_layers=80, hidden_size=8192,
                                      num_attention_heads=64, num_key_value_heads=8, intermediate_size=29568,
                                      vocab_size=152064, tie_word_embeddings=False),
    # Qwen2-7B has the Qwen2.5-7B shape.
    "Qwen/Qwen2-7B-Instruct": dict(model_type="qwen2", num_hidden_layers=28, hidden_size=3584,
                                   num_attention_heads=28, num_key_value_heads=4, intermediate_size=18944,
                                   vocab_size=152064, tie_word_embeddings=False),
    # deepseek-llm-7b is a Llama (no biases, full multi-head attention, rope_theta 1e4, 4k context).
    "deepseek-ai/deepseek-llm-7b-chat": dict(model_type="llama", num_hidden_layers=30, hidden_size=4096,
                                             num_attention_heads=32, num_key_value_heads=32,
                                             intermediate_size=11008, vocab_size=102400,
                                             tie_word_embeddings=False, rope_theta=10000.0,
                                             max_position_embeddings=4096),
    # Qwen3 (verl's run_qwen3-8b.sh and its 32B NPU twin)
    "Qwen/Qwen3-8B": dict(model_type="qwen3", num_hidden_layers=36, hidden_size=4096, num_attention_heads=32,
                          num_key_value_heads=8, intermediate_size=12288, tie_word_embeddings=False,
                          max_position_embeddings=40960),
    "Qwen/Qwen3-32B": dict(model_type="qwen3", num_hidden_layers=64, hidden_size=5120, num_attention_heads=64,
                           num_key_value_heads=8, intermediate_size=25600, tie_word_embeddings=False),
    # Gemma 2 (verl's run_gemma.sh trains gemma-2-2b-it)
    "google/gemma-2-2b-it": dict(model_type="gemma2", num_hidden_layers=26, hidden_size=2304,
                                 num_attention_heads=8, num_key_value_heads=4, intermediate_size=9216),
    "google/gemma-2-9b-it": dict(model_type="gemma2", num_hidden_layers=42, hidden_size=3584,
                                 num_attention_heads=16, num_key_value_heads=8, intermediate_size=14336),
    "mistralai/Mistral-7B-Instruct-v0.3": dict(model_type="mistral", num_hidden_layers=32, hidden_size=4096,
                                               num_attention_heads=32, num_key_value_heads=8,
                                               intermediate_size=14336),
    # Phi-3-mini: fused qkv / gate_up tensors, a 2047-token window over 4096 positions
    "microsoft/Phi-3-mini-4k-instruct": dict(model_type="phi3", num_hidden_layers=32, hidden_size=3072,
                                             num_attention_heads=32, num_key_value_heads=32, intermediate_size=8192,
                                             vocab_size=32064, max_position_embeddings=4096, sliding_window=2047,
                                             rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False),
    # GLM-4-9B-0414: q/k/v biases, half-head interleaved RoPE, four norms per layer, fused gate_up
    "THUDM/GLM-4-9B-0414": dict(model_type="glm4", num_hidden_layers=40, hidden_size=4096, num_attention_heads=32,
                                num_key_value_heads=2, head_dim=128, intermediate_size=13696, vocab_size=151552,
                                max_position_embeddings=32768, rope_theta=10000.0, partial_rotary_factor=0.5,
                                rms_norm_eps=1e-5, attention_bias=True, tie_word_embeddings=False),
    # MoE: the seed's script's model, Qwen3-30B-A3B and Mixtral-8x7B
    "Qwen/Qwen1.5-MoE-A2.7B": dict(model_type="qwen2_moe", num_hidden_layers=24, hidden_size=2048,
                                   num_attention_heads=16, num_key_value_heads=16, intermediate_size=5632,
                                   moe_intermediate_size=1408, shared_expert_intermediate_size=5632, num_experts=60,
                                   num_experts_per_tok=4),
    "Qwen/Qwen3-30B-A3B": dict(model_type="qwen3_moe", num_hidden_layers=48, hidden_size=2048, num_attention_heads=32,
                               num_key_value_heads=4, intermediate_size=6144, moe_intermediate_size=768,
                               num_experts=128, num_experts_per_tok=8),
    "mistralai/Mixtral-8x7B-Instruct-v0.1": dict(model_type="mixtral", num_hidden_layers=32, hidden_size=4096,
                                                 num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336,
                                                 num_local_experts=8, num_experts_per_tok=2),
    # DeepSeek-V3's architecture (verl's Moonlight scripts): multi-latent attention without a query latent
    # (q_lora_rank null), a dense first layer, 64 routed experts (top-6 by sigmoid scores plus the correction bias,
    # one group) and two shared ones, no RoPE scaling
    "moonshotai/Moonlight-16B-A3B": dict(model_type="deepseek_v3", num_hidden_layers=27, hidden_size=2048,
                                         num_attention_heads=16, num_key_value_heads=16, intermediate_size=11264,
                                         moe_intermediate_size=1408, n_routed_experts=64, n_shared_experts=2,
                                         num_experts_per_tok=6, n_group=1, topk_group=1, first_k_dense_replace=1,
                                         routed_scaling_factor=2.446, norm_topk_prob=True, scoring_func="sigmoid",
                                         topk_method="noaux_tc", q_lora_rank=None, kv_lora_rank=512,
                                         qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                                         vocab_size=163840, max_position_embeddings=8192, rope_theta=50000.0,
                                         rms_norm_eps=1e-5, tie_word_embeddings=False, num_nextn_predict_layers=0,
                                         attention_bias=False, rope_interleave=True),
    # DeepSeek-V3 itself: a query latent, 3 dense layers, 256 routed experts top-8 within 4 of 8 groups, YaRN. Its
    # config.json has num_nextn_predict_layers 1 (the multi-token-prediction layer, which meshrl does not train, as
    # verl: refused unless 0) and FP8 weights; this entry is the main model, the 671 B the paper counts
    "deepseek-ai/DeepSeek-V3": dict(model_type="deepseek_v3", num_hidden_layers=61, hidden_size=7168,
                                    num_attention_heads=128, num_key_value_heads=128, intermediate_size=18432,
                                    moe_intermediate_size=2048, n_routed_experts=256, n_shared_experts=1,
                                    num_experts_per_tok=8, n_group=8, topk_group=4, first_k_dense_replace=3,
                                    routed_scaling_factor=2.5, norm_topk_prob=True, scoring_func="sigmoid",
                                    topk_method="noaux_tc", q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                                    qk_rope_head_dim=64, v_head_dim=128, vocab_size=129280,
                                    max_position_embeddings=163840, rms_norm_eps=1e-6, tie_word_embeddings=False,
                                    num_nextn_predict_layers=0, attention_bias=False, rope_interleave=True,
                                    rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=40.0,
                                                         original_max_position_embeddings=4096, beta_fast=32.0,
                                                         beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)),
    # Vision-language (verl's geo3k scripts): the language model under text_config, the tower under vision_config
    "Qwen/Qwen2.5-VL-7B-Instruct": dict(
        model_type="qwen2_5_vl", tie_word_embeddings=False,
        text_config=dict(num_hidden_layers=28, hidden_size=3584, num_attention_heads=28, num_key_value_heads=4,
                         intermediate_size=18944, vocab_size=152064, rms_norm_eps=1e-6, max_position_embeddings=128000,
                         tie_word_embeddings=False, rope_scaling=dict(type="mrope", mrope_section=[16, 24, 24]),
                         rope_theta=1000000.0, use_sliding_window=False),
        vision_config=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                           fullatt_block_indexes=[7, 15, 23, 31])),
    "Qwen/Qwen3-VL-8B-Instruct": dict(
        model_type="qwen3_vl", tie_word_embeddings=False,
        text_config=dict(num_hidden_layers=36, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
                         head_dim=128, intermediate_size=12288, vocab_size=151936, rms_norm_eps=1e-6,
                         max_position_embeddings=262144, tie_word_embeddings=False,
                         rope_parameters=dict(rope_type="default", rope_theta=5000000.0, mrope_interleaved=True,
                                              mrope_section=[24, 20, 20])),
        vision_config=dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, out_hidden_size=4096,
                           patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=2304,
                           deepstack_visual_indexes=[8, 16, 24], hidden_act="gelu_pytorch_tanh")),
}


def known_config(model_id: str):
    """The transformers config of a ``KNOWN_MODELS`` id (KeyError for any other)."""
    import transformers

    from meshrl.models.families import family

    fields = dict(KNOWN_MODELS[model_id])
    model_type = fields.pop("model_type")
    config_class = getattr(transformers, family(model_type).config_class)
    return config_class(**{**_SHARED.get(model_type, {}), **fields})
