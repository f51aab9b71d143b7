"""Tools of multi-turn rollouts: the contract and runner (``base``), meshrl's tools (``calculator``,
``python`` on the code sandbox, ``gsm8k``: verl's GSM8K answer check) and verl's tool config (``config``)."""

from meshrl.rollout.tools.base import CallResult, Invocation, Tool, ToolAnswer, ToolConfigError, ToolRunner
from meshrl.rollout.tools.config import load_tools, tool_schemas

__all__ = ["CallResult", "Invocation", "Tool", "ToolAnswer", "ToolConfigError", "ToolRunner", "load_tools",
           "tool_schemas"]
