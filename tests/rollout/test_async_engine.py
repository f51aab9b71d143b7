"""``rollout.mode=async`` on the real in-process vLLM engine (fp32, CPU): the same samples as the batched
``generate`` with the same seed, the weights of an in-memory sync, nothing left in the engine by a failed
rollout. The loop's logic on a scripted engine: tests/rollout/test_async_loop.py; a multi-turn GRPO step
through it: tests/rollout/test_agent_e2e.py."""

import asyncio

import pytest
from test_vllm_engine import (GREEDY, PROMPTS, SAMPLED, engine, fresh_copies, hf_greedy, model_dir,  # noqa: F401
                              perturb, policy)

from meshrl.rollout.async_engine import AsyncEngine

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(240)]

CAPS = [16, 5, 16, 9]  # per-prompt caps, as a multi-turn turn's remaining budget


@pytest.mark.parametrize("sampling", [SAMPLED, GREEDY], ids=["sampled", "greedy"])
def test_async_and_sync_give_the_same_samples(engine, sampling):
    state = engine.state_dict()
    expected = engine.generate(PROMPTS, sampling, max_tokens=CAPS)
    after_sync = engine.state_dict()
    engine.load_state_dict(state)
    got = AsyncEngine(engine).generate(PROMPTS, sampling, max_tokens=CAPS)
    assert engine.state_dict() == after_sync  # one engine call each: the next rollout's seeds agree too
    assert [(c.prompt_index, c.sample_index) for c in got] == [(c.prompt_index, c.sample_index) for c in expected]
    for want, have in zip(expected, got):
        assert (have.token_ids, have.logprobs, have.finish_reason) == (want.token_ids, want.logprobs,
                                                                       want.finish_reason)
    assert [len(c.token_ids) for c in got] == [CAPS[c.prompt_index] for c in got]  # ignore_eos: each at its cap
    if sampling is SAMPLED:
        assert got[0].token_ids != got[1].token_ids  # two samples of one prompt: different seeds


def test_the_async_engine_serves_the_weights_of_an_in_memory_sync(engine, policy):
    perturb(policy, seed=11, scale=0.05)
    engine.load_weights(fresh_copies(policy))
    policy.eval()
    got = AsyncEngine(engine).generate(PROMPTS, GREEDY)
    assert [c.token_ids for c in got] == [hf_greedy(policy, p, GREEDY.max_response_length) for p in PROMPTS]


def test_a_failed_rollout_leaves_no_request_in_the_engine(engine):
    driver = AsyncEngine(engine)

    async def failing() -> None:
        running = asyncio.ensure_future(driver.sample(PROMPTS[2], GREEDY, 0, 16))
        await asyncio.sleep(0)  # the request is in the engine now
        assert not running.done()
        raise RuntimeError("a tool broke")

    with pytest.raises(RuntimeError, match="a tool broke"):
        driver.run(failing)
    assert not engine.llm.llm_engine.has_unfinished_requests()
    # Both paths serve on afterwards, alike.
    assert [c.token_ids for c in driver.generate(PROMPTS, GREEDY)] == \
        [c.token_ids for c in engine.generate(PROMPTS, GREEDY)]


def test_an_engine_error_reaches_every_sample_and_leaves_no_request(engine, monkeypatch):
    driver = AsyncEngine(engine)

    def broken_step():
        raise RuntimeError("the engine broke")

    monkeypatch.setattr(engine.llm.llm_engine, "step", broken_step)
    with pytest.raises(RuntimeError, match="the engine broke"):  # raised, not a rollout waiting forever
        driver.generate(PROMPTS, SAMPLED)
    monkeypatch.undo()
    assert not engine.llm.llm_engine.has_unfinished_requests()
    assert [c.token_ids for c in driver.generate(PROMPTS, GREEDY)] == \
        [c.token_ids for c in engine.generate(PROMPTS, GREEDY)]
