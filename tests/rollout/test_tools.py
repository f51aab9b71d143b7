"""Tools of multi-turn rollouts: the calculator, the runner's limits and failures, verl's tool config, and
the Python tool on the local sandbox."""

import json
import textwrap
import threading

import pytest

from meshrl.rollout.tools import Invocation, Tool, ToolAnswer, ToolConfigError, ToolRunner, load_tools
from meshrl.rollout.tools.calculator import CalculatorTool, evaluate
from meshrl.rollout.tools.geo3k import Geo3kAnswerTool
from meshrl.rollout.tools.gsm8k import Gsm8kAnswerTool
from meshrl.rollout.tools.python import PythonTool


def schema(name: str) -> dict:
    return {"type": "function", "function": {"name": name, "description": name, "parameters": {}}}


class Sleepy(Tool):
    """Answers after ``seconds`` (its call waits on an event the test releases)."""

    def __init__(self, config, schema_):
        super().__init__(config, schema_)
        self.release = threading.Event()

    def call(self, arguments, create_kwargs):
        self.release.wait(10)
        return "late"


class Failing(Tool):
    def call(self, arguments, create_kwargs):
        raise RuntimeError("disk on fire")


class Echo(Tool):
    def call(self, arguments, create_kwargs):
        return arguments["text"] + str(create_kwargs.get("suffix", ""))


@pytest.mark.parametrize("expression,value", [("12 * (3 + 4)", 84), ("7 / 2", 3.5), ("-2 ** 3", -8),
                                              ("17 // 5 + 17 % 5", 5), ("1.5e3", 1500.0)])
def test_calculator_evaluates_arithmetic(expression, value):
    assert evaluate(expression) == value


@pytest.mark.parametrize("expression,why", [("__import__('os').system('true')", "only numbers"),
                                            ("x + 1", "only numbers"), ("9 ** 9 ** 9", "powers are limited"),
                                            ("1 / 0", "division by zero"), ("1 +", "not an arithmetic")])
def test_calculator_refuses_what_is_not_bounded_arithmetic(expression, why):
    with pytest.raises(ValueError, match=why):
        evaluate(expression)


def test_calculator_writes_integral_results_as_integers():
    tool = CalculatorTool({}, schema("calculator"))
    assert tool.call({"expression": "3.5 * 2"}, {}) == "7"
    assert tool.call({"expression": "1 / 3"}, {}) == "0.333333333333"


def test_runner_turns_failures_timeouts_and_bad_arguments_into_error_outputs():
    sleepy = Sleepy({"timeout_s": 0.2}, schema("sleepy"))
    runner = ToolRunner([sleepy, Failing({}, schema("failing")), Echo({}, schema("echo"))], max_response_chars=100)
    try:
        results = runner.run([Invocation("sleepy", "{}"), Invocation("failing", "{}"),
                              Invocation("echo", '{"text": "hi"}', {"echo": {"create_kwargs": {"suffix": "!"}}}),
                              Invocation("echo", "[1]"), Invocation("echo", "{oops"), Invocation("nope", "{}")])
    finally:
        sleepy.release.set()
        runner.shutdown()
    timeout, failing, echo, not_object, bad_json, unknown = results
    assert timeout.timeout and timeout.error and "sleepy" in timeout.text and "0.2 s" in timeout.text
    assert failing.error and failing.text == "Error executing tool 'failing': disk on fire"
    assert echo.text == "hi!" and not echo.error
    assert not_object.error and "JSON object" in not_object.text
    assert bad_json.error and "invalid JSON" in bad_json.text
    assert unknown.error and unknown.text.startswith("Unknown function 'nope'")


def test_runner_runs_calls_concurrently():
    class Barrier(Tool):
        barrier = threading.Barrier(3, timeout=5)

        def call(self, arguments, create_kwargs):
            self.barrier.wait()  # only passes when all three calls run at once
            return "ok"

    runner = ToolRunner([Barrier({}, schema("b"))], max_response_chars=10)
    try:
        assert [r.text for r in runner.run([Invocation("b", "{}")] * 3)] == ["ok"] * 3
    finally:
        runner.shutdown()


@pytest.mark.parametrize("side,expected", [("right", "abcd...(truncated)"), ("left", "(truncated)...ghij"),
                                           ("middle", "ab...(truncated)...ij")])
def test_runner_truncates_long_outputs_as_verl(side, expected):
    runner = ToolRunner([Echo({}, schema("echo"))], max_response_chars=4, truncate_side=side)
    try:
        result, = runner.run([Invocation("echo", '{"text": "abcdefghij"}')])
    finally:
        runner.shutdown()
    assert result.text == expected and result.truncated


def test_gsm8k_tool_checks_the_answer_against_the_samples_ground_truth():
    """verl's text, and verl's tool reward: -0.05 for a submission that does not beat a fresh instance's 0.0."""
    tool = Gsm8kAnswerTool({"type": "native"}, schema("calc_gsm8k_reward"))
    assert tool.call({"answer": "72"}, {"ground_truth": "72"}) == ToolAnswer("Current parsed answer='72' reward=1.0")
    assert tool.call({"answer": "#### 70"}, {"ground_truth": "72"}) == \
        ToolAnswer("Current parsed answer='#### 70' reward=0.0", -0.05)
    with pytest.raises(ValueError, match="no ground truth"):
        tool.call({"answer": "1"}, {})


# verl's examples/sglang_multiturn/config/tool_config/geo3k_tool_config.yaml (early-2026 verl)
VERL_GEO3K_TOOLS = """\
tools:
  - class_name: "verl.tools.geo3k_tool.Geo3kTool"
    config:
      type: native
    tool_schema:
      type: "function"
      function:
        name: "calc_geo3k_reward"
        description: "A tool for calculating the reward of geo3k."
        parameters:
          type: "object"
          properties:
            answer:
              type: "string"
              description: "The model's answer to the geo3k problem, must be a digits"
          required: ["answer"]
"""


def test_geo3k_tool_grades_the_answer_as_given_against_the_samples_ground_truth(tmp_path):
    """verl's Geo3kTool: the answer needs no \\boxed{} and is graded by equivalence (no format part), verl's text
    and tool reward; verl's tool config file builds it."""
    path = tmp_path / "geo3k_tool_config.yaml"
    path.write_text(VERL_GEO3K_TOOLS)
    tool, = load_tools(path)
    assert isinstance(tool, Geo3kAnswerTool) and tool.name == "calc_geo3k_reward"
    assert tool.call({"answer": "2\\sqrt{3}"}, {"ground_truth": "2 \\sqrt { 3 }"}) == \
        ToolAnswer("Current parsed answer='2\\\\sqrt{3}' reward=1.0")
    assert tool.call({"answer": 0.5}, {"ground_truth": "\\frac{1}{2}"}).text == "Current parsed answer='0.5' reward=1.0"
    assert tool.call({"answer": "\\boxed{3}"}, {"ground_truth": "4"}) == \
        ToolAnswer("Current parsed answer='\\\\boxed{3}' reward=0.0", -0.05)
    with pytest.raises(ValueError, match="no ground truth"):
        tool.call({"answer": "1"}, {})


def test_a_calls_reward_comes_back_with_its_text_and_a_failed_or_plain_calls_is_zero():
    runner = ToolRunner([Gsm8kAnswerTool({}, schema("check")), CalculatorTool({}, schema("calculator"))],
                        max_response_chars=12)
    kwargs = {"check": {"create_kwargs": {"ground_truth": "72"}}}
    try:
        wrong, right, plain, failed, unknown = runner.run([
            Invocation("check", '{"answer": "70"}', kwargs), Invocation("check", '{"answer": "72"}', kwargs),
            Invocation("calculator", '{"expression": "1 + 1"}'), Invocation("check", '{"answer": "7"}'),
            Invocation("nope", "{}")])
    finally:
        runner.shutdown()
    assert (wrong.reward, right.reward, plain.reward, failed.reward, unknown.reward) == (-0.05, 0.0, 0.0, 0.0, 0.0)
    assert wrong.truncated and wrong.text.startswith("Curren...") and failed.error and plain.text == "2"


VERL_GSM8K = """\
tools:
  - class_name: "verl.tools.gsm8k_tool.Gsm8kTool"
    config:
      type: native
    tool_schema:
      type: "function"
      function:
        name: "calc_gsm8k_reward"
        description: "A tool for calculating the reward of gsm8k."
        parameters:
          type: "object"
          properties:
            answer:
              type: "string"
          required: ["answer"]
"""

VERL_SANDBOX = """\
tools:
  - class_name: "verl.tools.sandbox_fusion_tools.SandboxFusionTool"
    config:
      sandbox_fusion_url: "{url}"
      num_workers: 10
      enable_global_rate_limit: true
      rate_limit: 3
      default_timeout: 5
      default_language: "python"
      memory_limit_mb: 256
      type: native
    tool_schema:
      type: "function"
      function:
        name: "code_interpreter"
        description: "A tool for executing code."
        parameters: {{type: "object", properties: {{code: {{type: "string"}}}}, required: ["code"]}}
"""


def test_verl_tool_configs_load_onto_meshrl_tools(tmp_path):
    (tmp_path / "gsm8k.yaml").write_text(VERL_GSM8K)
    (tmp_path / "sandbox.yaml").write_text(VERL_SANDBOX.format(url="http://127.0.0.1:1/run_code"))
    gsm8k, = load_tools(tmp_path / "gsm8k.yaml")
    assert isinstance(gsm8k, Gsm8kAnswerTool) and gsm8k.name == "calc_gsm8k_reward"
    assert gsm8k.schema["function"]["parameters"]["required"] == ["answer"]
    python, = load_tools(tmp_path / "sandbox.yaml")
    assert isinstance(python, PythonTool) and python.name == "code_interpreter"
    assert (python.run_timeout, python.memory_limit_mb, python.max_concurrent) == (5.0, 256, 3)
    assert python.timeout_s > python.run_timeout  # the program's limit plus the round trip


@pytest.mark.parametrize("edit,message", [
    (lambda s: s.replace("verl.tools.gsm8k_tool.Gsm8kTool", "verl.tools.search_tool.SearchTool"), "known:"),
    (lambda s: s.replace("type: native", "type: mcp"), "only native tools"),
    (lambda s: s.replace("type: native", "type: native\n      rubric: 3"), r"\['rubric'\] are not read"),
    (lambda s: s.replace('type: "function"', 'type: "retrieval"'), "OpenAI function schema"),
    (lambda s: s + s.split("tools:\n", 1)[1], "more than once"),
])
def test_a_tool_config_meshrl_cannot_honour_is_refused(tmp_path, edit, message):
    path = tmp_path / "tools.yaml"
    path.write_text(edit(VERL_GSM8K))
    with pytest.raises(ToolConfigError, match=message):
        load_tools(path)


def test_python_tool_runs_code_in_the_local_sandbox(tmp_path):
    from meshrl.rewards.sandbox import local_sandbox

    with local_sandbox(max_concurrent=2) as url:
        (tmp_path / "t.yaml").write_text(
            VERL_SANDBOX.format(url=url).replace("default_timeout: 5", "default_timeout: 2"))
        tool, = load_tools(tmp_path / "t.yaml")
        runner = ToolRunner([tool], max_response_chars=200)
        try:
            ok, crash, hang = runner.run([
                Invocation("code_interpreter", json.dumps({"code": "print(6 * 7)"})),
                Invocation("code_interpreter", json.dumps({"code": textwrap.dedent("raise KeyError('k')")})),
                Invocation("code_interpreter", json.dumps({"code": "while True: pass"}))])
        finally:
            runner.shutdown()
    assert ok.text == "42\n" and not ok.error
    assert "KeyError: 'k'" in crash.text  # the model reads its traceback
    assert hang.text.endswith("no stdout here") and not hang.timeout  # the sandbox's limit ended it, in time
