"""Hermes tool-call parsing (verl's ``hermes`` parser semantics)."""

import json

import pytest

from meshrl.rollout.tool_parsers import ToolCall, tool_parser


def test_hermes_parses_every_block_and_strips_them_from_the_content():
    text = ('Let me compute. <tool_call>{"name": "calculator", "arguments": {"expression": "3 * 4"}}</tool_call>'
            '\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "é+1"}}\n</tool_call> done')
    turn = tool_parser("hermes").parse(text)
    assert turn.calls == [ToolCall("calculator", json.dumps({"expression": "3 * 4"})),
                          ToolCall("calculator", '{"expression": "é+1"}')]  # ensure_ascii=False, as verl
    assert turn.content == "Let me compute. \n done"
    assert turn.malformed == 0


@pytest.mark.parametrize("text", ["no call here", "<tool_call>{\"name\": \"x\", \"arguments\": {}}",
                                  "</tool_call> before <tool_call>"])
def test_hermes_without_a_complete_block_has_no_call(text):
    turn = tool_parser("hermes").parse(text)
    assert turn.calls == [] and turn.content == text and turn.malformed == 0


def test_hermes_counts_malformed_blocks_and_keeps_the_good_ones():
    text = ('<tool_call>{"name": "a", "arguments": {"x": 1}</tool_call>'  # bad JSON
            '<tool_call>{"arguments": {}}</tool_call>'  # no name
            '<tool_call>{"name": 3, "arguments": {}}</tool_call>'  # name not a string
            '<tool_call>{"name": "b", "arguments": {"y": 2}}</tool_call>')
    turn = tool_parser("hermes").parse(text)
    assert turn.calls == [ToolCall("b", '{"y": 2}')]
    assert turn.malformed == 3


def test_an_unknown_format_is_refused_naming_the_key():
    with pytest.raises(ValueError, match="multi_turn.format=.gpt-oss..*hermes.*qwen3_coder"):
        tool_parser("gpt-oss")


SCHEMAS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
    "n": {"type": "integer"}, "x": {"type": "number"}, "ok": {"type": "boolean"}, "cfg": {"type": "object"},
    "items": {"type": "array"}, "s": {"type": "string"}, "untyped": {}}}}}]


def qwen3_coder_call(name, **parameters):
    body = "".join(f"<parameter={key}>\n{value}\n</parameter>\n" for key, value in parameters.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def test_qwen3_coder_types_the_arguments_by_the_tools_schema_as_verl():
    text = "Let me see. " + qwen3_coder_call("f", n="7", x="2.50", ok="True", cfg='{"a": [1]}', items="[1, 'b']",
                                              s="0012", untyped="12", extra="3", big="null") + \
        qwen3_coder_call("f", n="seven", x="3.0", ok="yes", cfg="{'a': 1}", items="not a list")
    turn = tool_parser("qwen3_coder", SCHEMAS).parse(text)
    assert turn.content == "Let me see. " and turn.malformed == 0
    first, second = (json.loads(call.arguments) for call in turn.calls)
    assert first == {"n": 7, "x": 2.5, "ok": True, "cfg": {"a": [1]}, "items": [1, "b"], "s": "0012", "untyped": "12",
                     "extra": "3", "big": None}
    # what does not parse as its type stays text (a bad boolean is false); a Python dict literal is an object
    assert second == {"n": "seven", "x": 3, "ok": False, "cfg": {"a": 1}, "items": "not a list"}
    assert [call.name for call in turn.calls] == ["f", "f"]


def test_qwen3_coder_reads_what_a_turn_left_open_and_counts_a_nameless_function():
    multiline = "def g():\n    return 1\n"
    open_call = f"<tool_call>\n<function=run>\n<parameter=code>\n{multiline}"  # the turn ended inside it
    turn = tool_parser("qwen3_coder").parse(open_call)
    assert turn.calls == [ToolCall("run", json.dumps({"code": multiline.removesuffix("\n")}))]
    bare = tool_parser("qwen3_coder").parse("<tool_call><function=broken</function></tool_call>")
    assert bare.calls == [] and bare.malformed == 1
    assert tool_parser("qwen3_coder").parse("<function=f></function>").calls == []  # no <tool_call>: no call
