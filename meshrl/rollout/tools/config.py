"""verl's tool config file (``rollout.multi_turn.tool_config_path``) read as verl writes it::

    tools:
      - class_name: "verl.tools.gsm8k_tool.Gsm8kTool"     # or a meshrl tool, or module.Class of a Tool subclass
        config: {type: native, ...}                        # the tool's own keys (meshrl.rollout.tools.*)
        tool_schema: {type: function, function: {name: ..., description: ..., parameters: {...}}}

verl's tool classes map onto meshrl's (``VERL_TOOLS``); any other ``class_name`` must import as a
subclass of ``meshrl.rollout.tools.base.Tool``. Refused, each with the entry and what to do: a missing
file, a class that is neither, ``config.type`` other than ``native`` (verl's MCP tools are not built), a
schema that is not an OpenAI function schema with a name, two tools of one name, and config keys the
tool does not read. ``tool_schemas`` are what the chat template renders into the prompt (``tools=``).
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import yaml

from meshrl.rollout.tools.base import Tool, ToolConfigError, check_schema
from meshrl.rollout.tools.calculator import CalculatorTool
from meshrl.rollout.tools.function import load_function_tools
from meshrl.rollout.tools.geo3k import Geo3kAnswerTool
from meshrl.rollout.tools.gsm8k import Gsm8kAnswerTool
from meshrl.rollout.tools.python import PythonTool

VERL_TOOLS: dict[str, type[Tool]] = {
    "verl.tools.gsm8k_tool.Gsm8kTool": Gsm8kAnswerTool,
    "verl.tools.geo3k_tool.Geo3kTool": Geo3kAnswerTool,
    "verl.tools.sandbox_fusion_tools.SandboxFusionTool": PythonTool,
}
MESHRL_TOOLS = (CalculatorTool, Geo3kAnswerTool, Gsm8kAnswerTool, PythonTool)


def tool_class(class_name: str) -> type[Tool]:
    """The meshrl tool for a config entry's ``class_name`` (module docstring)."""
    if class_name in VERL_TOOLS:
        return VERL_TOOLS[class_name]
    module, _, name = class_name.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name) if module else None
    except ImportError:
        cls = None
    if isinstance(cls, type) and issubclass(cls, Tool):
        return cls
    known = sorted(VERL_TOOLS) + [f"{c.__module__}.{c.__name__}" for c in MESHRL_TOOLS]
    raise ToolConfigError(f"tool class_name {class_name!r} is neither one of verl's tools meshrl provides nor an "
                          f"importable meshrl.rollout.tools.base.Tool subclass; known: {', '.join(known)}")


def load_tools(path: str | Path) -> list[Tool]:
    """The tools of a verl tool config file, built (module docstring)."""
    path = Path(path)
    if not path.is_file():
        raise ToolConfigError(f"actor_rollout_ref.rollout.multi_turn.tool_config_path={path}: no such file")
    document = yaml.safe_load(path.read_text()) or {}
    entries = document.get("tools") if isinstance(document, dict) else None
    if not isinstance(entries, list) or not entries:
        raise ToolConfigError(f"{path}: expected a non-empty 'tools:' list of {{class_name, config, tool_schema}}")
    tools: list[Tool] = []
    for index, entry in enumerate(entries):
        where = f"{path}: tools[{index}]"
        if not isinstance(entry, dict) or not isinstance(entry.get("class_name"), str):
            raise ToolConfigError(f"{where} needs a class_name")
        config = entry.get("config") or {}
        if config.get("type", "native") != "native":
            raise ToolConfigError(f"{where}: config.type={config['type']!r}; only native tools are built (verl's MCP "
                                  "tools are not): use type: native")
        try:
            tools.append(tool_class(entry["class_name"])(config, check_schema(entry.get("tool_schema"), where)))
        except ToolConfigError as error:
            raise ToolConfigError(f"{where}: {error}") from None
    names = [tool.name for tool in tools]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise ToolConfigError(f"{path}: tool names {duplicates} appear more than once")
    return tools


def load_all_tools(tool_config_path: str | Path | None, function_tool_path: str | Path | None) -> list[Tool]:
    """The tools of verl's two keys, built: the tool config's, then the function tools
    (``meshrl.rollout.tools.function``); a name both give is refused, as verl refuses it."""
    tools = (load_tools(tool_config_path) if tool_config_path else []) + \
        (load_function_tools(function_tool_path) if function_tool_path else [])
    names = [tool.name for tool in tools]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise ToolConfigError(f"actor_rollout_ref.rollout.multi_turn.function_tool_path: tool name(s) {duplicates} "
                              "are also in tool_config_path; each tool needs its own name")
    return tools


def tool_schemas(tools: list[Tool]) -> list[dict[str, Any]]:
    return [tool.schema for tool in tools]
