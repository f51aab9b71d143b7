"""Partial rollout (``meshrl.rollout.partial_rollout``) on the real in-process vLLM engine (fp32, CPU): a weight sync
in the middle of an async rollout aborts the in-flight samples and resumes them on the new weights, token-exact; and
across training steps (``meshrl.rollout.rollout_stream``, verl V1 ``colocate_async``): a run stops once enough groups
finished, aborting the others, which the next run resumes on the weights synced meanwhile.

The engine's side is recorded at vLLM's ``LLMEngine`` API (every ``add_request``, every step's outputs, every
``abort_request``), independently of the driver's bookkeeping; the log-probs are recomputed with transformers on the
weights of each version. The batch field: ``meshrl.workers.sequences.responses_batch``.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
from test_vllm_engine import PROMPTS, engine, fresh_copies, hf_logprobs, model_dir, perturb, policy  # noqa: F401

from meshrl.protocol import Batch
from meshrl.rollout import Completion, EngineConfig, SamplingConfig, WeightSyncError
from meshrl.rollout.async_engine import AsyncEngine
from meshrl.rollout.base import request_seed
from meshrl.rollout.partial_rollout import PartialRollout, resume_seed
from meshrl.rollout.rollout_stream import RolloutStream
from meshrl.rollout.vllm_engine import VLLMEngine
from meshrl.workers.sequences import POLICY_VERSION, responses_batch

# Processed log-probs under temperature, top-k and top-p: what the HF recomputation must reproduce per version.
SAMPLING = SamplingConfig(n=2, temperature=0.8, top_k=50, top_p=0.95, max_response_length=20, ignore_eos=True,
                          seed=7)
CAPS = [20, 3, 20, 12]  # prompt 1's samples finish before the interrupt, the others are cut mid-sample
INTERRUPT_AFTER = 6  # engine steps: the prefill step's token, then five decode steps


@dataclass
class EngineLog:
    """What vLLM's ``LLMEngine`` was asked and answered, per (external) request id."""

    phase: int = 0  # the test's: 0 before the sync, 1 after
    steps: int = 0
    added: dict = field(default_factory=dict)  # id -> (prompt ids, max_tokens, seed, phase)
    tokens: dict = field(default_factory=lambda: defaultdict(list))
    logprobs: dict = field(default_factory=lambda: defaultdict(list))
    finished: set = field(default_factory=set)
    aborted: list = field(default_factory=list)


@pytest.fixture
def engine_log(engine, monkeypatch):
    core, log = engine.llm.llm_engine, EngineLog()
    add_request, step, abort_request = core.add_request, core.step, core.abort_request

    def recording_add(request_id, request, params, *args, **kwargs):
        log.added[request_id] = (list(request["prompt_token_ids"]), params.max_tokens, params.seed, log.phase)
        return add_request(request_id, request, params, *args, **kwargs)

    def recording_step():
        outputs = step()
        log.steps += 1
        for output in outputs:
            (sample,) = output.outputs
            log.tokens[output.request_id] += sample.token_ids
            log.logprobs[output.request_id] += [lp[t].logprob for lp, t in zip(sample.logprobs, sample.token_ids)]
            if output.finished:
                log.finished.add(output.request_id)
        return outputs

    def recording_abort(request_ids, *args, **kwargs):
        log.aborted += list(request_ids)
        return abort_request(request_ids, *args, **kwargs)

    monkeypatch.setattr(core, "add_request", recording_add)
    monkeypatch.setattr(core, "step", recording_step)
    monkeypatch.setattr(core, "abort_request", recording_abort)
    return log


def interrupted_rollout(partial: PartialRollout, log: EngineLog, sync) -> list[Completion]:
    """Start the rollout, run ``sync()`` after ``INTERRUPT_AFTER`` engine steps, finish it."""
    async def main() -> list[Completion]:
        rollout = asyncio.ensure_future(partial.agenerate(PROMPTS, SAMPLING, max_tokens=CAPS))
        while log.steps < INTERRUPT_AFTER:  # the stepper yields after every step
            await asyncio.sleep(0)
        assert not rollout.done()
        log.phase = 1
        sync()
        return await rollout

    return partial.run(main)


def segments(completion: Completion) -> list[tuple[int, int, int]]:
    """(start, end, version) of each run of one version in ``completion``'s tokens."""
    out, versions = [], completion.policy_versions
    for k, version in enumerate(versions):
        if k == 0 or version != versions[k - 1]:
            out.append([k, k + 1, version])
        else:
            out[-1][1] = k + 1
    return [tuple(s) for s in out]


@pytest.mark.vllm
@pytest.mark.timeout(240)
def test_without_a_sync_the_samples_are_the_async_engines(engine):
    state = engine.state_dict()
    expected = AsyncEngine(engine).generate(PROMPTS, SAMPLING, max_tokens=CAPS)
    engine.load_state_dict(state)
    got = PartialRollout(engine, version=3).generate(PROMPTS, SAMPLING, max_tokens=CAPS)
    assert [(c.prompt_index, c.sample_index) for c in got] == [(c.prompt_index, c.sample_index) for c in expected]
    for want, have in zip(expected, got):
        assert (have.token_ids, have.logprobs, have.finish_reason) == (want.token_ids, want.logprobs,
                                                                       want.finish_reason)
        assert have.policy_versions == [3] * len(have.token_ids)


@pytest.mark.vllm
@pytest.mark.timeout(240)
def test_a_sync_mid_rollout_resumes_every_sample_token_exact_on_the_new_weights(engine, engine_log, policy,
                                                                                model_dir):
    from transformers import AutoModelForCausalLM

    log = engine_log
    calls = engine.state_dict()["calls"]
    perturb(policy, seed=3, scale=0.05)
    partial = PartialRollout(engine, version=0)
    got = interrupted_rollout(partial, log, lambda: partial.sync_weights(fresh_copies(policy), version=1))
    assert partial.version == 1 and not engine.llm.llm_engine.has_unfinished_requests()

    # (a) Per sample, the chain of requests vLLM saw: each resumed request's prompt is the previous one's plus
    # exactly the tokens vLLM delivered for it, its cap what is left; the sample's tokens are their concatenation.
    by_prompt = {(tuple(prompt), seed): rid for rid, (prompt, _, seed, _) in log.added.items()}
    chained, mid_sample, before_sync = set(), 0, 0
    versions = {0: AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval(), 1: policy.eval()}
    for c in got:
        prompt, cap = PROMPTS[c.prompt_index], CAPS[c.prompt_index]
        seed = request_seed(SAMPLING.seed + engine.dp_rank, calls, c.prompt_index) + c.sample_index
        rid, tokens, logprobs, expected_versions = by_prompt[tuple(prompt), seed], [], [], []
        while True:
            chained.add(rid)
            context, max_tokens, _, phase = log.added[rid]
            assert context == prompt + tokens and max_tokens == cap - len(tokens)
            tokens += log.tokens[rid]
            logprobs += log.logprobs[rid]
            expected_versions += [phase] * len(log.tokens[rid])  # (b) the weights it was added under
            if rid in log.finished:
                assert rid not in log.aborted
                break
            assert rid in log.aborted
            rid = by_prompt[tuple(prompt + tokens), resume_seed(seed, len(tokens))]
        assert (c.token_ids, c.logprobs) == (tokens, logprobs)
        assert len(c.token_ids) == cap and c.finish_reason == "length"
        assert c.policy_versions == expected_versions
        runs = segments(c)
        mid_sample += [v for _, _, v in runs] == [0, 1]
        before_sync += [v for _, _, v in runs] == [0]
        # (c) Each segment's log-probs are its version's: transformers on those weights, given everything before.
        for start, end, version in runs:
            expected = hf_logprobs(versions[version], prompt + c.token_ids[:start], c.token_ids[start:end], SAMPLING)
            assert (torch.tensor(c.logprobs[start:end]) - expected).abs().max() <= 1e-4, (c.prompt_index, version)
            if version == 1:  # the check tells the versions apart
                other = hf_logprobs(versions[0], prompt + c.token_ids[:start], c.token_ids[start:end], SAMPLING)
                assert (torch.tensor(c.logprobs[start:end]) - other).abs().max() > 1e-2
    assert chained == set(log.added) and set(log.aborted) <= chained  # no request outside a sample's chain
    assert mid_sample == 6 and before_sync == 2  # cut mid-sample: prompts 0, 2, 3; finished before: prompt 1

    batch = responses_batch(Batch(non_tensors={"prompt_ids": np.array(PROMPTS, dtype=object)}), got, SAMPLING.n,
                            24, pad_id=0)
    for c in got:
        row = batch[POLICY_VERSION][c.prompt_index * SAMPLING.n + c.sample_index]
        assert row.tolist() == c.policy_versions + [-1] * (24 - len(c.token_ids))


@pytest.mark.vllm
@pytest.mark.timeout(240)
def test_a_refused_sync_resumes_the_samples_on_the_old_weights(engine, engine_log):
    partial = PartialRollout(engine, version=4)
    with pytest.raises(RuntimeError, match="sync runs inside PartialRollout.run"):  # no step boundary to sync at
        partial.sync_weights([], version=5)
    refused = []

    def bad_sync():
        with pytest.raises(WeightSyncError):
            partial.sync_weights([("model.embed_tokens.weight", torch.zeros(3, 3))], version=5)
        refused.append(True)

    got = interrupted_rollout(partial, engine_log, bad_sync)
    assert refused and partial.version == 4 and engine.weights_complete
    assert engine_log.aborted and len(engine_log.added) == len(got) + len(engine_log.aborted)  # resumed, once each
    for c in got:
        assert len(c.token_ids) == CAPS[c.prompt_index] and c.policy_versions == [4] * len(c.token_ids)


def test_partial_rollout_refuses_tensor_parallel_replicas():
    replica = VLLMEngine.__new__(VLLMEngine)  # no vLLM started: the layout check comes first
    replica.config = EngineConfig(tensor_model_parallel_size=2)
    with pytest.raises(ValueError, match="inference TP 1"):
        PartialRollout(replica)


def test_the_batch_carries_policy_versions_only_when_the_completions_do():
    prompts = Batch(non_tensors={"prompt_ids": np.array([[1, 2], [3]], dtype=object)})
    plain = [Completion(0, 0, [5, 6], [-0.1, -0.2], "length"), Completion(1, 0, [7], [-0.3], "stop")]
    assert POLICY_VERSION not in responses_batch(prompts, plain, 1, 4, pad_id=0)
    versioned = [Completion(0, 0, [5, 6], [-0.1, -0.2], "length", policy_versions=[2, 3]),
                 Completion(1, 0, [7], [-0.3], "stop")]
    batch = responses_batch(prompts, versioned, 1, 4, pad_id=0)
    assert batch[POLICY_VERSION].dtype == torch.long
    assert batch[POLICY_VERSION].tolist() == [[2, 3, -1, -1], [-1, -1, -1, -1]]
    with pytest.raises(ValueError, match="policy versions"):
        Completion(0, 0, [5, 6], [-0.1, -0.2], "length", policy_versions=[1])


# --- across steps: RolloutStream --------------------------------------------------------------------------------

SHORT = SamplingConfig(n=2, temperature=0.8, top_k=50, top_p=0.95, max_response_length=4, ignore_eos=True, seed=7)


@pytest.mark.vllm
@pytest.mark.timeout(240)
def test_a_stream_never_paused_draws_the_async_engines_samples(engine):
    state = engine.state_dict()
    expected = AsyncEngine(engine).generate(PROMPTS, SAMPLING)
    engine.load_state_dict(state)
    stream = RolloutStream(engine)
    stream.submit(["a", "b", "c", "d"], PROMPTS, SAMPLING)
    assert sorted(stream.run(until=4, version=3)) == ["a", "b", "c", "d"]
    got = [c for group in stream.take(["a", "b", "c", "d"]) for c in group]
    for want, have in zip(expected, got):
        assert (have.prompt_index, have.sample_index) == (want.prompt_index, want.sample_index)
        assert (have.token_ids, have.logprobs, have.finish_reason) == (want.token_ids, want.logprobs,
                                                                       want.finish_reason)
        assert have.policy_versions == [3] * len(have.token_ids)
    assert not engine.llm.llm_engine.has_unfinished_requests() and stream.unfinished() == []


@pytest.mark.vllm
@pytest.mark.timeout(240)
def test_a_stream_stops_at_enough_groups_and_resumes_the_rest_token_exact_on_new_weights(engine, engine_log, policy,
                                                                                         model_dir):
    """Group "short" (4 tokens) finishes first; the run stops there and aborts the long groups mid-sample; the
    weights change; the next run resumes them. Each long sample is the chain of its requests (the resumed one's
    prompt = the prompt + what vLLM delivered), its first segment version 0 and the rest version 1, each segment's
    log-probs those of its weights (transformers)."""
    from transformers import AutoModelForCausalLM

    log = engine_log
    stream = RolloutStream(engine)
    stream.submit(["long0", "long1"], PROMPTS[2:4], SAMPLING)  # 20 tokens each
    stream.submit(["short"], PROMPTS[:1], SHORT)
    assert stream.run(until=1, version=0) == ["short"]
    assert stream.unfinished() == ["long0", "long1"] and not engine.llm.llm_engine.has_unfinished_requests()
    assert len(log.aborted) == 4 and all(0 < len(v) < 20 for key in ("long0", "long1")
                                         for v in stream.versions_of(key))
    (short,) = stream.take(["short"])
    assert [len(c.token_ids) for c in short] == [4, 4] and all(c.policy_versions == [0] * 4 for c in short)

    perturb(policy, seed=5, scale=0.05)
    engine.load_weights(fresh_copies(policy))
    log.phase = 1
    assert stream.run(until=2, version=1) == ["long0", "long1"]
    versions = {0: AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval(), 1: policy.eval()}
    for group, prompt in zip(stream.take(["long0", "long1"]), PROMPTS[2:4]):
        for c in group:
            cut = c.policy_versions.count(0)
            assert 0 < cut < 20 and c.policy_versions == [0] * cut + [1] * (20 - cut)
            assert len(c.token_ids) == 20 and c.finish_reason == "length"
            first = [rid for rid, (context, _, _, phase) in log.added.items() if phase == 0 and context == prompt
                     and log.tokens[rid] == c.token_ids[:cut]]
            second = [rid for rid, (context, max_tokens, _, phase) in log.added.items()
                      if phase == 1 and context == prompt + c.token_ids[:cut] and max_tokens == 20 - cut]
            assert len(first) == 1 and first[0] in log.aborted and len(second) == 1
            assert log.tokens[second[0]] == c.token_ids[cut:] and second[0] in log.finished
            for start, end, version in segments(c):
                expected = hf_logprobs(versions[version], prompt + c.token_ids[:start], c.token_ids[start:end],
                                       SAMPLING)
                assert (torch.tensor(c.logprobs[start:end]) - expected).abs().max() <= 1e-4, version
    assert stream.unfinished() == []
