"""The tool contract of multi-turn rollouts, and running one turn's calls with limits.

A tool is built from one entry of verl's tool config (``meshrl.rollout.tools.config``): its ``config``
mapping and its OpenAI function schema. ``call(arguments, create_kwargs)`` answers one call with the text
the model reads as the tool message, or with a ``ToolAnswer`` that adds the call's step reward (verl's
``execute`` returns one beside the text: e.g. its GSM8K tool's -0.05 for a wrong answer); a text's reward is
0.0 (verl's ``BaseTool``). ``create_kwargs`` is the sample's ``extra_info.tools_kwargs.<tool
name>.create_kwargs`` (verl's per-trajectory arguments, e.g. a ground truth). Each call stands alone, as
verl's agent loop runs a tool (create, execute, release per call). The rewards of a sample's calls reach the
reward function in ``extra_info["tool_rewards"]`` (``meshrl.rollout.agent_loop``), as verl's agent loop passes
them; a call that failed has reward 0.0, as in verl.

``ToolRunner.run`` executes a turn's calls (of all samples of a batch at once) concurrently on a thread
pool. A call never fails the step: an unknown tool name, arguments that are not a JSON object, a tool
that raises, or one that has not answered after its ``timeout_s`` gives the text
``Error executing tool '<name>': <why>`` as its output (verl's wording), and is counted. A call that timed
out keeps its thread until the tool returns (Python cannot stop a thread): tools bound their own work
(the Python tool's program runs under the sandbox's wall-time limit, the calculator refuses huge
powers). A tool's output longer than ``max_tool_response_length`` characters is cut as verl cuts it
(``rollout.multi_turn.tool_response_truncate_side``: ``left`` keeps the end, ``right`` the start,
``middle`` both halves).
"""

from __future__ import annotations

import abc
import json
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any, ClassVar, Mapping, Sequence

TRUNCATE_SIDES = ("left", "right", "middle")
DEFAULT_TIMEOUT_S = 30.0


class ToolConfigError(ValueError):
    """A tool config entry meshrl cannot honour (the message names the entry and what to change)."""


def check_schema(schema: Any, where: str) -> dict[str, Any]:
    """``schema`` if it is an OpenAI function schema with a name; else ``ToolConfigError`` naming ``where``."""
    if not isinstance(schema, dict) or schema.get("type") != "function" or not isinstance(schema.get("function"), dict):
        raise ToolConfigError(f"{where}.tool_schema must be an OpenAI function schema "
                              "({type: function, function: {name, description, parameters}})")
    if not isinstance(schema["function"].get("name"), str) or not schema["function"]["name"]:
        raise ToolConfigError(f"{where}.tool_schema.function.name must be a non-empty string")
    return schema


class Tool(abc.ABC):
    """One callable tool. Subclasses set ``CONFIG_KEYS`` (the ``config`` keys they read beyond ``type`` and
    ``timeout_s``; any other key is refused) and implement ``call``.

    ``timeout_s`` (meshrl's key, default 30): seconds a call may take before its output becomes a timeout
    error. ``max_concurrent`` (None: unbounded) caps this tool's calls running at once.
    """

    CONFIG_KEYS: ClassVar[frozenset[str]] = frozenset()

    def __init__(self, config: Mapping[str, Any], schema: Mapping[str, Any]) -> None:
        self.config = dict(config)
        self.schema = dict(schema)
        self.name = str(self.schema["function"]["name"])
        unknown = sorted(set(self.config) - {"type", "timeout_s"} - self.CONFIG_KEYS)
        if unknown:
            raise ToolConfigError(f"tool {self.name!r} ({type(self).__name__}): config key(s) {unknown} are not read "
                                  f"by this tool; it reads {sorted(self.CONFIG_KEYS | {'type', 'timeout_s'})}")
        self.timeout_s = float(self.config.get("timeout_s", DEFAULT_TIMEOUT_S))
        if self.timeout_s <= 0:
            raise ToolConfigError(f"tool {self.name!r}: timeout_s must be > 0, got {self.timeout_s}")
        self.max_concurrent: int | None = None

    @abc.abstractmethod
    def call(self, arguments: dict[str, Any], create_kwargs: Mapping[str, Any]) -> str | ToolAnswer:
        """The tool message's text for one call, or it with the call's reward (raise on failure: the runner
        reports it to the model)."""


@dataclass(frozen=True)
class ToolAnswer:
    """A call's tool message ``text`` and its step ``reward`` (verl's ``tool_reward``)."""

    text: str
    reward: float = 0.0


@dataclass(frozen=True)
class Invocation:
    """One parsed call of one sample: tool ``name``, ``arguments`` (JSON text), the sample's tools_kwargs."""

    name: str
    arguments: str
    tools_kwargs: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class CallResult:
    """One call's tool message ``text`` and how it went: ``error`` (the text is an error message),
    ``timeout`` (no answer in time; also an error), ``truncated``, ``seconds``, and its ``reward``."""

    text: str
    error: bool = False
    timeout: bool = False
    truncated: bool = False
    seconds: float = 0.0
    reward: float = 0.0


def truncate_text(text: str, limit: int, side: str) -> tuple[str, bool]:
    """``text`` cut to ``limit`` characters plus verl's marker, and whether it was cut (module docstring)."""
    if len(text) <= limit:
        return text, False
    if side == "left":
        return "(truncated)..." + text[-limit:], True
    if side == "right":
        return text[:limit] + "...(truncated)", True
    half = limit // 2
    return text[:half] + "...(truncated)..." + text[-half:], True


class ToolRunner:
    """Runs calls on a thread pool with per-call timeouts and truncation (module docstring)."""

    def __init__(self, tools: Sequence[Tool], *, max_response_chars: int, truncate_side: str = "middle",
                 max_workers: int = 8) -> None:
        if truncate_side not in TRUNCATE_SIDES:
            raise ToolConfigError(f"actor_rollout_ref.rollout.multi_turn.tool_response_truncate_side must be one of "
                                  f"{TRUNCATE_SIDES}, got {truncate_side!r}")
        if max_response_chars < 1:
            raise ToolConfigError("actor_rollout_ref.rollout.multi_turn.max_tool_response_length must be >= 1, got "
                                  f"{max_response_chars}")
        names = [tool.name for tool in tools]
        if len(set(names)) != len(names):
            raise ToolConfigError(f"tool names must be unique, got {names}")
        self.tools = {tool.name: tool for tool in tools}
        self.max_response_chars = max_response_chars
        self.truncate_side = truncate_side
        self._limits = {tool.name: threading.BoundedSemaphore(tool.max_concurrent)
                        for tool in tools if tool.max_concurrent}
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="meshrl-tool")

    def run(self, invocations: Sequence[Invocation]) -> list[CallResult]:
        """Each invocation's result, in order; the calls run concurrently."""
        started = time.monotonic()
        futures = [self._pool.submit(self._call, inv) if inv.name in self.tools else None for inv in invocations]
        return [self._result(inv, future, started) for inv, future in zip(invocations, futures)]

    def _result(self, inv: Invocation, future: Future | None, started: float) -> CallResult:
        if future is None:
            return CallResult(f"Unknown function '{inv.name}'. Available tools: {sorted(self.tools)}", error=True)
        timeout_s = self.tools[inv.name].timeout_s
        # Every call started together: each may use what is left of its own timeout since then.
        try:
            answer, seconds = future.result(timeout=max(timeout_s - (time.monotonic() - started), 0.0))
        except FutureTimeout:
            return CallResult(f"Error executing tool '{inv.name}': no answer within {timeout_s:g} s", error=True,
                              timeout=True, seconds=timeout_s)
        except Exception as error:  # noqa: BLE001 - a tool's failure is the model's feedback, never the step's
            return CallResult(f"Error executing tool '{inv.name}': {error}", error=True,
                              seconds=time.monotonic() - started)
        text, cut = truncate_text(answer.text, self.max_response_chars, self.truncate_side)
        return CallResult(text, truncated=cut, seconds=seconds, reward=answer.reward)

    def _call(self, inv: Invocation) -> tuple[ToolAnswer, float]:
        tool = self.tools[inv.name]
        try:
            arguments = json.loads(inv.arguments)
        except json.JSONDecodeError as error:
            raise ValueError(f"invalid JSON in the arguments ({error})") from None
        if not isinstance(arguments, dict):
            raise ValueError(f"the arguments must be a JSON object, got {inv.arguments[:100]}")
        create_kwargs = ((inv.tools_kwargs or {}).get(inv.name) or {}).get("create_kwargs") or {}
        limit = self._limits.get(inv.name)
        if limit is not None:
            limit.acquire()
        try:
            start = time.monotonic()
            answer = tool.call(arguments, create_kwargs)
            seconds = time.monotonic() - start
            if isinstance(answer, ToolAnswer):
                return ToolAnswer(str(answer.text), float(answer.reward)), seconds
            return ToolAnswer(str(answer)), seconds
        finally:
            if limit is not None:
                limit.release()

    def shutdown(self) -> None:
        # Threads of timed-out calls are not waited for (module docstring).
        self._pool.shutdown(wait=False, cancel_futures=True)
