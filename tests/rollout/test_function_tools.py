"""verl's function tools (``rollout.multi_turn.function_tool_path``): a Python file's decorated functions as
tools, their schemas, calls, rewards, and what is refused at preflight."""

import json
import textwrap

import pytest

from meshrl.config import ConfigError, load_config
from meshrl.config.validate import validate_config
from meshrl.rollout.agent_loop import prompt_tool_schemas, tool_runner
from meshrl.rollout.engines import unsupported_rollout_features
from meshrl.rollout.tools import Invocation, ToolConfigError
from meshrl.rollout.tools.function import load_function_tools

TOOLS = '''
import asyncio

from meshrl.rollout.tools.function import function_tool


@function_tool
def add(a: int, b: int = 2) -> int:
    """Add two integers.

    Args:
        a: the first
        b: the second
    """
    return a + b


@function_tool("check")
async def check_answer(answer: str) -> tuple:
    """Check an answer.

    Args:
        answer: the answer
    """
    await asyncio.sleep(0)
    return ({"answer": answer, "right": answer == "42"}, None if answer == "42" else -0.05, {"calls": 1})


@function_tool(schema={"type": "function", "function": {"name": "shout", "parameters": {"type": "object"}}})
def shout(text):
    return text.upper()


def helper():  # not a tool
    return 0
'''


def write(tmp_path, text, name="tools.py"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def test_a_files_decorated_functions_are_tools_with_verls_schemas_and_returns(tmp_path):
    path = write(tmp_path, TOOLS)
    tools = {tool.name: tool for tool in load_function_tools(path)}
    assert sorted(tools) == ["add", "check", "shout"]
    assert tools["add"].schema == {"type": "function", "function": {
        "name": "add", "description": "Add two integers.",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer", "description": "the first"},
                                                        "b": {"type": "integer", "description": "the second"}},
                       "required": ["a"]}}}
    multi_turn = {"enable": True, "function_tool_path": str(path), "max_tool_response_length": 64}
    assert [s["function"]["name"] for s in prompt_tool_schemas(multi_turn)] == ["add", "check", "shout"]
    runner = tool_runner(multi_turn)
    try:
        added, right, wrong, shouted, bad = runner.run([
            Invocation("add", '{"a": 40}'), Invocation("check", '{"answer": "42"}'),
            Invocation("check", '{"answer": "7"}'), Invocation("shout", '{"text": "hi"}'),
            Invocation("add", '{"c": 1}')])
    finally:
        runner.shutdown()
    assert (added.text, added.reward) == ("42", 0.0)
    assert json.loads(right.text) == {"answer": "42", "right": True} and right.reward == 0.0  # None: 0.0
    assert wrong.reward == -0.05 and shouted.text == "HI"
    assert bad.error and "unexpected keyword argument 'c'" in bad.text


@pytest.mark.parametrize("text,match", [
    ("from verl.tools.function_tool import function_tool\n", r"imports verl.*from meshrl\.rollout\.tools\.function"),
    ("import no_such_module_xyz\n", "failed to run: ModuleNotFoundError"),
    ("1 / 0\n", "failed to run: ZeroDivisionError"),
    ("def f(x: int):\n    return x\n", "defines no function decorated"),
    (TOOLS.replace("def add(a: int, b: int = 2)", "def add(*a: int)"), r"'add': variadic parameter\(s\) \['a'\]"),
    (TOOLS.replace("a: the first", ""), "'add': its schema cannot be inferred"),
    (TOOLS.replace('@function_tool("check")', "@function_tool"), None),
    (TOOLS.replace('@function_tool("check")', '@function_tool("add")'), r"\['add'\] are given to more than one"),
])
def test_what_a_function_tool_file_cannot_be_is_refused_at_preflight(tmp_path, text, match):
    path = write(tmp_path, text)
    rollout = {"multi_turn": {"enable": True, "function_tool_path": str(path)}}
    problems = unsupported_rollout_features(rollout)
    if match is None:
        assert problems == []
        return
    (problem,) = problems
    assert problem.startswith(f"actor_rollout_ref.rollout.multi_turn.function_tool_path={path}")
    with pytest.raises(ToolConfigError, match=match):
        tool_runner(rollout["multi_turn"])


def test_a_name_in_both_tool_files_is_refused(tmp_path):
    config = tmp_path / "tools.yaml"
    config.write_text(json.dumps({"tools": [{"class_name": "meshrl.rollout.tools.calculator.CalculatorTool",
                                             "tool_schema": {"type": "function", "function": {"name": "add"}}}]}))
    multi_turn = {"enable": True, "tool_config_path": str(config), "function_tool_path": str(write(tmp_path, TOOLS))}
    with pytest.raises(ToolConfigError, match=r"\['add'\] are also in tool_config_path"):
        tool_runner(multi_turn)


def test_function_tools_without_multi_turn_are_refused(tmp_path):
    cfg = load_config([f"actor_rollout_ref.rollout.multi_turn.function_tool_path={write(tmp_path, TOOLS)}"],
                      recipe="cpu_tiny_grpo")
    with pytest.raises(ConfigError, match=r"multi_turn\.function_tool_path.*multi_turn\.enable=True"):
        validate_config(cfg)
