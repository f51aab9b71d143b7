"""Tool calls in an assistant turn's text, by ``rollout.multi_turn.format`` (verl's tool parser names).

``hermes`` (verl's ``HermesToolParser``, after vLLM's): every ``<tool_call>{json}</tool_call>`` block of the
turn's decoded text is one call whose JSON object holds ``name`` and ``arguments``; a text holding no
complete ``<tool_call>``..``</tool_call>`` pair has no call. As in verl, a block whose JSON does not parse
or lacks either field is not a call: it is counted (``ParsedTurn.malformed``, the rollout's
``tool/malformed_calls`` metric) and the turn's other blocks still are. ``arguments`` is kept as the JSON
text verl passes on (``json.dumps(..., ensure_ascii=False)``); the tool side decodes it and answers an
invalid one with an error message (``meshrl.rollout.tools.base.run_tool_call``).

The parser sees decoded text only; the tokens the model produced go to the trainer unchanged
(``meshrl.rollout.agent_loop``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ToolCall:
    """One call: the tool's ``name`` and its ``arguments`` as JSON text (possibly not an object)."""

    name: str
    arguments: str


@dataclass
class ParsedTurn:
    """An assistant turn's text without its call blocks (``content``), its calls in order, and how many
    blocks were not calls (``malformed``)."""

    content: str
    calls: list[ToolCall] = field(default_factory=list)
    malformed: int = 0


class HermesToolParser:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (see the module docstring)."""

    start, end = "<tool_call>", "</tool_call>"
    _block = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

    def parse(self, text: str) -> ParsedTurn:
        if self.start not in text or self.end not in text:
            return ParsedTurn(text)
        turn = ParsedTurn(self._block.sub("", text))
        for body in self._block.findall(text):
            try:
                call = json.loads(body)
                name, arguments = call["name"], call["arguments"]
            except (json.JSONDecodeError, TypeError, KeyError):
                turn.malformed += 1
                continue
            if not isinstance(name, str):
                turn.malformed += 1
                continue
            turn.calls.append(ToolCall(name, json.dumps(arguments, ensure_ascii=False)))
        return turn


# rollout.multi_turn.format -> parser class; verl's other formats (gpt-oss, qwen3_coder, ...) are not built.
TOOL_PARSERS = {"hermes": HermesToolParser}


def tool_parser(name: str) -> HermesToolParser:
    """The parser ``rollout.multi_turn.format`` names; an unknown name raises, listing the known ones."""
    if name not in TOOL_PARSERS:
        raise ValueError(f"actor_rollout_ref.rollout.multi_turn.format={name!r}: meshrl parses tool calls in the "
                         f"formats {sorted(TOOL_PARSERS)} (verl's other parsers are not built); use hermes "
                         "(<tool_call>{json}</tool_call>, Qwen2.5/Qwen3 and SmolLM-style models)")
    return TOOL_PARSERS[name]()
