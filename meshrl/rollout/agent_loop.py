"""Multi-turn tool-calling rollout with exact tokens (verl's ``tool_agent`` loop on meshrl's engines).

Per sample, with R = the response length (``rollout.response_length`` / ``data.max_response_length``)::

    response ← []                                        token ids the trainer will see, in order
    loop:
        turn ← engine.generate(prompt + response, max_tokens = R − |response|)     (loss mask 1)
        response += turn;  assistant_turns += 1
        stop ("length") when the turn ran out of tokens or |response| ≥ R
        calls ← parse(decode(turn))          rollout.multi_turn.format (meshrl.rollout.tool_parsers)
        stop ("stop") when the turn has no call
        stop ("max_turns") when assistant_turns ≥ max_assistant_turns or user_turns ≥ max_user_turns
        outputs ← run calls[:max_parallel_calls], all samples' calls at once (meshrl.rollout.tools)
        delta ← the chat template's tokens for the tool messages after the turn's end      (loss mask 0)
        stop ("length") when |response| + |delta| ≥ R, without appending it (verl)
        response += delta;  user_turns += 1

**Token in, token out.** The engine is given, and the trainer receives, ``prompt + response`` built only by
appending: the engine's sampled ids as they came and each tool delta. Nothing is re-tokenised, so the
trainer's tokens are the engine's byte for byte (a transcript re-tokenised from text could merge tokens
across turn boundaries, and the trained log-probs would not be those of what was sampled).

**The tool delta** (``ToolMessageTokens``): the template renders a fixed conversation ``[user, assistant]``,
and the same followed by the tool messages with the generation prompt; the delta is the second's tokens
after the first one's end-of-turn token (the last of the engine's stop ids in it), e.g. for ChatML
``\\n<|im_start|>tool\\n{output}<|im_end|>\\n<|im_start|>assistant\\n``. It is what the template puts
between an assistant turn that ended at its stop token and the next assistant turn. A template for which
the first rendering is not a prefix of the second (or that ends no assistant turn with a stop id) is
refused when the loop is built. The tool schemas are not rendered into the delta (they belong to the
prompt: the dataset renders them, ``meshrl.data.dataset.load_datasets``).

**Batching** (``rollout.mode=sync``). Each turn is one ``generate`` call for every sample still running
(the engine batches them), so a batch takes as many engine calls as its longest conversation has
assistant turns, and every turn waits for the slowest sample's turn and tools; the samples of one prompt
start from one prompt each (``n`` rows), not from vLLM's ``n``, so their seeds differ from a single-turn
rollout's.

**Async** (``rollout.mode=async``, ``meshrl.rollout.async_engine``). One coroutine per sample runs the loop
above on its own: each turn is one engine request, its tools run on a thread (``asyncio.to_thread`` around
the runner) while the other samples keep generating, and its next turn joins the engine's running batch
as soon as they answer. Turn k of sample j of prompt i is seeded ``turn_seed(seed_i + j, k)``, so the
first turn draws what a single-turn rollout's sample j would.

Output: one ``Completion`` per sample (prompt-major) whose ``loss_mask`` is 0 on tool tokens (log-prob 0
there), and per sample the statistics ``AgentStats`` that ``agent_metrics`` turns into the rollout's
``agent/*`` (per turn) and ``tool/<name>/*`` (per tool) metrics.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import numpy as np

from meshrl.rollout.base import Completion, RolloutEngine, SamplingConfig, section_getter
from meshrl.rollout.tool_parsers import tool_parser
from meshrl.rollout.tools.base import CallResult, Invocation, ToolRunner
from meshrl.rollout.tools.config import load_tools, tool_schemas

if TYPE_CHECKING:  # the async engine imports vLLM's engine module; a multi-turn loop without it need not
    from meshrl.rollout.async_engine import AsyncEngine

FINISH_REASONS = ("stop", "length", "max_turns")


@dataclass(frozen=True)
class MultiTurnSettings:
    """verl's ``rollout.multi_turn`` keys the loop reads (None / 0 turn limits: unlimited, as in verl)."""

    max_assistant_turns: int | None = None
    max_user_turns: int | None = None
    max_parallel_calls: int = 1
    format: str = "hermes"

    def __post_init__(self) -> None:
        if self.max_parallel_calls < 1:
            raise ValueError("actor_rollout_ref.rollout.multi_turn.max_parallel_calls must be >= 1, got "
                             f"{self.max_parallel_calls}")
        for key in ("max_assistant_turns", "max_user_turns"):
            if (getattr(self, key) or 0) < 0:
                raise ValueError(f"actor_rollout_ref.rollout.multi_turn.{key} must be None or 0 (no limit) or a "
                                 f"positive turn count, got {getattr(self, key)}")
        tool_parser(self.format)  # an unknown format raises here, naming the known ones

    @classmethod
    def from_rollout(cls, multi_turn: Any) -> MultiTurnSettings:
        get = section_getter(multi_turn)
        return cls(max_assistant_turns=get("max_assistant_turns"), max_user_turns=get("max_user_turns"),
                   max_parallel_calls=int(get("max_parallel_calls", 1)), format=str(get("format", "hermes")))


class ToolMessageTokens:
    """Token ids of tool messages as the chat template appends them after an assistant turn (module doc)."""

    _BASE = ({"role": "user", "content": "U"}, {"role": "assistant", "content": "A"})

    def __init__(self, tokenizer: Any, stop_token_ids: Sequence[int]) -> None:
        self.tokenizer = tokenizer
        base = self._render(list(self._BASE), generation_prompt=False)
        ends = [i for i, token in enumerate(base) if token in set(stop_token_ids)]
        if not ends:
            raise ValueError(f"the chat template ends no assistant turn with a stop token {list(stop_token_ids)}; "
                             "multi-turn rollouts need one to know where a turn ends")
        self.prefix = base[:ends[-1] + 1]

    def _render(self, messages: list[dict[str, str]], generation_prompt: bool) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def __call__(self, outputs: Sequence[str]) -> list[int]:
        messages = list(self._BASE) + [{"role": "tool", "content": text} for text in outputs]
        ids = self._render(messages, generation_prompt=True)
        if ids[:len(self.prefix)] != self.prefix:
            raise ValueError("the chat template renders an assistant turn differently when tool messages follow it; "
                             "its tool-message tokens cannot be appended to the sampled ones")
        return ids[len(self.prefix):]


@dataclass
class AgentStats:
    """One sample's conversation: turns, calls, and per tool ``[calls, errors, timeouts, truncated, seconds]``."""

    assistant_turns: int = 0
    user_turns: int = 0
    malformed_calls: int = 0
    tool_tokens: int = 0
    tools: dict[str, list[float]] = field(default_factory=dict)

    def add_call(self, name: str, result: CallResult) -> None:
        row = self.tools.setdefault(name, [0.0] * 5)
        for index, value in enumerate((1, result.error, result.timeout, result.truncated, result.seconds)):
            row[index] += float(value)


@dataclass
class _Sample:
    prompt_index: int
    sample_index: int
    prompt: list[int]
    tools_kwargs: Mapping[str, Any]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    finish: str | None = None
    stats: AgentStats = field(default_factory=AgentStats)

    def append(self, tokens: Sequence[int], logprobs: Sequence[float], sampled: bool) -> None:
        self.tokens += list(tokens)
        self.logprobs += list(logprobs)
        self.mask += [int(sampled)] * len(tokens)


class AgentLoop:
    """The multi-turn loop of the module docstring over one engine, with ``runner``'s tools."""

    def __init__(self, engine: RolloutEngine, tokenizer: Any, runner: ToolRunner, settings: MultiTurnSettings,
                 response_length: int, async_engine: AsyncEngine | None = None) -> None:
        self.engine = engine
        self.async_engine = async_engine  # rollout.mode=async: one coroutine per conversation
        self.tokenizer = tokenizer
        self.runner = runner
        self.settings = settings
        self.response_length = response_length
        self.parser = tool_parser(settings.format)
        self.tool_tokens = ToolMessageTokens(tokenizer, engine.eos_token_ids)

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig,
                 tools_kwargs: Sequence[Mapping[str, Any]] | None = None) -> tuple[list[Completion], list[AgentStats]]:
        """``sampling.n`` conversations per prompt, prompt-major; ``tools_kwargs[i]`` is prompt i's
        ``extra_info.tools_kwargs``. Returns their completions and statistics."""
        kwargs = list(tools_kwargs) if tools_kwargs is not None else [{}] * len(prompts)
        samples = [_Sample(i, j, list(map(int, prompt)), kwargs[i] or {})
                   for i, prompt in enumerate(prompts) for j in range(sampling.n)]
        turn = replace(sampling, n=1, max_response_length=min(sampling.max_response_length, self.response_length))
        if self.async_engine is None:
            self._converse_in_batches(samples, turn)
        else:
            self._converse_async(samples, turn, prompts)
        completions = [Completion(s.prompt_index, s.sample_index, s.tokens, s.logprobs, s.finish, loss_mask=s.mask)
                       for s in samples]
        return completions, [s.stats for s in samples]

    def _cap(self, sample: _Sample, turn: SamplingConfig) -> int:
        return min(self.response_length - len(sample.tokens), turn.max_response_length)

    def _converse_in_batches(self, samples: list[_Sample], turn: SamplingConfig) -> None:
        active = samples
        while active:
            outputs = self.engine.generate([s.prompt + s.tokens for s in active], turn,
                                           max_tokens=[self._cap(s, turn) for s in active])
            calling = [(s, calls) for s, out in zip(active, outputs) if (calls := self._after_turn(s, out))]
            results = iter(self.runner.run(self._invocations(calling)))
            for sample, calls in calling:
                self._append_tool_outputs(sample, calls, [next(results) for _ in calls])
            active = [s for s in samples if s.finish is None]

    def _converse_async(self, samples: list[_Sample], turn: SamplingConfig, prompts: Sequence[Sequence[int]]) -> None:
        """One coroutine per conversation on the async engine; its tools run on the runner's threads while
        the other conversations generate. Turn k of sample j of prompt i is seeded with
        ``turn_seed(seeds[i] + j, k)`` (``meshrl.rollout.async_engine``)."""
        from meshrl.rollout.async_engine import turn_seed

        engine = self.async_engine
        assert engine is not None
        _, seeds, _ = self.engine.reserve_call(prompts, turn)

        async def converse(sample: _Sample) -> None:
            seed = seeds[sample.prompt_index] + sample.sample_index
            while sample.finish is None:
                out = await engine.sample(sample.prompt + sample.tokens, turn,
                                          turn_seed(seed, sample.stats.assistant_turns), self._cap(sample, turn))
                if calls := self._after_turn(sample, out):
                    results = await asyncio.to_thread(self.runner.run, self._invocations([(sample, calls)]))
                    self._append_tool_outputs(sample, calls, results)

        async def conversations() -> None:
            await asyncio.gather(*(converse(s) for s in samples))

        engine.run(conversations)

    def _after_turn(self, sample: _Sample, out: Completion) -> list:
        """Append a generated turn; the calls to run now, or [] with ``sample.finish`` set."""
        sample.append(out.token_ids, out.logprobs, sampled=True)
        stats = sample.stats
        stats.assistant_turns += 1
        if out.finish_reason == "length" or len(sample.tokens) >= self.response_length:
            sample.finish = "length"
            return []
        # verl's hermes parser decodes with special tokens kept (<tool_call> may be one).
        parsed = self.parser.parse(self.tokenizer.decode(out.token_ids, skip_special_tokens=False))
        stats.malformed_calls += parsed.malformed
        settings = self.settings
        if not parsed.calls:
            sample.finish = "stop"
        elif (settings.max_assistant_turns and stats.assistant_turns >= settings.max_assistant_turns) or \
                (settings.max_user_turns and stats.user_turns >= settings.max_user_turns):
            sample.finish = "max_turns"
        return [] if sample.finish else parsed.calls[:settings.max_parallel_calls]

    @staticmethod
    def _invocations(calling: list) -> list[Invocation]:
        return [Invocation(call.name, call.arguments, sample.tools_kwargs) for sample, calls in calling for call in calls]

    def _append_tool_outputs(self, sample: _Sample, calls: list, results: Sequence[CallResult]) -> None:
        """Count the calls and append their tool messages' tokens (loss mask 0), or end the sample at "length"."""
        for call, result in zip(calls, results):
            sample.stats.add_call(call.name if call.name in self.runner.tools else "unknown", result)
        delta = self.tool_tokens([result.text for result in results])
        if len(sample.tokens) + len(delta) >= self.response_length:
            sample.finish = "length"
            return
        sample.append(delta, [0.0] * len(delta), sampled=False)
        sample.stats.tool_tokens += len(delta)
        sample.stats.user_turns += 1


AGENT_STATS = "agent_stats"  # the RL batch's per-row AgentStats field (a multi-turn rollout's)


def agent_loop_for(rollout: Any, engine: RolloutEngine, tokenizer: Any, response_length: int,
                   async_engine: AsyncEngine | None = None) -> AgentLoop | None:
    """The loop a verl ``rollout`` section asks for on ``engine`` (conversations as coroutines on
    ``async_engine`` when given: ``rollout.mode=async``): None unless ``multi_turn.enable``."""
    multi_turn = section_getter(rollout)("multi_turn") or {}
    if not section_getter(multi_turn)("enable", False):
        return None
    return AgentLoop(engine, tokenizer, tool_runner(multi_turn), MultiTurnSettings.from_rollout(multi_turn),
                     response_length, async_engine)


def prompt_tool_schemas(multi_turn: Any) -> list[dict[str, Any]] | None:
    """The OpenAI schemas of ``rollout.multi_turn``'s tools, which the prompts' chat template renders
    (``meshrl.data.dataset.load_datasets``); None when multi-turn is off or has no tools."""
    get = section_getter(multi_turn)
    if not get("enable", False) or not get("tool_config_path"):
        return None
    return tool_schemas(load_tools(get("tool_config_path")))


def tools_kwargs_of(extra_infos: Sequence[Mapping[str, Any] | None]) -> list[Mapping[str, Any]]:
    """Each row's ``extra_info.tools_kwargs`` (verl's per-sample tool arguments), {} where it has none."""
    return [(info or {}).get("tools_kwargs") or {} for info in extra_infos]


def tool_runner(multi_turn: Any) -> ToolRunner:
    """The runner of ``rollout.multi_turn``'s tools (``tool_config_path``; none without one), truncating their
    outputs by ``max_tool_response_length`` / ``tool_response_truncate_side``."""
    get = section_getter(multi_turn)
    tools = load_tools(get("tool_config_path")) if get("tool_config_path") else []
    return ToolRunner(tools, max_response_chars=int(get("max_tool_response_length", 256)),
                      truncate_side=str(get("tool_response_truncate_side", "middle")))


_TOOL_FIELDS = ("calls", "errors", "timeouts", "truncated")


def agent_metrics(stats: Sequence[AgentStats], finish_reasons: Sequence[str]) -> dict[str, float]:
    """A rollout's ``agent/*`` metrics (turns per sample, as verl's ``num_turns`` counts them: assistant +
    tool turns + 1 for the prompt; finish reasons; how many samples reached each assistant turn) and its
    ``tool/<name>/*`` metrics (calls, errors, timeouts, truncated outputs, mean seconds per call; calls of
    names the tool config lacks count under ``unknown``)."""
    if not stats:
        return {}
    turns = np.array([s.assistant_turns + s.user_turns + 1 for s in stats], dtype=np.float64)
    calls = np.array([sum(row[0] for row in s.tools.values()) for s in stats], dtype=np.float64)
    out = {"agent/num_turns/mean": float(turns.mean()), "agent/num_turns/max": float(turns.max()),
           "agent/num_turns/min": float(turns.min()), "agent/tool_calls/mean": float(calls.mean()),
           "agent/tool_tokens/mean": float(np.mean([s.tool_tokens for s in stats])),
           "agent/malformed_calls": float(sum(s.malformed_calls for s in stats))}
    for reason in FINISH_REASONS:
        out[f"agent/finish/{reason}"] = float(np.mean([r == reason for r in finish_reasons]))
    for k in range(1, max(s.assistant_turns for s in stats) + 1):
        out[f"agent/turn_{k}/samples"] = float(sum(s.assistant_turns >= k for s in stats))
    totals: dict[str, np.ndarray] = {}
    for s in stats:
        for name, row in s.tools.items():
            totals[name] = totals.get(name, np.zeros(5)) + np.asarray(row)
    for name, total in sorted(totals.items()):
        out.update({f"tool/{name}/{key}": float(value) for key, value in zip(_TOOL_FIELDS, total)})
        out[f"tool/{name}/mean_seconds"] = float(total[4] / max(total[0], 1.0))
    return out
