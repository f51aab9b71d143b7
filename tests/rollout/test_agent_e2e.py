"""One GRPO step of the real trainer (Ray, Megatron policy, colocated vLLM) on multi-turn samples with a tool
and an interaction, generated as verl's multi-turn examples ask: ``rollout.mode=async`` (one coroutine per
conversation on the engine, ``meshrl.rollout.async_engine``; the batched loop is checked on a scripted engine,
test_agent_loop.py and test_interaction_loop.py).

A tiny random model never writes a tool call, so the test alone makes it converse: a ``sitecustomize`` on
the policy workers' ``PYTHONPATH`` (``ray_kwargs.ray_init.runtime_env.env_vars``, as the alarm's e2e test
does) ends an assistant turn at every token id divisible by 3 (a stop token, as EOS would) and lets the
Hermes parser find a calculator call in a conversation's first turn when it has none; its later turns have
no call, so verl's GSM8K interaction (verl's ``gsm8k_multiturn_w_interaction`` rows and interaction config,
``meshrl.data.gsm8k_interaction``) answers them. Everything after that is meshrl's: the agent loop, the
calculator through verl's tool config, the interaction, the tool and user deltas, the masks, the trainer.
"""

import json
import os

import pytest

from meshrl.config import load_config
from meshrl.config.validate import validate_config
import yaml

from meshrl.data.gsm8k_interaction import write_task
from meshrl.data.gsm8k_tools import CALCULATOR_TOOL

pytestmark = [pytest.mark.e2e, pytest.mark.vllm, pytest.mark.timeout(600)]

SITECUSTOMIZE = """
import meshrl.rollout.agent_loop as agent_loop
import meshrl.rollout.base as base
import meshrl.rollout.tool_parsers as parsers

_stops = base.RolloutEngine.stop_token_ids


def stop_token_ids(self, sampling):
    return sorted(set(_stops(self, sampling)) | set(range(0, 49152, 3)))


_parse = parsers.HermesToolParser.parse
_after_turn = agent_loop.AgentLoop._after_turn
first_turn = [False]  # set around each turn's parse (the loop parses right after appending the turn)


def after_turn(self, sample, out):
    first_turn[0] = sample.stats.assistant_turns == 0
    return _after_turn(self, sample, out)


def parse(self, text):
    turn = _parse(self, text)
    if not turn.calls and first_turn[0]:
        turn.calls.append(parsers.ToolCall("calculator", '{"expression": "6 * 7"}'))
    return turn


base.RolloutEngine.stop_token_ids = stop_token_ids
parsers.HermesToolParser.parse = parse
agent_loop.AgentLoop._after_turn = after_turn
"""


def test_one_multi_turn_grpo_step_trains_on_the_engines_tokens(tmp_path, capsys):
    """Measured (2 shared cores, fp32): 4 samples of 3 assistant turns, 1 calculator turn and 1 interaction turn
    each, 49.5 response tokens on average of which 12 tool and 26 user tokens; trainer vs engine log-probs of the
    sampled tokens 1.9e-6 at most (7e-7 on average); the test 30 s with Ray, Megatron and vLLM start-up at load
    average 7-9, as before the interaction turn was added (31 s at that load)."""
    from meshrl.trainer.main import run

    task = write_task(tmp_path / "data")
    tools = tmp_path / "data" / "tool_config.yaml"
    tools.write_text(yaml.safe_dump({"tools": [CALCULATOR_TOOL]}))
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(SITECUSTOMIZE)
    path = os.pathsep.join([str(hook), *filter(None, [os.environ.get("PYTHONPATH")])])
    run_dir = tmp_path / "run"
    cfg = load_config([
        f"trainer.default_local_dir={run_dir}", "trainer.total_training_steps=1", "trainer.val_before_train=False",
        "trainer.test_freq=-1", f"trainer.rollout_data_dir={tmp_path / 'rollouts'}",
        f"data.train_files={task['train']}", f"data.val_files={task['test']}", "data.train_batch_size=2",
        "data.max_response_length=64", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.rollout.mode=async", "actor_rollout_ref.rollout.multi_turn.enable=True",
        "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=3",
        "actor_rollout_ref.rollout.multi_turn.max_tool_response_length=8",
        f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tools}",
        f"actor_rollout_ref.rollout.multi_turn.interaction_config_path={task['interaction_config']}",
        f"+ray_kwargs.ray_init.runtime_env.env_vars.PYTHONPATH={path}"], recipe="cpu_tiny_grpo")
    final = run(cfg, validate_config(cfg))
    # Conversations happened: tool turns in the samples, calculator calls, and tool text in the responses;
    # then the interaction's user turns (the random model's answers are wrong: score 0, go on).
    assert final["agent/num_turns/max"] >= 5 and final["tool/calculator/calls"] >= 2
    assert final["tool/calculator/errors"] == 0
    assert final["interaction/gsm8k/turns/mean"] > 0 and final["interaction/gsm8k/errors"] == 0
    assert final["interaction/gsm8k/score/mean"] == 0.0
    outputs = [json.loads(line)["output"] for line in (tmp_path / "rollouts" / "1.jsonl").read_text().splitlines()]
    assert any("tool\n42" in text for text in outputs)
    assert any("user\nYour response is incorrect!" in text for text in outputs)
    # The trainer's log-probs of the sampled tokens (Megatron, on prompt + response with the tool outputs as
    # context) are the engine's: the tokens are the same and the tool tokens sit where the engine saw them.
    assert final["rollout/log_prob_max_abs_diff"] < 1e-3
    # the console's step line says what the multi-turn rollout did (meshrl.trainer.tracking.CONSOLE_KEYS)
    (line,) = [row for row in capsys.readouterr().out.splitlines() if row.startswith("step 1/1")]
    assert f"turns {final['agent/num_turns/mean']:.4g}" in line and " tool_calls " in line, line
