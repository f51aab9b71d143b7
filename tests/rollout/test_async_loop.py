"""The multi-turn loop as one coroutine per conversation (``rollout.mode=async``) on the scripted engine of
test_agent_loop: same conversations as the batched loop, a slow tool holds up only its own conversation,
seeds per (sample, turn). The real engine: tests/rollout/test_async_engine.py."""

import asyncio
import threading

import pytest

from test_agent_loop import SCRIPTS, ScriptedEngine, call, tokenizer  # noqa: F401  (the fixture)

from meshrl.rollout.agent_loop import AgentLoop, MultiTurnSettings
from meshrl.rollout.async_engine import AsyncEngine, turn_seed
from meshrl.rollout.base import SamplingConfig, request_seed
from meshrl.rollout.tools import ToolRunner
from meshrl.rollout.tools.base import Tool
from meshrl.rollout.tools.calculator import CalculatorTool


class ScriptedAsync:
    """``AsyncEngine``'s two methods over the scripted engine: each request answers at the next loop turn;
    records the seeds it was given."""

    def __init__(self, engine: ScriptedEngine) -> None:
        self.engine = engine
        self.seeds: list[tuple[int, int]] = []  # (conversation, seed)

    def run(self, main):
        return asyncio.run(main())

    async def sample(self, prompt, sampling, seed, max_tokens, *, prompt_index=0, sample_index=0):
        self.seeds.append((prompt[0], seed))
        await asyncio.sleep(0)
        (out,) = self.engine._generate([list(prompt)], sampling, [seed], [max_tokens])
        return out


class WaitTool(Tool):
    """Answers once ``released`` is set (by the engine seeing another conversation's second turn)."""

    released = threading.Event()

    def call(self, arguments, create_kwargs):
        if not self.released.wait(timeout=self.timeout_s):
            raise TimeoutError("never released")
        return "done"


def loops(tiny_llama_dir, tokenizer, scripts, tools):
    """A batched and an async loop, each on its own scripted engine, with ``tools(asynchronous)``."""
    made = []
    for asynchronous in (False, True):
        engine = ScriptedEngine(tiny_llama_dir, tokenizer, scripts)
        runner = ToolRunner(tools(asynchronous), max_response_chars=64)
        made.append((engine, AgentLoop(engine, tokenizer, runner, MultiTurnSettings(max_parallel_calls=2), 400,
                                       ScriptedAsync(engine) if asynchronous else None)))
    return made


def calculator():
    return CalculatorTool({}, {"type": "function", "function": {"name": "calculator"}})


def test_async_conversations_are_the_batched_ones(tiny_llama_dir, tokenizer):
    (_, batched), (engine, asynchronous) = loops(tiny_llama_dir, tokenizer, SCRIPTS, lambda _: [calculator()])
    prompts, sampling = [[0, 500, 501], [1, 502]], SamplingConfig(n=2, max_response_length=400, seed=3)
    expected, expected_stats = batched.generate(prompts, sampling)
    got, stats = asynchronous.generate(prompts, sampling)
    assert [(c.prompt_index, c.sample_index) for c in got] == [(c.prompt_index, c.sample_index) for c in expected]
    for want, have in zip(expected, got):
        assert (have.token_ids, have.logprobs, have.loss_mask, have.finish_reason) == \
            (want.token_ids, want.logprobs, want.loss_mask, want.finish_reason)
    assert [(s.assistant_turns, s.user_turns, s.tool_tokens) for s in stats] == \
        [(s.assistant_turns, s.user_turns, s.tool_tokens) for s in expected_stats]
    # One engine call reserved for the whole rollout; turn k of sample j of prompt i: turn_seed(seed_i + j, k).
    assert engine.state_dict()["calls"] == 1
    seeds = [request_seed(sampling.seed, 0, i) for i in range(len(prompts))]
    recorded = sorted(asynchronous.async_engine.seeds)
    first = {(c, seeds[c] + j) for c in (0, 1) for j in (0, 1)}
    assert {(c, s) for c, s in recorded if (c, s) in first} == first  # the first turns: the single-turn seeds
    later = [turn_seed(seeds[0] + j, k) for j in (0, 1) for k in (1, 2)]
    assert sorted(s for c, s in recorded if c == 0 and (c, s) not in first) == sorted(later)


def test_a_slow_tool_holds_up_only_its_own_conversation(tiny_llama_dir, tokenizer):
    """Conversation 0's tool answers only once conversation 1 has sent its second turn: the async loop gets
    there (conversation 1's calculator turn runs while 0 waits), the batched loop waits for every tool of a
    turn before the next turn, so its wait times out (after 1 s; the async loop's would take 60 s)."""
    scripts = [["Wait " + call_wait(), "Done."], ["First " + call("1 + 1"), "Then " + call("2 + 2"), "Done."]]
    results = {}
    for (engine, loop), mode in zip(loops(tiny_llama_dir, tokenizer, scripts,
                                              lambda asynchronous: [calculator(),
                                                                    wait_tool(60.0 if asynchronous else 1.0)]),
                                    ("sync", "async")):
        WaitTool.released.clear()
        requests = engine.requests
        original = engine._generate

        def generate(prompts, sampling, seeds, max_tokens, original=original, requests=requests):
            out = original(prompts, sampling, seeds, max_tokens)
            if sum(r[0][0] == 1 for r in requests) >= 2:
                WaitTool.released.set()
            return out

        engine._generate = generate
        _, stats = loop.generate([[0, 9], [1, 9]], SamplingConfig(max_response_length=400))
        results[mode] = stats[0].tools["wait"]
    assert results["async"][2] == 0 and results["async"][1] == 0  # answered, no timeout
    assert results["sync"][2] == 1  # the batched loop could not overlap them


def call_wait() -> str:
    return call("0").replace("calculator", "wait")


def wait_tool(timeout_s: float) -> WaitTool:
    return WaitTool({"timeout_s": timeout_s}, {"type": "function", "function": {"name": "wait"}})


def test_async_mode_is_honoured_or_refused_at_load_time(tiny_llama_dir, tokenizer):
    from meshrl.config import ConfigError, load_config
    from meshrl.config.validate import validate_config

    plan = validate_config(load_config(["actor_rollout_ref.rollout.mode=async"], recipe="cpu_tiny_grpo"))
    assert not [w for w in plan.warnings if "mode=async" in w]  # run as asked: no "generates as sync" note
    with pytest.raises(ConfigError, match=r"actor_rollout_ref\.rollout\.mode.*rollout\.name=hf"):
        validate_config(load_config(["actor_rollout_ref.rollout.mode=async", "actor_rollout_ref.rollout.name=hf"],
                                    recipe="cpu_tiny_grpo"))
    with pytest.raises(ValueError, match="rollout.mode=sync"):
        AsyncEngine(ScriptedEngine(tiny_llama_dir, tokenizer, SCRIPTS))
