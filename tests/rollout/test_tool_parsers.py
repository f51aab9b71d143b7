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
    with pytest.raises(ValueError, match="multi_turn.format='gpt-oss'.*hermes"):
        tool_parser("gpt-oss")
