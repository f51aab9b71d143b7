"""``rollout.mode=async``: the colocated vLLM engine driven request by request from asyncio.

One coroutine per sample awaits ``AsyncEngine.sample`` (one engine request, one sampled response); the
requests enter vLLM's scheduler the moment they are made, and one stepping task runs the engine while any
is unfinished, handing each finished request's output to the coroutine awaiting it. Between two engine
steps the event loop runs every coroutine that is ready, so a multi-turn sample whose tool has answered
adds its next turn to the running batch at the next step (continuous batching: vLLM admits new requests
at every step) instead of waiting for the slowest sample of the turn (``meshrl.rollout.agent_loop``).

**Why not vLLM's ``AsyncLLM``.** In vLLM 0.32 (``vllm/v1/engine/async_llm.py``) ``AsyncLLM`` always talks
to its engine core through ``EngineCoreClient.make_async_mp_client``: the core, and with it the model and
the KV cache, runs in a child process, whatever ``VLLM_ENABLE_V1_MULTIPROCESSING`` says (only the
synchronous ``LLMEngine`` has the in-process ``InprocClient``). The colocated engine's core must run in
the trainer's process: it joins the trainer's ``torch.distributed`` world (``external_launcher``), gets
the weights of a sync by reference and holds the only copy of the model (``meshrl.rollout.vllm_engine``).
So this module does ``AsyncLLM``'s job over the same in-process ``LLMEngine`` that the engine's
``vllm.LLM`` wraps: ``add_request`` per request, ``step()`` in the stepping task, ``abort_request`` for
what a failed rollout leaves behind. Weight sync and sleep / wake-up are the engine's, unchanged: they
happen between rollouts, and a rollout's event loop has ended (every request finished or aborted)
before ``generate`` / ``run`` returns. ``meshrl.rollout.partial_rollout`` (a subclass) syncs inside a rollout
instead: it aborts the in-flight requests at a step boundary and resumes them on the new weights.

**Seeds.** ``generate`` takes the engine's call index and per-prompt seeds exactly as the batched
``RolloutEngine.generate`` does (``reserve_call``), and gives sample j of prompt i the seed vLLM gives it
in a batched call (``seeds[i] + j``), so single-turn ``async`` and ``sync`` rollouts draw the same tokens
(each vLLM request samples from its own seeded generator, whatever else is in the batch). A multi-turn
sample's later turns are seeded by ``turn_seed`` from that seed and the turn's index, so they do not
depend on which samples share the engine step either.

**Limits.** Every rank of an inference-TP replica runs its own scheduler and must see the same requests
in the same order: single-turn rollouts submit all of theirs before the first step (deterministic), but
the order in which multi-turn samples come back from their tools is not, which is one more reason
multi-turn stays at inference TP 1 (``meshrl.config.validate``). The transformers engine has no
request-level API: ``rollout.mode=async`` needs ``rollout.name=vllm``.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Any, Awaitable, Callable, Sequence, TypeVar

from meshrl.rollout.base import Completion, RolloutEngine, SamplingConfig, request_seed, section_getter
from meshrl.rollout.vllm_engine import VLLMEngine, completion

T = TypeVar("T")


def turn_seed(sample_seed: int, turn: int) -> int:
    """The seed of a sample's assistant turn ``turn`` (0-based): its own seed for the first turn (the
    single-turn seed), a hash of both after."""
    return sample_seed if turn == 0 else request_seed(sample_seed, turn, 0)


class AsyncEngine:
    """Async requests on a colocated in-process ``VLLMEngine`` (module docstring)."""

    def __init__(self, engine: RolloutEngine) -> None:
        if not isinstance(engine, VLLMEngine):
            raise ValueError(f"actor_rollout_ref.rollout.mode=async drives vLLM's engine request by request; the "
                             f"{engine.name} engine generates in batches only. Set rollout.mode=sync with "
                             f"rollout.name={engine.name}, or rollout.name=vllm")
        if not engine.config.in_process:
            raise ValueError("rollout.mode=async needs the engine core in this process (rollout in_process=True): "
                             "it steps vLLM's in-process engine itself")
        self.engine = engine
        self._ids = itertools.count()
        self._waiting: dict[str, asyncio.Future] = {}
        self._work: asyncio.Event | None = None
        self._failure: BaseException | None = None

    def generate(self, prompt_token_ids: Sequence[Sequence[int]], sampling: SamplingConfig,
                 max_tokens: Sequence[int] | None = None) -> list[Completion]:
        """``RolloutEngine.generate``'s contract (layout, caps, seeds), one request per sample."""
        prompts, seeds, caps = self.engine.reserve_call(prompt_token_ids, sampling, max_tokens)
        return self.run(lambda: self._samples(prompts, sampling, seeds, caps)) if prompts else []

    async def agenerate(self, prompt_token_ids: Sequence[Sequence[int]], sampling: SamplingConfig,
                        max_tokens: Sequence[int] | None = None) -> list[Completion]:
        """``generate`` as a coroutine, inside ``run``: beside other coroutines of the same loop (a weight sync
        of ``meshrl.rollout.partial_rollout`` that interrupts it, tools). Seeded as ``generate`` (one call)."""
        prompts, seeds, caps = self.engine.reserve_call(prompt_token_ids, sampling, max_tokens)
        return await self._samples(prompts, sampling, seeds, caps)

    async def _samples(self, prompts: list[list[int]], sampling: SamplingConfig, seeds: list[int],
                       caps: list[int]) -> list[Completion]:
        return list(await asyncio.gather(*(
            self.sample(prompt, sampling, seed + j, cap, prompt_index=i, sample_index=j)
            for i, (prompt, seed, cap) in enumerate(zip(prompts, seeds, caps)) for j in range(sampling.n))))

    def run(self, main: Callable[[], Awaitable[T]]) -> T:
        """``await main()`` on a new event loop with the engine's stepping task beside it; requests still
        in the engine when ``main`` fails are aborted."""
        with self.engine.generation_scope():
            return asyncio.run(self._serve(main))

    async def _serve(self, main: Callable[[], Awaitable[T]]) -> T:
        self._work, self._failure = asyncio.Event(), None
        stepper = asyncio.create_task(self._step_loop())
        try:
            return await main()
        finally:
            stepper.cancel()
            # The stepper's own error (if any) already reached every waiting coroutine, and so main's caller.
            await asyncio.gather(stepper, return_exceptions=True)
            if self._waiting:
                self.engine.llm.llm_engine.abort_request(list(self._waiting))
                self._waiting.clear()
            self._work = None  # sample (and a partial rollout's sync) outside run: refused

    async def sample(self, prompt: Sequence[int], sampling: SamplingConfig, seed: int, max_tokens: int, *,
                     prompt_index: int = 0, sample_index: int = 0) -> Completion:
        """One response to ``prompt`` under ``sampling`` (its ``n`` aside) seeded with ``seed``, at most
        ``max_tokens`` long, as ``Completion(prompt_index, sample_index, ...)``. Only inside ``run``."""
        from vllm.sampling_params import RequestOutputKind

        self._check_serving()
        params = self.engine.sampling_params(sampling, seed, max_tokens, n=1)
        params.output_kind = RequestOutputKind.FINAL_ONLY
        future = asyncio.get_running_loop().create_future()
        self._add_request(prompt, params, future)
        return completion(prompt_index, sample_index, (await future).outputs[0])

    def _check_serving(self, what: str = "sample") -> None:
        if self._work is None:
            raise RuntimeError(f"{type(self).__name__}.{what} runs inside {type(self).__name__}.run")
        if self._failure is not None:
            raise self._failure

    def _add_request(self, prompt: Sequence[int], params: Any, future: asyncio.Future) -> str:
        """Submit one request of ``prompt`` under vLLM ``params``; ``future`` is what ``_deliver`` answers (and
        what the stepper's error reaches). Returns the request id."""
        request_id = f"meshrl-async-{next(self._ids)}"
        add_engine_request(self.engine, request_id, prompt, params)
        self._waiting[request_id] = future
        assert self._work is not None
        self._work.set()
        return request_id

    def _deliver(self, output: Any) -> None:
        """One request's output of an engine step. ``FINAL_ONLY`` requests only report when finished: the
        awaiting coroutine gets the whole ``RequestOutput``."""
        if output.finished:
            self._waiting.pop(output.request_id).set_result(output)

    async def _step_loop(self) -> None:
        engine = self.engine.llm.llm_engine
        assert self._work is not None
        try:
            while True:
                if not self._waiting:
                    self._work.clear()
                    await self._work.wait()
                    continue
                for output in engine.step():
                    self._deliver(output)
                # Let the coroutines that can go on (outputs handed over, tools answered) add their requests.
                await asyncio.sleep(0)
        except Exception as error:  # every waiting coroutine gets the engine's error, and later requests too
            self._failure = error
            for future in self._waiting.values():
                future.set_exception(error)
            raise


def add_engine_request(engine: RolloutEngine, request_id: str, prompt: Sequence[int], params: Any) -> None:
    """Put one request of ``prompt`` under vLLM ``params`` into the in-process ``LLMEngine`` of ``engine``; the
    next ``step()`` schedules it."""
    from vllm.inputs import TokensPrompt

    core = engine.llm.llm_engine
    (request,) = core.renderer.render_cmpl([TokensPrompt(prompt_token_ids=list(map(int, prompt)))])
    core.add_request(request_id, request, params, lora_request=engine.lora_request)


def async_engine_for(rollout: Any, engine: RolloutEngine) -> AsyncEngine | None:
    """The async driver ``rollout.mode`` asks for on ``engine``: None for ``sync``."""
    return AsyncEngine(engine) if section_getter(rollout)("mode", "sync") == "async" else None
