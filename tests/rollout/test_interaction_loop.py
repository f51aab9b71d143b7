"""Interactions in the multi-turn loop (verl's ``interaction_config_path``) on the scripted engine of
test_agent_loop, batched and async: the user turns' tokens, masks, turn scores, limits and failures. The real
engine and trainer: tests/rollout/test_agent_e2e.py."""

import asyncio
import time

import pytest

from test_agent_loop import ScriptedEngine, call, tokenizer  # noqa: F401  (the fixture)
from test_async_loop import ScriptedAsync

from meshrl.rollout.agent_loop import AgentLoop, MultiTurnSettings, agent_metrics, agent_reward_info
from meshrl.rollout.base import SamplingConfig
from meshrl.rollout.interactions.base import Interaction
from meshrl.rollout.interactions.gsm8k import CORRECT, INCORRECT, Gsm8kInteraction
from meshrl.rollout.tools import ToolRunner
from meshrl.rollout.tools.calculator import CalculatorTool

SYSTEM = [{"role": "system", "content": "Answer after ####."}, {"role": "user", "content": "6 * 7?"}]


class Recording(Gsm8kInteraction):
    """verl's GSM8K interaction that records what it was given and which instances it finalized."""

    def __init__(self, config):
        super().__init__(config)
        self.seen: list[list[dict]] = []
        self.finalized: list[str] = []

    async def generate_response(self, instance_id, messages, **kwargs):
        self.seen.append([dict(m) for m in messages])
        return await super().generate_response(instance_id, messages, **kwargs)

    async def finalize_interaction(self, instance_id, **kwargs):
        self.finalized.append(instance_id)
        await super().finalize_interaction(instance_id)


class Failing(Interaction):
    CONFIG_KEYS = frozenset({"mode"})

    async def generate_response(self, instance_id, messages, **kwargs):
        if self.config["mode"] == "raise":
            raise RuntimeError("the judge is down")
        if self.config["mode"] == "block":  # synchronous work: the interactions' loop cannot cancel it
            time.sleep(0.6)
            return False, "late", 0.0, {}
        await asyncio.sleep(60)


def make_loop(tiny_llama_dir, tokenizer, scripts, interactions, asynchronous=False, response_length=400,
              **settings):
    engine = ScriptedEngine(tiny_llama_dir, tokenizer, scripts)
    runner = ToolRunner([CalculatorTool({}, {"type": "function", "function": {"name": "calculator"}})],
                        max_response_chars=64)
    loop = AgentLoop(engine, tokenizer, runner, MultiTurnSettings(**settings), response_length,
                     ScriptedAsync(engine) if asynchronous else None, interactions)
    return engine, loop


def row(name="gsm8k", ground_truth="42"):
    return {"interaction_kwargs": {"name": name, "query": "6 * 7?", "ground_truth": ground_truth}}


# conversation 0: a tool turn, a wrong answer, the right one; conversation 1: right at once
SCRIPTS = [["Let me compute " + call("6 * 7"), "So #### 40", "Sorry: #### 42"], ["#### 42"]]


@pytest.mark.parametrize("asynchronous", [False, True])
def test_the_interaction_answers_turns_without_calls_and_its_user_turns_are_masked_tokens(
        tiny_llama_dir, tokenizer, asynchronous):
    interaction = Recording({"name": "gsm8k"})
    engine, loop = make_loop(tiny_llama_dir, tokenizer, SCRIPTS, {"gsm8k": interaction}, asynchronous)
    prompts = [[0, 500, 501], [1, 502]]
    completions, stats = loop.generate(prompts, SamplingConfig(max_response_length=400), [row(), row()],
                                       [SYSTEM, SYSTEM])
    first, second = completions
    # Every request was the prompt followed by exactly the response so far (token in, token out).
    for prompt, _ in engine.requests:
        conversation = prompts[prompt[0]]
        assert prompt[len(conversation):] == completions[prompt[0]].token_ids[:len(prompt) - len(conversation)]
    # The response: the three sampled turns (mask 1) and between and after them the tool / user deltas (mask 0).
    sampled, position, gaps = engine.sampled[0], 0, []
    for turn in sampled:
        start = first.token_ids.index(turn[0], position)
        assert first.token_ids[start:start + len(turn)] == turn and set(first.loss_mask[start:start + len(turn)]) == {1}
        gaps.append((position, start))
        position = start + len(turn)
    gaps = gaps[1:] + [(position, len(first.token_ids))]
    for a, b in gaps:
        assert set(first.loss_mask[a:b]) == {0} and set(first.logprobs[a:b]) == {0.0}
    texts = [tokenizer.decode(first.token_ids[a:b]) for a, b in gaps]
    assert texts == ["\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n",
                     f"\n<|im_start|>user\n{INCORRECT}<|im_end|>\n<|im_start|>assistant\n",
                     f"\n<|im_start|>user\n{CORRECT}<|im_end|>\n<|im_start|>assistant\n"]  # verl appends the last one
    assert (first.finish_reason, second.finish_reason) == ("stop", "stop")
    # The turn scores (verl: the interaction's reward per turn) and turns as verl counts them.
    assert [s.turn_scores for s in stats] == [[0.0, 1.0], [1.0]]
    assert (stats[0].assistant_turns, stats[0].user_turns, stats[0].interaction_turns) == (3, 3, 2)
    assert agent_reward_info(stats[0]) == {"turn_scores": [0.0, 1.0], "tool_rewards": [0.0], "num_turns": 7}
    # The conversation the interaction read: the prompt's messages, each turn decoded, tool and user messages.
    assert interaction.seen[-1][:2] == SYSTEM and [m["role"] for m in interaction.seen[-1]] == \
        ["system", "user", "assistant", "tool", "assistant", "user", "assistant"]
    assert interaction.seen[-1][-1]["content"] == "Sorry: #### 42" and interaction.seen[-1][3]["content"] == "42"
    assert len(interaction.finalized) == 2 and not interaction._instances  # every conversation released
    metrics = agent_metrics(stats, [c.finish_reason for c in completions])
    assert metrics["interaction/gsm8k/turns/mean"] == 1.5 and metrics["interaction/gsm8k/turn_1/score"] == 0.5
    assert metrics["interaction/gsm8k/turn_2/score"] == 1.0 and metrics["interaction/gsm8k/errors"] == 0


@pytest.mark.parametrize("settings,assistant_turns", [(dict(max_user_turns=2), 3), (dict(max_assistant_turns=2), 2)])
def test_turn_limits_count_interaction_turns(tiny_llama_dir, tokenizer, settings, assistant_turns):
    wrong = [["#### 1", "#### 2", "#### 3", "#### 4"]]
    _, loop = make_loop(tiny_llama_dir, tokenizer, wrong, {"gsm8k": Gsm8kInteraction({"name": "gsm8k"})}, **settings)
    (completion,), (stats,) = loop.generate([[0, 9]], SamplingConfig(max_response_length=400), [row()], [SYSTEM])
    assert (completion.finish_reason, stats.assistant_turns) == ("max_turns", assistant_turns)
    assert stats.turn_scores == [0.0] * (assistant_turns - 1)


def test_a_user_turn_that_does_not_fit_ends_the_response_on_the_sampled_turn(tiny_llama_dir, tokenizer):
    first_turn = len(tokenizer("#### 1", add_special_tokens=False)["input_ids"]) + 1
    _, loop = make_loop(tiny_llama_dir, tokenizer, [["#### 1", "#### 2"]],
                        {"gsm8k": Gsm8kInteraction({"name": "gsm8k"})}, response_length=first_turn + 5)
    (completion,), (stats,) = loop.generate([[0, 9]], SamplingConfig(max_response_length=400), [row()], [SYSTEM])
    assert completion.finish_reason == "length" and len(completion.token_ids) == first_turn
    assert stats.turn_scores == [0.0] and stats.user_turns == 0


@pytest.mark.parametrize("asynchronous", [False, True])
@pytest.mark.parametrize("mode,error", [("raise", "error"), ("hang", "timeout"), ("block", "timeout")])
def test_a_failing_or_hanging_interaction_ends_only_its_own_conversation(tiny_llama_dir, tokenizer, asynchronous,
                                                                         mode, error, caplog):
    interactions = {"gsm8k": Gsm8kInteraction({"name": "gsm8k"}),
                    "bad": Failing({"name": "bad", "mode": mode, "timeout_s": 0.2})}
    scripts = [["#### 5", "#### 42"], ["#### 5", "#### 42"]]
    _, loop = make_loop(tiny_llama_dir, tokenizer, scripts, interactions, asynchronous)
    completions, stats = loop.generate([[0, 9], [1, 9]], SamplingConfig(max_response_length=400),
                                       [row("bad"), row()], [SYSTEM, SYSTEM])
    assert [c.finish_reason for c in completions] == ["interaction_error", "stop"]
    assert stats[0].interaction_error == error and stats[0].assistant_turns == 1 and stats[0].user_turns == 0
    assert stats[1].turn_scores == [0.0, 1.0]  # the other conversation went on (behind a block: once it ends)
    assert "interaction 'bad' failed" in caplog.text
    metrics = agent_metrics(stats, [c.finish_reason for c in completions])
    assert metrics["interaction/bad/errors"] == 1 and metrics["interaction/bad/timeouts"] == (error == "timeout")
    assert metrics["agent/finish/interaction_error"] == 0.5


def test_a_row_must_name_a_configured_interaction(tiny_llama_dir, tokenizer):
    from meshrl.rollout.interactions.config import row_problems

    interactions = {"gsm8k": Gsm8kInteraction({"name": "gsm8k"})}
    _, loop = make_loop(tiny_llama_dir, tokenizer, [["#### 1"]], interactions)
    with pytest.raises(ValueError, match=r"interaction_kwargs.name='chess' is not an interaction.*\['gsm8k'\]"):
        loop.generate([[0, 9]], SamplingConfig(max_response_length=400), [row("chess")], [SYSTEM])
    with pytest.raises(ValueError, match="raw_prompt"):
        loop.generate([[0, 9]], SamplingConfig(max_response_length=400), [row()])
    problems = row_problems(interactions, [("a.parquet row 0", row()), ("a.parquet row 1", {}),
                                           ("a.parquet row 2", row("chess"))])
    assert [p.split(":")[0] for p in problems] == ["a.parquet row 1", "a.parquet row 2"]
    assert "needs extra_info.interaction_kwargs.name" in problems[0]


def test_verls_gsm8k_interaction_answers_as_verls():
    interaction = Gsm8kInteraction({"name": "gsm8k"})

    async def conversation():
        instance = await interaction.start_interaction("i1", name="gsm8k", ground_truth="72", query="q")
        wrong = await interaction.generate_response(instance, [{"role": "assistant", "content": "#### 70"},
                                                               {"role": "user", "content": "x"}], name="gsm8k")
        right = await interaction.generate_response(instance, [{"role": "assistant", "content": "So #### 72"}])
        flexible_only = await interaction.generate_response(instance, [{"role": "assistant", "content": "It is 72"}])
        await interaction.finalize_interaction(instance)
        return wrong, right, flexible_only

    wrong, right, flexible_only = asyncio.run(conversation())
    assert wrong == (False, INCORRECT, 0.0, {}) and right == (True, CORRECT, 1.0, {})
    assert flexible_only[2] == 0.0  # verl scores the interaction strictly (#### only)
    assert interaction._instances == {}


def test_turn_scores_and_tool_rewards_reach_the_reward_functions_extra_info_as_verl_passes_them(tokenizer):
    """The driver's scoring adds each multi-turn row's turn scores, tool rewards and turn count to a copy of its
    extra_info."""
    from types import SimpleNamespace

    import numpy as np
    import torch

    from meshrl.protocol import Batch
    from meshrl.rewards.pool import RewardBatch
    from meshrl.rollout.agent_loop import AGENT_STATS, AgentStats
    from meshrl.rollout.tools.base import CallResult
    from meshrl.trainer.rl_trainer import RLTrainer

    seen = []

    def score(sources, solutions, truths, extra_infos):
        seen.extend(extra_infos)
        return RewardBatch([1.0] * len(solutions), {}, {})

    rows = [{"index": 3}, None]
    stats = [AgentStats(assistant_turns=2, user_turns=1, turn_scores=[0.5]), AgentStats(assistant_turns=1)]
    stats[0].add_call("check", CallResult("wrong", reward=-0.05))
    batch = Batch(tensors={"responses": torch.tensor([[5, 6], [7, 0]]), "response_mask": torch.ones(2, 2)},
                  non_tensors={"extra_info": rows, "reward_source": ["a", "a"], "ground_truth": ["1", "2"],
                               AGENT_STATS: np.array(stats, dtype=object)})
    RLTrainer.function_scores(SimpleNamespace(reward=SimpleNamespace(score=score), tokenizer=tokenizer, overlong=None),
                              batch, None)
    assert seen == [{"index": 3, "turn_scores": [0.5], "tool_rewards": [-0.05], "num_turns": 4},
                    {"turn_scores": [], "tool_rewards": [], "num_turns": 2}]
    assert rows[0] == {"index": 3}  # the rows' own extra_info is not changed
