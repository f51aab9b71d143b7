"""Partial rollout: a weight sync in the middle of an async rollout, every in-flight sample resumed on the new weights.

verl's fully asynchronous trainer (``async_training.partial_rollout``, ``FullyAsyncLLMServerClient``) does not
wait for the long samples of a rollout before a parameter sync: it aborts them, keeps what they generated, and
continues each one after the sync as a new request whose prompt is the original prompt plus the tokens so far.
``PartialRollout`` does the same on the colocated in-process engine (an ``AsyncEngine`` subclass):

    partial = PartialRollout(engine, version=0)

    async def main():
        rollout = asyncio.ensure_future(partial.agenerate(prompts, sampling))
        await sync_wanted.wait()                       # the trainer's new policy is ready
        partial.sync_weights(weights, version=1)       # abort, load, resume: between two engine steps
        return await rollout                           # Completions with policy_versions

    completions = partial.run(main)

**Contract.** ``sync(load, version)`` (``sync_weights`` for a full weight stream) runs between two engine steps:
it aborts every unfinished request and keeps what each had generated (the tokens and log-probs of every step
already delivered: requests report a ``DELTA`` per step, so nothing of an aborted request is left in vLLM that
the sample does not hold), runs ``load`` (the engine's ordinary sync path, which resets the prefix cache), takes
``version`` as the policy version of the engine's weights, and submits each interrupted sample again: prompt =
its original prompt + its tokens so far, ``max_tokens`` = its cap − those tokens, the same ``SamplingConfig``.
The sample's ``Completion`` concatenates its segments: ``token_ids``, ``logprobs`` and ``policy_versions`` (the
version each token was sampled under, aligned with the tokens), ``finish_reason`` of its last segment. Hence
token-exact: the tokens trained are those generated, each once (the resumed request's prompt is exactly what was
delivered); and each log-prob is of the weights that sampled it (a request lives on one set of weights: every
sync aborts every request first). A sample finished before the sync keeps one version; a sample not yet started
(no token delivered) resumes with its original seed, as if submitted after the sync.

**Seeds.** Segment 0 is seeded as ``AsyncEngine.sample`` seeds it, so a rollout without a sync draws exactly the
tokens of ``AsyncEngine`` (and of the batched ``generate``). A resumed segment is seeded with ``resume_seed`` of the
sample's seed and its token count: a fresh, deterministic stream (vLLM keeps a request's generator with the
request, so the aborted one's state is gone), independent of which samples share the engine step.

**Failures.** A sync that ``load`` refuses before the engine changed (``WeightSyncError`` on the first bucket,
``engine.weights_complete`` still true) resumes the samples on the old weights and version, then raises. One that
left the weights incomplete fails every interrupted sample with ``EngineStateError`` (nothing could serve them)
and raises. Everything else is ``AsyncEngine``'s: an engine error reaches every sample, a failed ``main`` aborts
what it leaves in the engine.

**Limits.** Single rank: inference TP 1 only (refused otherwise). The ranks of a TP replica run one scheduler each
and would have to abort at the same engine step, then load collectively; nothing here agrees that step across
ranks. ``sync`` is called from a coroutine of ``run``'s event loop (not another thread): its body never awaits,
which is what makes it atomic with respect to the stepping task. Single-turn samples carry versions; the
multi-turn agent loop (``meshrl.rollout.agent_loop``) would resume its turns through ``sample`` too, but builds its
``Completion`` without the versions. The ``rollout_policy_version`` batch field is ``meshrl.workers.sequences``'.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence, TypeVar

import torch

from meshrl.rollout.async_engine import AsyncEngine
from meshrl.rollout.base import Completion, EngineStateError, RolloutEngine, SamplingConfig, request_seed
from meshrl.rollout.weight_sync import SyncStats

T = TypeVar("T")


def resume_seed(sample_seed: int, generated: int) -> int:
    """The seed of a sample's segment that starts after ``generated`` tokens: the sample's own for the first
    (or for one aborted before its first token), a hash of both after. Prompt index -1 keeps these apart from
    ``async_engine.turn_seed``'s hashes (index 0)."""
    return sample_seed if generated == 0 else request_seed(sample_seed, generated, -1)


@dataclass
class Segments:
    """One sample across the requests (segments) it took: what it asked for and what they delivered so far. Shared
    by ``PartialRollout`` and ``rollout_stream.RolloutStream``."""

    prompt: list[int]
    seed: int
    cap: int  # max_tokens over all segments
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    policy_versions: list[int] = field(default_factory=list)

    def next_request(self, engine: RolloutEngine, sampling: SamplingConfig) -> tuple[list[int], Any]:
        """The next segment's prompt (the prompt + the tokens so far) and vLLM sampling params: the rest of the cap,
        ``resume_seed``, a ``DELTA`` per engine step (every step's tokens and log-probs reach the sample as they are
        sampled, so an abort loses none)."""
        from vllm.sampling_params import RequestOutputKind

        generated = len(self.token_ids)
        params = engine.sampling_params(sampling, resume_seed(self.seed, generated), self.cap - generated, n=1)
        params.output_kind = RequestOutputKind.DELTA
        return self.prompt + self.token_ids, params

    def extend(self, output: Any, version: int) -> str | None:
        """Append a request's ``DELTA`` output, its tokens sampled under policy ``version``; the sample's finish
        reason once its request finished, else None."""
        (delta,) = output.outputs
        tokens = list(delta.token_ids)
        self.token_ids += tokens
        self.logprobs += [step[token].logprob for step, token in zip(delta.logprobs, tokens)]
        self.policy_versions += [version] * len(tokens)
        if not output.finished:
            return None
        return "stop" if delta.finish_reason == "stop" else "length"


@dataclass(kw_only=True)
class _Sample(Segments):
    sampling: SamplingConfig
    future: asyncio.Future  # the finish reason, once its last segment finished
    version: int = 0  # the policy version of its current segment's request


class PartialRollout(AsyncEngine):
    """``AsyncEngine`` whose in-flight samples survive a weight sync (module docstring)."""

    def __init__(self, engine: RolloutEngine, version: int = 0) -> None:
        super().__init__(engine)
        if engine.config.tensor_model_parallel_size != 1:
            raise ValueError(f"partial rollout runs at inference TP 1 (rollout.tensor_model_parallel_size=1), got "
                             f"{engine.config.tensor_model_parallel_size}: the ranks of a TP replica would have to "
                             "abort at the same engine step, which nothing agrees across them")
        self.version = int(version)  # the policy version of the engine's current weights
        self._live: dict[str, _Sample] = {}  # request id -> the sample it is a segment of

    async def sample(self, prompt: Sequence[int], sampling: SamplingConfig, seed: int, max_tokens: int, *,
                     prompt_index: int = 0, sample_index: int = 0) -> Completion:
        """``AsyncEngine.sample``, resumed across every sync it lives through; the ``Completion`` carries
        ``policy_versions``."""
        self._check_serving()
        state = _Sample(list(map(int, prompt)), seed, int(max_tokens), sampling=sampling,
                        future=asyncio.get_running_loop().create_future())
        self._submit(state)
        finish = await state.future
        return Completion(prompt_index, sample_index, state.token_ids, state.logprobs, finish,
                          policy_versions=state.policy_versions)

    def _submit(self, state: _Sample) -> None:
        """A request for the sample's next segment on the current weights."""
        prompt, params = state.next_request(self.engine, state.sampling)
        state.version = self.version
        self._live[self._add_request(prompt, params, state.future)] = state

    def _deliver(self, output: Any) -> None:
        state = self._live[output.request_id]
        finish = state.extend(output, state.version)
        if finish is not None:
            del self._live[output.request_id]
            self._waiting.pop(output.request_id).set_result(finish)

    def sync(self, load: Callable[[], T], version: int) -> T:
        """Between two engine steps: abort every unfinished request (keeping what it generated), ``load()`` new
        weights through the engine's own path, take ``version`` as theirs, resume every interrupted sample on
        them; returns what ``load`` returns. Called from a coroutine inside ``run`` (module docstring)."""
        self._check_serving("sync")
        interrupted = list(self._live.items())
        if interrupted:
            self.engine.llm.llm_engine.abort_request([request_id for request_id, _ in interrupted])
        for request_id, _ in interrupted:
            del self._live[request_id]
            self._waiting.pop(request_id)
        samples = [state for _, state in interrupted]
        try:
            result = load()
        except BaseException as error:
            if self.engine.weights_complete:  # refused before the engine changed: the old weights serve on
                self._resume(samples)
            else:
                failure = EngineStateError(f"a weight sync during a partial rollout failed and left the engine's "
                                           f"weights incomplete: {error!r}")
                failure.__cause__ = error
                for state in samples:
                    state.future.set_exception(failure)
            raise
        self.version = int(version)
        self._resume(samples)
        return result

    def sync_weights(self, weights: Iterable[tuple[str, torch.Tensor]], version: int, *,
                     bucket_bytes: int | None = None) -> SyncStats:
        """``sync`` of a full weight stream (``RolloutEngine.load_weights``)."""
        return self.sync(lambda: self.engine.load_weights(weights, bucket_bytes=bucket_bytes), version)

    def _resume(self, samples: list[_Sample]) -> None:
        for state in samples:
            if not state.future.done():  # done: its coroutine was cancelled, nobody awaits the rest
                self._submit(state)

    async def _serve(self, main: Callable[[], Any]) -> Any:
        try:
            return await super()._serve(main)
        finally:
            self._live.clear()  # the base aborted their requests


__all__ = ["PartialRollout", "Segments", "resume_seed"]
