"""Multi-turn tool-calling rollout with exact tokens (verl's ``tool_agent`` loop on meshrl's engines).

Per sample, with R = the response length (``rollout.response_length`` / ``data.max_response_length``)::

    response ← []                                        token ids the trainer will see, in order
    loop:
        turn ← engine.generate(prompt + response, max_tokens = R − |response|)     (loss mask 1)
        response += turn;  assistant_turns += 1
        stop ("length") when the turn ran out of tokens or |response| ≥ R
        calls ← parse(decode(turn))          rollout.multi_turn.format (meshrl.rollout.tool_parsers)
        stop ("stop") when the turn has no call and the sample has no interaction
        stop ("max_turns") when assistant_turns ≥ max_assistant_turns or user_turns ≥ max_user_turns
        if calls:
            outputs ← run calls[:max_parallel_calls], all samples' calls at once (meshrl.rollout.tools)
            delta ← the chat template's tokens for the tool messages after the turn's end  (loss mask 0)
        else:                                                             the interaction answers (below)
            terminate, text, score ← interaction.generate_response(messages)
            stop ("interaction_error") when it raised or did not answer in time, without a user turn
            turn_scores += score;  delta ← the template's tokens for the user message text  (loss mask 0)
        stop ("length") when |response| + |delta| ≥ R, without appending it (verl)
        response += delta;  user_turns += 1
        stop ("stop") when the interaction said terminate

**Token in, token out.** The engine is given, and the trainer receives, ``prompt + response`` built only by
appending: the engine's sampled ids as they came and each tool or user delta. Nothing is re-tokenised, so the
trainer's tokens are the engine's byte for byte (a transcript re-tokenised from text could merge tokens
across turn boundaries, and the trained log-probs would not be those of what was sampled).

**Images** (a vision-language model's prompts, verl's Geometry3K tool scripts): every turn of a conversation is
generated with its prompt's images (``generate(..., images=...)``; ``rollout.mode=sync``, on the HF engine where
vLLM cannot serve the model). The tool and user deltas are text, so the image pads stay in the prompt and the
trainer's 3-D positions continue past them as text, as transformers' ``get_rope_index`` numbers a sequence
(``meshrl.workers.sequences.mrope_columns``).

**The tool and user deltas** (``MessageTokens``): the template renders a fixed conversation ``[user,
assistant]``, and the same followed by the new messages (the tool messages, or the interaction's user
message) with the generation prompt; the delta is the second's tokens after the first one's end-of-turn
token (the last of the engine's stop ids in it), e.g. for ChatML
``\\n<|im_start|>tool\\n{output}<|im_end|>\\n<|im_start|>assistant\\n``. It is what the template puts
between an assistant turn that ended at its stop token and the next assistant turn. A template for which
the first rendering is not a prefix of the second (or that ends no assistant turn with a stop id) is
refused when the loop is built. The tool schemas are not rendered into the delta (they belong to the
prompt: the dataset renders them, ``meshrl.data.dataset.load_datasets``).

**Interactions** (``rollout.multi_turn.interaction_config_path``, ``meshrl.rollout.interactions``): each
sample's ``extra_info.interaction_kwargs.name`` picks the interaction that plays its user. As in verl's
``tool_agent`` loop, a turn with tool calls runs the tools and a turn without one goes to the interaction,
which sees the conversation as chat messages (the prompt's ``raw_prompt``, each assistant turn decoded
without special tokens, tool and user messages) and answers with a user message (appended as tokens,
loss mask 0, counted as a user turn for ``max_user_turns``), a turn score and whether to stop there; the
stopping user message is appended too, as verl appends it. The turn scores reach the reward function as
verl's agent loop passes them: ``extra_info["turn_scores"]`` (with the tool calls' ``tool_rewards`` and
``num_turns``: ``agent_reward_info``, read by ``meshrl.trainer.rl_trainer``).
An interaction that raises or outlives its ``timeout_s`` ends that sample's conversation (finish reason
``interaction_error``, a logged warning); the step goes on. A started interaction is finalized
(``finalize_interaction``) when its conversation ends (``meshrl.rollout.interactions.runner``).

**Batching** (``rollout.mode=sync``). Each turn is one ``generate`` call for every sample still running
(the engine batches them), so a batch takes as many engine calls as its longest conversation has
assistant turns, and every turn waits for the slowest sample's turn and tools; the samples of one prompt
start from one prompt each (``n`` rows), not from vLLM's ``n``, so their seeds differ from a single-turn
rollout's.

**Async** (``rollout.mode=async``, ``meshrl.rollout.async_engine``). One coroutine per sample runs the loop
above on its own: each turn is one engine request, its tools run on a thread (``asyncio.to_thread`` around
the runner) and its interaction on the interactions' loop while the other samples keep generating, and its next turn
joins the engine's running batch
as soon as they answer. Turn k of sample j of prompt i is seeded ``turn_seed(seed_i + j, k)``, so the
first turn draws what a single-turn rollout's sample j would.

Output: one ``Completion`` per sample (prompt-major) whose ``loss_mask`` is 0 on tool and user tokens
(log-prob 0 there), and per sample the statistics ``AgentStats`` that ``agent_metrics`` turns into the
rollout's ``agent/*`` (per turn), ``tool/<name>/*`` (per tool) and ``interaction/<name>/*`` metrics.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import numpy as np

from meshrl.rollout.base import Completion, RolloutEngine, SamplingConfig, section_getter
from meshrl.rollout.interactions.base import Interaction
from meshrl.rollout.interactions.config import interaction_for, interaction_kwargs_of, load_interactions
from meshrl.rollout.interactions.runner import Conversation, InteractionReply, InteractionRunner
from meshrl.rollout.tool_parsers import tool_parser
from meshrl.rollout.tools.base import CallResult, Invocation, ToolRunner
from meshrl.rollout.tools.config import load_all_tools, tool_schemas

if TYPE_CHECKING:  # the async engine imports vLLM's engine module; a multi-turn loop without it need not
    from meshrl.rollout.async_engine import AsyncEngine

FINISH_REASONS = ("stop", "length", "max_turns", "interaction_error")


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


class MessageTokens:
    """Token ids of messages (tool or user) as the chat template appends them after an assistant turn (module
    doc)."""

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

    def __call__(self, messages: Sequence[dict[str, str]]) -> list[int]:
        ids = self._render(list(self._BASE) + list(messages), generation_prompt=True)
        if ids[:len(self.prefix)] != self.prefix:
            raise ValueError(f"the chat template renders an assistant turn differently when {messages[0]['role']} "
                             "messages follow it; their tokens cannot be appended to the sampled ones")
        return ids[len(self.prefix):]


@dataclass
class AgentStats:
    """One sample's conversation: turns (``user_turns``: tool and interaction turns, as verl counts them),
    calls, per tool ``[calls, errors, timeouts, truncated, seconds, reward]`` (sums), every call's reward in
    order (``tool_rewards``), and its interaction's name, turns, failure (``interaction_error``: "timeout" or
    "error"), seconds waited and ``turn_scores``."""

    assistant_turns: int = 0
    user_turns: int = 0
    malformed_calls: int = 0
    tool_tokens: int = 0
    tools: dict[str, list[float]] = field(default_factory=dict)
    tool_rewards: list[float] = field(default_factory=list)
    interaction: str | None = None
    interaction_turns: int = 0
    interaction_tokens: int = 0
    interaction_error: str | None = None
    interaction_seconds: float = 0.0
    turn_scores: list[float] = field(default_factory=list)

    def add_call(self, name: str, result: CallResult) -> None:
        row = self.tools.setdefault(name, [0.0] * 6)
        for index, value in enumerate((1, result.error, result.timeout, result.truncated, result.seconds,
                                       result.reward)):
            row[index] += float(value)
        self.tool_rewards.append(result.reward)


@dataclass
class _Sample:
    prompt_index: int
    sample_index: int
    prompt: list[int]
    tools_kwargs: Mapping[str, Any]
    conversation: Conversation | None = None  # the interaction's side, with an interaction config
    images: Mapping[str, Any] | None = None  # the prompt's pixel values and grids (a vision-language model's)
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
    """The multi-turn loop of the module docstring over one engine, with ``runner``'s tools and, when given,
    ``interactions`` by name (``meshrl.rollout.interactions``)."""

    def __init__(self, engine: RolloutEngine, tokenizer: Any, runner: ToolRunner, settings: MultiTurnSettings,
                 response_length: int, async_engine: AsyncEngine | None = None,
                 interactions: Mapping[str, Interaction] | None = None) -> None:
        self.engine = engine
        self.async_engine = async_engine  # rollout.mode=async: one coroutine per conversation
        self.tokenizer = tokenizer
        self.runner = runner
        self.settings = settings
        self.response_length = response_length
        self.parser = tool_parser(settings.format, tool_schemas(list(runner.tools.values())))
        self.message_tokens = MessageTokens(tokenizer, engine.eos_token_ids)
        self.interactions = dict(interactions or {})
        self.interaction_runner = InteractionRunner() if self.interactions else None

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig,
                 extra_infos: Sequence[Mapping[str, Any] | None] | None = None,
                 messages: Sequence[Sequence[Mapping[str, Any]]] | None = None,
                 images: Sequence[Mapping[str, Any] | None] | None = None
                 ) -> tuple[list[Completion], list[AgentStats]]:
        """``sampling.n`` conversations per prompt, prompt-major. ``extra_infos[i]`` is prompt i's ``extra_info``
        (its ``tools_kwargs`` and ``interaction_kwargs``), ``messages[i]`` its chat messages (verl's
        ``raw_prompt``, which interactions read), ``images[i]`` its images' ``pixel_values`` / ``image_grid_thw``
        (a vision-language model's; None for a prompt without): every turn of its conversations is generated with
        them, the prompt's image pads staying where they are at the start of each turn's input. Returns their
        completions and statistics.

        Raises:
            ValueError: with interactions, ``messages`` is missing or a row's ``interaction_kwargs`` name none;
                images on the async engine (it takes token ids only).
        """
        infos = list(extra_infos) if extra_infos is not None else [{}] * len(prompts)
        if self.interactions and messages is None:
            raise ValueError("interactions read the conversation as chat messages: pass the prompts' raw_prompt "
                             "(data.return_raw_chat=True)")
        if images is not None and len(images) != len(prompts):
            raise ValueError(f"{len(images)} image entries for {len(prompts)} prompts")
        if images is not None and any(images) and self.async_engine is not None:
            raise ValueError("rollout.mode=async carries no images (its requests are token ids): a vision-language "
                             "model's conversations run with rollout.mode=sync")
        samples = [_Sample(i, j, list(map(int, prompt)), (infos[i] or {}).get("tools_kwargs") or {},
                           self._conversation(infos[i], messages[i]) if self.interactions else None,
                           images[i] if images is not None else None)
                   for i, prompt in enumerate(prompts) for j in range(sampling.n)]
        for sample in samples:
            if sample.conversation is not None:
                sample.stats.interaction = sample.conversation.interaction.name
        turn = replace(sampling, n=1, max_response_length=min(sampling.max_response_length, self.response_length))
        try:
            if self.async_engine is None:
                self._converse_in_batches(samples, turn)
            else:
                self._converse_async(samples, turn, prompts)
        finally:
            if self.interaction_runner is not None:
                self.interaction_runner.finalize([s.conversation for s in samples if s.conversation is not None])
        completions = [Completion(s.prompt_index, s.sample_index, s.tokens, s.logprobs, s.finish, loss_mask=s.mask)
                       for s in samples]
        return completions, [s.stats for s in samples]

    def _conversation(self, extra_info: Mapping[str, Any] | None, messages: Sequence[Mapping[str, Any]]
                      ) -> Conversation:
        kwargs = interaction_kwargs_of(extra_info)
        return Conversation(interaction_for(self.interactions, kwargs), dict(kwargs),
                            [dict(message) for message in messages])

    def _cap(self, sample: _Sample, turn: SamplingConfig) -> int:
        return min(self.response_length - len(sample.tokens), turn.max_response_length)

    def _converse_in_batches(self, samples: list[_Sample], turn: SamplingConfig) -> None:
        active = samples
        with_images = any(s.images for s in samples)
        while active:
            outputs = self.engine.generate([s.prompt + s.tokens for s in active], turn,
                                           max_tokens=[self._cap(s, turn) for s in active],
                                           images=[s.images for s in active] if with_images else None)
            calling, asking = [], []
            for sample, out in zip(active, outputs):
                if calls := self._after_turn(sample, out):
                    calling.append((sample, calls))
                elif sample.finish is None:
                    asking.append(sample)
            # The interactions answer on their own thread while the tools run.
            started = time.monotonic()
            replies = [self.interaction_runner.reply(s.conversation) for s in asking] if asking else []
            results = iter(self.runner.run(self._invocations(calling)))
            for sample, calls in calling:
                self._append_tool_outputs(sample, calls, [next(results) for _ in calls])
            for sample, reply in zip(asking, replies):
                self._append_user_turn(sample, self.interaction_runner.wait(sample.conversation, reply, started))
            active = [s for s in samples if s.finish is None]

    def _converse_async(self, samples: list[_Sample], turn: SamplingConfig, prompts: Sequence[Sequence[int]]) -> None:
        """One coroutine per conversation on the async engine; its tools run on the runner's threads (its
        interaction on the interactions' loop) while the other conversations generate. Turn k of sample j of
        prompt i is seeded with ``turn_seed(seeds[i] + j, k)`` (``meshrl.rollout.async_engine``)."""
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
                elif sample.finish is None:
                    self._append_user_turn(sample, await self.interaction_runner.await_reply(sample.conversation))

        async def conversations() -> None:
            await asyncio.gather(*(converse(s) for s in samples))

        engine.run(conversations)

    def _after_turn(self, sample: _Sample, out: Completion) -> list:
        """Append a generated turn; the calls to run now, or [] with ``sample.finish`` set, or [] for the
        interaction to answer."""
        sample.append(out.token_ids, out.logprobs, sampled=True)
        stats = sample.stats
        stats.assistant_turns += 1
        if out.finish_reason == "length" or len(sample.tokens) >= self.response_length:
            sample.finish = "length"
            return []
        # verl's hermes parser decodes with special tokens kept (<tool_call> may be one).
        parsed = self.parser.parse(self.tokenizer.decode(out.token_ids, skip_special_tokens=False))
        stats.malformed_calls += parsed.malformed
        if sample.conversation is not None:  # what the interaction reads: verl decodes without special tokens
            sample.conversation.messages.append(
                {"role": "assistant", "content": self.tokenizer.decode(out.token_ids, skip_special_tokens=True)})
        settings = self.settings
        if not parsed.calls and sample.conversation is None:
            sample.finish = "stop"
        elif (settings.max_assistant_turns and stats.assistant_turns >= settings.max_assistant_turns) or \
                (settings.max_user_turns and stats.user_turns >= settings.max_user_turns):
            sample.finish = "max_turns"
        return [] if sample.finish else parsed.calls[:settings.max_parallel_calls]

    @staticmethod
    def _invocations(calling: list) -> list[Invocation]:
        return [Invocation(call.name, call.arguments, sample.tools_kwargs)
                for sample, calls in calling for call in calls]

    def _append_tool_outputs(self, sample: _Sample, calls: list, results: Sequence[CallResult]) -> None:
        """Count the calls and append their tool messages' tokens (loss mask 0), or end the sample at "length"."""
        for call, result in zip(calls, results):
            sample.stats.add_call(call.name if call.name in self.runner.tools else "unknown", result)
        messages = [{"role": "tool", "content": result.text} for result in results]
        if sample.conversation is not None:
            sample.conversation.messages += messages
        sample.stats.tool_tokens += self._append_delta(sample, messages)

    def _append_user_turn(self, sample: _Sample, reply: InteractionReply) -> None:
        """Record the interaction's answer and append its user message's tokens (loss mask 0); end the sample
        on the interaction's failure ("interaction_error"), at its request ("stop") or at "length"."""
        stats = sample.stats
        stats.interaction_seconds += reply.seconds
        if reply.error is not None:
            stats.interaction_error = "timeout" if reply.timeout else "error"
            sample.finish = "interaction_error"
            return
        stats.interaction_turns += 1
        if reply.score is not None:
            stats.turn_scores.append(reply.score)
        message = {"role": "user", "content": reply.text}
        sample.conversation.messages.append(message)
        stats.interaction_tokens += self._append_delta(sample, [message])
        if reply.terminate and sample.finish is None:
            sample.finish = "stop"

    def _append_delta(self, sample: _Sample, messages: list[dict[str, str]]) -> int:
        """Append ``messages``' tokens (loss mask 0) as one user turn and return their count, or end the sample
        at "length" when they do not fit in the response (0)."""
        delta = self.message_tokens(messages)
        if len(sample.tokens) + len(delta) >= self.response_length:
            sample.finish = "length"
            return 0
        sample.append(delta, [0.0] * len(delta), sampled=False)
        sample.stats.user_turns += 1
        return len(delta)


AGENT_STATS = "agent_stats"  # the RL batch's per-row AgentStats field (a multi-turn rollout's)


def agent_loop_for(rollout: Any, engine: RolloutEngine, tokenizer: Any, response_length: int,
                   async_engine: AsyncEngine | None = None) -> AgentLoop | None:
    """The loop a verl ``rollout`` section asks for on ``engine`` (conversations as coroutines on
    ``async_engine`` when given: ``rollout.mode=async``; the interactions of ``interaction_config_path``):
    None unless ``multi_turn.enable``."""
    multi_turn = section_getter(rollout)("multi_turn") or {}
    get = section_getter(multi_turn)
    if not get("enable", False):
        return None
    interactions = load_interactions(get("interaction_config_path")) if get("interaction_config_path") else None
    return AgentLoop(engine, tokenizer, tool_runner(multi_turn), MultiTurnSettings.from_rollout(multi_turn),
                     response_length, async_engine, interactions)


def agent_reward_info(stats: AgentStats) -> dict[str, Any]:
    """What verl's agent loop adds to a multi-turn sample's ``extra_info`` for the reward function: its
    interaction's ``turn_scores`` and its tool calls' ``tool_rewards`` (lists of floats in turn order, empty
    without any) and ``num_turns`` (assistant + user turns + 1, verl's count)."""
    return {"turn_scores": list(stats.turn_scores), "tool_rewards": list(stats.tool_rewards),
            "num_turns": stats.assistant_turns + stats.user_turns + 1}


def prompt_tool_schemas(multi_turn: Any) -> list[dict[str, Any]] | None:
    """The OpenAI schemas of ``rollout.multi_turn``'s tools (``tool_config_path``'s, then ``function_tool_path``'s),
    which the prompts' chat template renders (``meshrl.data.dataset.load_datasets``); None when multi-turn is off
    or has no tools."""
    get = section_getter(multi_turn)
    if not get("enable", False) or not (get("tool_config_path") or get("function_tool_path")):
        return None
    return tool_schemas(load_all_tools(get("tool_config_path"), get("function_tool_path")))


def tool_runner(multi_turn: Any) -> ToolRunner:
    """The runner of ``rollout.multi_turn``'s tools (``tool_config_path``'s and ``function_tool_path``'s; none
    without either), truncating their outputs by ``max_tool_response_length`` / ``tool_response_truncate_side``."""
    get = section_getter(multi_turn)
    tools = load_all_tools(get("tool_config_path"), get("function_tool_path"))
    return ToolRunner(tools, max_response_chars=int(get("max_tool_response_length", 256)),
                      truncate_side=str(get("tool_response_truncate_side", "middle")))


_TOOL_FIELDS = ("calls", "errors", "timeouts", "truncated")


def agent_metrics(stats: Sequence[AgentStats], finish_reasons: Sequence[str]) -> dict[str, float]:
    """A rollout's ``agent/*`` metrics (turns per sample, as verl's ``num_turns`` counts them: assistant +
    tool turns + 1 for the prompt; finish reasons; how many samples reached each assistant turn) and its
    ``tool/<name>/*`` metrics (calls, errors, timeouts, truncated outputs, mean seconds and mean reward per call;
    calls of names the tool config lacks count under ``unknown``), and with interactions ``interaction_metrics``."""
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
            totals[name] = totals.get(name, np.zeros(6)) + np.asarray(row)
    for name, total in sorted(totals.items()):
        out.update({f"tool/{name}/{key}": float(value) for key, value in zip(_TOOL_FIELDS, total)})
        out[f"tool/{name}/mean_seconds"] = float(total[4] / max(total[0], 1.0))
        out[f"tool/{name}/mean_reward"] = float(total[5] / max(total[0], 1.0))
    return out | interaction_metrics(stats)


def interaction_metrics(stats: Sequence[AgentStats]) -> dict[str, float]:
    """Per interaction (``interaction/<name>/*``), over the samples it plays the user of: ``samples``, user
    turns per sample (``turns/mean``), samples ended by its failure (``errors``, of which ``timeouts``),
    seconds per answer (``mean_seconds``), the mean of all its turn scores (``score/mean``) and of its k-th
    turn's scores (``turn_<k>/score``, over the samples that reached it); and ``agent/interaction_tokens/mean``."""
    by_name: dict[str, list[AgentStats]] = {}
    for s in stats:
        if s.interaction is not None:
            by_name.setdefault(s.interaction, []).append(s)
    if not by_name:
        return {}
    out = {"agent/interaction_tokens/mean": float(np.mean([s.interaction_tokens for s in stats]))}
    for name, group in sorted(by_name.items()):
        key = f"interaction/{name}"
        answers = sum(s.interaction_turns + (s.interaction_error is not None) for s in group)
        scores = [score for s in group for score in s.turn_scores]
        out.update({f"{key}/samples": float(len(group)),
                    f"{key}/turns/mean": float(np.mean([s.interaction_turns for s in group])),
                    f"{key}/errors": float(sum(s.interaction_error is not None for s in group)),
                    f"{key}/timeouts": float(sum(s.interaction_error == "timeout" for s in group)),
                    f"{key}/mean_seconds": float(sum(s.interaction_seconds for s in group) / max(answers, 1))})
        if scores:
            out[f"{key}/score/mean"] = float(np.mean(scores))
        for k in range(1, max(len(s.turn_scores) for s in group) + 1):
            reached = [s.turn_scores[k - 1] for s in group if len(s.turn_scores) >= k]
            out[f"{key}/turn_{k}/score"] = float(np.mean(reached))
    return out
