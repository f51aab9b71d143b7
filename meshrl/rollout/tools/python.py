"""A Python tool: the model's program runs in a code sandbox speaking SandboxFusion's ``/run_code`` API
(meshrl's local one, ``meshrl.rewards.sandbox``, or a SandboxFusion deployment), and its output comes back.

Arguments: ``{"code": str}`` (verl's ``code_interpreter`` schema; an optional ``timeout`` in seconds, as
verl's tool reads it). Config keys, verl's ``SandboxFusionTool`` ones: ``sandbox_fusion_url`` (required, the
full ``.../run_code`` address), ``default_timeout`` (run seconds, default 30), ``memory_limit_mb`` (default
1024), ``default_language`` (``python`` only), and ``num_workers`` / ``rate_limit`` with
``enable_global_rate_limit`` (verl bounds the programs in flight with them; here the smaller bounds this
tool's concurrent calls). The output is the program's stdout followed by its stderr when it finished (a
non-zero exit included, so the model sees its traceback), else verl's ``no stdout here`` after the reason
(time limit, memory, ...).
"""

from __future__ import annotations

from typing import Any, Mapping

from meshrl.rewards.sandbox import run_code
from meshrl.rollout.tools.base import Tool, ToolConfigError

# Seconds of the HTTP round trip on top of the program's own limit, before the runner gives up on a call.
_ROUND_TRIP_S = 15.0


class PythonTool(Tool):
    """``{"code": str}`` -> what the program printed (module docstring)."""

    CONFIG_KEYS = frozenset({"sandbox_fusion_url", "default_timeout", "memory_limit_mb", "default_language",
                             "num_workers", "rate_limit", "enable_global_rate_limit"})

    def __init__(self, config: Mapping[str, Any], schema: Mapping[str, Any]) -> None:
        super().__init__(config, schema)
        self.url = str(self.config.get("sandbox_fusion_url") or "")
        if not self.url:
            raise ToolConfigError(f"tool {self.name!r}: config.sandbox_fusion_url is required (a SandboxFusion "
                                  "/run_code URL; start a local one with `python -m meshrl.rewards.sandbox serve "
                                  "--port 0`)")
        if self.config.get("default_language", "python") != "python":
            raise ToolConfigError(f"tool {self.name!r}: default_language={self.config['default_language']!r}; the "
                                  "sandbox runs python only")
        self.run_timeout = float(self.config.get("default_timeout", 30))
        self.memory_limit_mb = int(self.config.get("memory_limit_mb", 1024))
        bounds = [int(self.config.get("num_workers", 10))]
        if self.config.get("enable_global_rate_limit", True):
            bounds.append(int(self.config.get("rate_limit", 10)))
        self.max_concurrent = min(bounds)
        if "timeout_s" not in self.config:  # the program's limit plus the round trip
            self.timeout_s = self.run_timeout + _ROUND_TRIP_S

    def call(self, arguments: dict[str, Any], create_kwargs: Mapping[str, Any]) -> str:
        code = arguments.get("code")
        if not isinstance(code, str):
            raise ValueError("the arguments need 'code', the Python program to run")
        timeout = min(float(arguments.get("timeout", self.run_timeout)), self.run_timeout)
        response = run_code(self.url, code, run_timeout=timeout, memory_limit_mb=self.memory_limit_mb)
        run = response.get("run_result") or {}
        if run.get("status") == "Finished":
            return (run.get("stdout") or "") + (run.get("stderr") or "")
        reason = response.get("message") or run.get("status") or "the sandbox did not run it"
        return f"{reason}; no stdout here"
