"""Tool calls in an assistant turn's text, by ``rollout.multi_turn.format`` (verl's tool parser names).

``hermes`` (verl's ``HermesToolParser``, after vLLM's): every ``<tool_call>{json}</tool_call>`` block of the
turn's decoded text is one call whose JSON object holds ``name`` and ``arguments``; a text holding no
complete ``<tool_call>``..``</tool_call>`` pair has no call. As in verl, a block whose JSON does not parse
or lacks either field is not a call: it is counted (``ParsedTurn.malformed``, the rollout's
``tool/malformed_calls`` metric) and the turn's other blocks still are. ``arguments`` is kept as the JSON
text verl passes on (``json.dumps(..., ensure_ascii=False)``); the tool side decodes it and answers an
invalid one with an error message (``meshrl.rollout.tools.base.run_tool_call``).

``qwen3_coder`` (verl's ``Qwen3XMLToolParser``, after Qwen3-Coder's own; Qwen3-Coder and Qwen3.5 write it)::

    <tool_call>
    <function=calculator>
    <parameter=expression>
    6 * 7
    </parameter>
    </function>
    </tool_call>

A text without ``<tool_call>`` has no call. Each ``<function=NAME>...</function>`` inside a ``<tool_call>`` block
is one call (a block, function or parameter left open at the end of the turn counts up to there, and with no
closed block the whole text is searched, as verl's parser does); its ``<parameter=KEY>VALUE</parameter>`` pairs
are the arguments, a value losing one leading and one trailing newline. Values are typed by the tool's schema
(``parameters.properties.KEY.type``), as verl converts them: ``null`` is None whatever the type; string types
(and keys the schema lacks) stay text; integer types become an int and number types a float (an int when whole)
if they parse, else stay text; booleans are ``value.lower() == "true"``; objects are JSON, and objects that are
not JSON, arrays and other types Python literals (``ast.literal_eval``, never ``eval``), else text. A function
without ``>`` after its name is malformed (counted); a parameter without it is dropped, as in verl.

The parser sees decoded text only; the tokens the model produced go to the trainer unchanged
(``meshrl.rollout.agent_loop``).
"""

from __future__ import annotations

import ast
import json
import math
import re
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence


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


_STRING_TYPES = ("string", "str", "text", "varchar", "char", "enum")
_INTEGER_TYPES = ("int", "uint", "long", "short", "unsigned")


def typed_value(value: str, schema: Mapping[str, Any] | None) -> Any:
    """A ``qwen3_coder`` parameter's text as its schema's type says (module docstring); ``schema`` is the
    parameter's JSON schema, None when the tool's schema lacks it."""
    if value.lower() == "null":
        return None
    kind = str(schema.get("type", "string")).strip().lower() if isinstance(schema, Mapping) else "string"
    if kind in _STRING_TYPES:
        return value
    try:
        if kind.startswith(_INTEGER_TYPES):
            return int(value)
        if kind.startswith(("num", "float")):
            number = float(value)
            if not math.isfinite(number):  # verl's int() of it fails: the text stays
                return value
            return int(number) if number.is_integer() else number
    except ValueError:
        return value
    if kind in ("boolean", "bool", "binary"):
        return value.lower() == "true"
    if kind == "object" or kind.startswith("dict"):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            pass
    try:
        return ast.literal_eval(value)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return value


class Qwen3CoderToolParser:
    """``<tool_call><function=NAME><parameter=KEY>VALUE</parameter></function></tool_call>`` (module docstring),
    typed by the tools' schemas."""

    _block = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*?)$", re.DOTALL)
    _function = re.compile(r"<function=(.*?)</function>|<function=(.*)$", re.DOTALL)
    _parameter = re.compile(r"<parameter=(.*?)</parameter>|<parameter=(.*?)$", re.DOTALL)

    def __init__(self, schemas: Sequence[Mapping[str, Any]] = ()) -> None:
        self.properties = {schema["function"]["name"]: (schema["function"].get("parameters") or {}).get("properties")
                           or {} for schema in schemas}

    @staticmethod
    def _bodies(pattern: re.Pattern, text: str) -> list[str]:
        return [closed or open_ for closed, open_ in pattern.findall(text)]

    def parse(self, text: str) -> ParsedTurn:
        if "<tool_call>" not in text:
            return ParsedTurn(text)
        turn = ParsedTurn(text[:text.find("<tool_call>")])
        for block in self._bodies(self._block, text) or [text]:
            for function in self._bodies(self._function, block):
                name, sep, body = function.partition(">")
                if not sep:
                    turn.malformed += 1
                    continue
                properties = self.properties.get(name, {})
                arguments = {}
                for parameter in self._bodies(self._parameter, body):
                    key, sep, value = parameter.partition(">")
                    if sep:
                        value = value.removeprefix("\n").removesuffix("\n")
                        arguments[key] = typed_value(value, properties.get(key))
                turn.calls.append(ToolCall(name, json.dumps(arguments, ensure_ascii=False)))
        return turn


# rollout.multi_turn.format -> parser class; verl's other formats (gpt-oss, glm, seed) are not built.
TOOL_PARSERS = {"hermes": HermesToolParser, "qwen3_coder": Qwen3CoderToolParser}


def tool_parser(name: str, schemas: Sequence[Mapping[str, Any]] = ()) -> HermesToolParser | Qwen3CoderToolParser:
    """The parser ``rollout.multi_turn.format`` names, for tools of these OpenAI ``schemas`` (``qwen3_coder``
    types the arguments by them); an unknown name raises, listing the known ones."""
    if name not in TOOL_PARSERS:
        raise ValueError(f"actor_rollout_ref.rollout.multi_turn.format={name!r}: meshrl parses tool calls in the "
                         f"formats {sorted(TOOL_PARSERS)} (verl's other parsers are not built); use hermes "
                         "(<tool_call>{json}</tool_call>, Qwen2.5/Qwen3 and SmolLM-style models) or qwen3_coder "
                         "(<tool_call><function=...><parameter=...>, Qwen3-Coder and Qwen3.5)")
    return TOOL_PARSERS[name](schemas) if name == "qwen3_coder" else TOOL_PARSERS[name]()
