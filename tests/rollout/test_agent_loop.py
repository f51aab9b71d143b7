"""The multi-turn loop on a scripted engine: the trainer's tokens are the engine's, turn limits, length
budget, tool failures and metrics (the real-engine check is tests/rollout/test_agent_vllm.py)."""

import json

import pytest
from transformers import AutoTokenizer

from meshrl.rollout.agent_loop import AgentLoop, MessageTokens, MultiTurnSettings, agent_metrics
from meshrl.rollout.base import Completion, EngineConfig, RolloutEngine, SamplingConfig
from meshrl.rollout.tools import ToolRunner
from meshrl.rollout.tools.calculator import CalculatorTool


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir):
    return AutoTokenizer.from_pretrained(tiny_llama_dir)


class ScriptedEngine(RolloutEngine):
    """Answers a conversation (named by its prompt's first id) with its script's k-th turn when its request
    holds k − 1 tool deltas (each ends with the template's assistant header); records every request."""

    name = "scripted"

    def __init__(self, path, tokenizer, scripts: list[list[str]]):
        super().__init__(path, EngineConfig(name="hf", max_model_len=4096), dp_rank=0)
        self.tokenizer = tokenizer
        self.scripts = scripts
        self.requests: list[tuple[list[int], int]] = []
        self.header = tokenizer("<|im_start|>assistant", add_special_tokens=False)["input_ids"]
        self.sampled: dict[int, list[list[int]]] = {}

    def _generate(self, prompts, sampling, seeds, max_tokens):
        out = []
        for index, (prompt, cap) in enumerate(zip(prompts, max_tokens)):
            self.requests.append((prompt, cap))
            conversation = prompt[0]
            turn = sum(prompt[i:i + len(self.header)] == self.header for i in range(len(prompt)))
            ids = self.tokenizer(self.scripts[conversation][turn], add_special_tokens=False)["input_ids"]
            ids = ids + self.eos_token_ids[:1]
            reason = "stop" if len(ids) <= cap else "length"
            ids = ids[:cap]
            self.sampled.setdefault(conversation, []).append(ids)
            out.append(Completion(index, 0, ids, [-0.25 - 0.01 * t for t in range(len(ids))], reason))
        return out

    def expected_weights(self):
        return {}

    def begin_weight_update(self):
        pass

    def load_weight_bucket(self, bucket):
        pass

    def _finish_weight_update(self):
        pass


def call(expression: str) -> str:
    return "<tool_call>" + json.dumps({"name": "calculator", "arguments": {"expression": expression}}) + "</tool_call>"


def make_loop(tiny_llama_dir, tokenizer, scripts, response_length=400, **settings):
    engine = ScriptedEngine(tiny_llama_dir, tokenizer, scripts)
    runner = ToolRunner([CalculatorTool({}, {"type": "function", "function": {"name": "calculator"}})],
                        max_response_chars=64)
    return engine, AgentLoop(engine, tokenizer, runner, MultiTurnSettings(**settings), response_length)


SCRIPTS = [
    ["First " + call("6 * 7"), "Then " + call("42 + 1") + call("1/0"), "The answer is 43."],
    ["No tools needed: 5."],
]


def test_training_tokens_are_the_engines_tokens_across_turns(tiny_llama_dir, tokenizer):
    engine, loop = make_loop(tiny_llama_dir, tokenizer, SCRIPTS, max_parallel_calls=2)
    prompts = [[0, 500, 501], [1, 502]]
    completions, stats = loop.generate(prompts, SamplingConfig(max_response_length=400))
    first, second = completions
    # Every request the engine got was the prompt followed by exactly the tokens of the response so far.
    for prompt, cap in engine.requests:
        conversation = prompts[prompt[0]]
        response = completions[prompt[0]].token_ids
        assert prompt[:len(conversation)] == conversation
        assert prompt[len(conversation):] == response[:len(prompt) - len(conversation)]
        assert cap == 400 - (len(prompt) - len(conversation))
    # The response is the sampled turns (mask 1, their log-probs) and the tool deltas between them (mask 0).
    sampled = engine.sampled[0]
    assert len(sampled) == 3
    spans, position = [], 0
    for turn in sampled:
        start = first.token_ids.index(turn[0], position)
        assert first.token_ids[start:start + len(turn)] == turn
        assert first.loss_mask[start:start + len(turn)] == [1] * len(turn)
        assert first.logprobs[start:start + len(turn)] == [-0.25 - 0.01 * t for t in range(len(turn))]
        spans.append((start, start + len(turn)))
        position = start + len(turn)
    assert spans[0][0] == 0 and spans[-1][1] == len(first.token_ids)
    tool_parts = [first.token_ids[a_end:b_start] for (_, a_end), (b_start, _) in zip(spans, spans[1:])]
    assert all(first.loss_mask[a:b] == [0] * (b - a) for (_, a), (b, _) in zip(spans, spans[1:]))
    assert all(first.logprobs[a:b] == [0.0] * (b - a) for (_, a), (b, _) in zip(spans, spans[1:]))
    texts = [tokenizer.decode(part) for part in tool_parts]
    assert texts[0] == "\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"
    assert texts[1] == ("\n<|im_start|>tool\n43<|im_end|>\n<|im_start|>tool\nError executing tool 'calculator': "
                        "division by zero<|im_end|>\n<|im_start|>assistant\n")
    assert first.finish_reason == "stop" and second.finish_reason == "stop"
    assert second.token_ids == engine.sampled[1][0] and second.loss_mask == [1] * len(second.token_ids)
    assert (stats[0].assistant_turns, stats[0].user_turns) == (3, 2)
    metrics = agent_metrics(stats, [c.finish_reason for c in completions])
    assert metrics["agent/num_turns/max"] == 6 and metrics["agent/num_turns/min"] == 2
    assert metrics["tool/calculator/calls"] == 3 and metrics["tool/calculator/errors"] == 1
    assert metrics["agent/turn_3/samples"] == 1 and metrics["agent/turn_1/samples"] == 2


def test_the_delta_is_what_the_template_puts_between_two_assistant_turns(tokenizer):
    delta = MessageTokens(tokenizer, [tokenizer.convert_tokens_to_ids("<|im_end|>")])
    before = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "call"}]
    full = tokenizer.apply_chat_template(before + [{"role": "tool", "content": "7"}], add_generation_prompt=True,
                                         tokenize=False)
    head = tokenizer.apply_chat_template(before, tokenize=False)
    head = head[:head.rindex("<|im_end|>") + len("<|im_end|>")]
    assert tokenizer.decode(delta([{"role": "tool", "content": "7"}])) == full[len(head):]


@pytest.mark.parametrize("settings,turns,reason", [
    (dict(max_assistant_turns=2), 2, "max_turns"),  # the second turn's call is not run
    (dict(max_user_turns=1), 2, "max_turns"),
    (dict(), 3, "stop"),
])
def test_turn_limits(tiny_llama_dir, tokenizer, settings, turns, reason):
    engine, loop = make_loop(tiny_llama_dir, tokenizer, SCRIPTS[:1], max_parallel_calls=2, **settings)
    (completion,), (stats,) = loop.generate([[0, 9]], SamplingConfig(max_response_length=400))
    assert (stats.assistant_turns, completion.finish_reason) == (turns, reason)
    assert completion.token_ids[-len(engine.sampled[0][-1]):] == engine.sampled[0][-1]  # ends on a sampled turn
    assert stats.user_turns == turns - 1


def test_max_parallel_calls_runs_the_first_calls_only(tiny_llama_dir, tokenizer):
    _, loop = make_loop(tiny_llama_dir, tokenizer, SCRIPTS[:1], max_parallel_calls=1)
    _, (stats,) = loop.generate([[0, 9]], SamplingConfig(max_response_length=400))
    assert stats.tools["calculator"][0] == 2  # one per calling turn


def test_the_response_budget_cuts_a_turn_and_never_appends_a_tool_delta_that_does_not_fit(tiny_llama_dir, tokenizer):
    first_turn = len(tokenizer("First " + call("6 * 7"), add_special_tokens=False)["input_ids"]) + 1
    # The budget admits the first turn but not its tool delta: the response ends on the sampled turn.
    _, loop = make_loop(tiny_llama_dir, tokenizer, SCRIPTS[:1], response_length=first_turn + 5)
    (completion,), _ = loop.generate([[0, 9]], SamplingConfig(max_response_length=first_turn + 5))
    assert completion.finish_reason == "length" and len(completion.token_ids) == first_turn
    # A budget inside the second turn: that turn is cut at the budget.
    _, loop = make_loop(tiny_llama_dir, tokenizer, SCRIPTS[:1], response_length=first_turn + 30)
    (completion,), _ = loop.generate([[0, 9]], SamplingConfig(max_response_length=first_turn + 30))
    assert completion.finish_reason == "length" and len(completion.token_ids) == first_turn + 30
    assert completion.loss_mask[-1] == 1


def test_n_samples_per_prompt_are_separate_conversations(tiny_llama_dir, tokenizer):
    engine, loop = make_loop(tiny_llama_dir, tokenizer, SCRIPTS)
    completions, stats = loop.generate([[0, 3], [1, 4]], SamplingConfig(n=2, max_response_length=400))
    assert [(c.prompt_index, c.sample_index) for c in completions] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [s.assistant_turns for s in stats] == [3, 3, 1, 1]
    assert len(engine.requests) == 3 + 3 + 1 + 1


def test_the_hf_engine_caps_each_prompt_at_its_own_max_tokens(tiny_llama_dir):
    from meshrl.rollout import create_engine

    engine = create_engine(tiny_llama_dir, EngineConfig(name="hf", hf_batch_size=4, max_model_len=64,
                                                        enable_prefix_caching=False))
    try:
        greedy = SamplingConfig(temperature=0, max_response_length=10, ignore_eos=True)
        full = engine.generate([[5, 6, 7], [8, 9]], greedy)
        capped = engine.generate([[5, 6, 7], [8, 9]], greedy, max_tokens=[3, 10])
        with pytest.raises(ValueError, match="max_tokens"):
            engine.generate([[5, 6, 7]], greedy, max_tokens=[11])
    finally:
        engine.shutdown()
    assert capped[0].token_ids == full[0].token_ids[:3] and capped[0].finish_reason == "length"
    assert capped[1].token_ids == full[1].token_ids and len(capped[1].token_ids) == 10


def test_qwen3_coder_calls_run_through_the_loop(tiny_llama_dir, tokenizer):
    from test_tool_parsers import qwen3_coder_call

    script = [["First " + qwen3_coder_call("calculator", expression="6 * 7"), "It is 42."]]
    engine, loop = make_loop(tiny_llama_dir, tokenizer, script, format="qwen3_coder")
    (completion,), (stats,) = loop.generate([[0, 9]], SamplingConfig(max_response_length=400))
    assert (stats.assistant_turns, stats.tools["calculator"][:2]) == (2, [1.0, 0.0])
    assert "<|im_start|>tool\n42<|im_end|>" in tokenizer.decode(completion.token_ids)
