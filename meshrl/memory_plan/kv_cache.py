"""The rollout engine's (and a generative reward model's) share of a device: weights, profiled activations, the KV
cache and what it holds."""

from __future__ import annotations

from typing import Any

from meshrl.memory_plan.activations import mlp_width
from meshrl.memory_plan.units import CPU_DEFAULT_KV_BYTES
from meshrl.memory_plan.weights import load_hf_config, stage_parameters


def engine_memory(spec, rollout, dtype: dict, device: str, limit: float, seq_len: int,
                  vision_params: int = 0) -> dict[str, Any]:
    """The rollout engine's share of a GPU while it generates, and what its KV cache holds (``vision_params``: a
    vision-language model's tower, split over the rollout's TP like the rest)."""
    rtp = rollout.tensor_model_parallel_size
    weights = (stage_parameters(spec) + vision_params) * dtype["param"] / rtp
    h, f = spec.hidden_size, mlp_width(spec)
    # vLLM profiles one forward over max_num_batched_tokens, then samples max_num_seqs rows of logits.
    activations = (rollout.max_num_batched_tokens * (4 * h + 3 * f // rtp) * dtype["act"]
                   + rollout.max_num_seqs * spec.vocab_size * 4 * 2)
    if device == "cpu":
        kv = float(rollout.kv_cache_memory_bytes or CPU_DEFAULT_KV_BYTES)
        budget = weights + activations + kv
    else:
        budget = rollout.gpu_memory_utilization * limit
        kv = budget - weights - activations
    kv_heads = max(1, spec.num_kv_heads // rtp)  # vLLM replicates KV heads when rollout TP exceeds them
    kv_per_token = 2 * spec.num_layers * kv_heads * spec.head_dim * dtype["act"]
    if spec.mla:  # vLLM caches one latent and rope key per token and layer, whole on every TP rank
        kv_per_token = spec.num_layers * (spec.kv_lora_rank + spec.qk_rope_head_dim) * dtype["act"]
    capacity = max(0, int(kv // kv_per_token))
    return {
        "tp": rtp, "budget_bytes": budget, "weights_bytes": weights, "activation_bytes": activations,
        "kv_cache_bytes": kv, "kv_bytes_per_token": kv_per_token, "kv_capacity_tokens": capacity,
        "max_model_len": seq_len, "full_length_sequences": capacity // seq_len,
        "components": {"vLLM weights": weights, "vLLM activations": activations, "vLLM KV cache": max(kv, 0.0)},
    }


def reward_judge_bytes(cfg, precision, device: str, limit: float) -> float:
    """The generative reward model's vLLM server, per GPU it sits on (or on the CPU host): :func:`engine_memory`'s
    budget
    with ``reward_model.rollout``'s settings (``meshrl.rewards.judge``)."""
    from types import SimpleNamespace

    from meshrl.config.reward_model_kind import judge_rollout
    from meshrl.parallel.model_builder import model_spec

    values, _ = judge_rollout(cfg)
    spec = model_spec(load_hf_config(cfg.reward_model.model.path))
    length = values["max_model_len"] or values["prompt_length"] + values["response_length"]
    engine = engine_memory(spec, SimpleNamespace(**values), precision(values["dtype"]), device, limit, length)
    return engine["budget_bytes"]
