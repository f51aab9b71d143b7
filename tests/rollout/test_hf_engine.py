"""The transformers fallback engine against independent references (tiny model, CPU, fp32)."""

from __future__ import annotations

import warnings

import pytest
import torch

from meshrl.rollout import EngineConfig, EngineStateError, SamplingConfig, create_engine
from meshrl.rollout.hf_engine import _warp

PROMPTS = [[1, 9690, 198, 2683], [5, 6, 7], list(range(100, 131))]


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    engine = create_engine(tiny_llama_dir, EngineConfig(name="hf", hf_batch_size=4, max_model_len=256))
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def raw_engine(tiny_llama_dir):
    engine = create_engine(tiny_llama_dir, EngineConfig(name="hf", hf_batch_size=4, max_model_len=256,
                                                        logprobs_mode="raw_logprobs"))
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


@torch.no_grad()
def greedy_by_full_recompute(model, prompt: list[int], steps: int) -> list[int]:
    """Greedy decoding without KV cache or padding: one full forward per token."""
    ids = list(prompt)
    for _ in range(steps):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


@torch.no_grad()
def recomputed_logprobs(model, prompt: list[int], response: list[int], temperature: float = 1.0,
                        top_k: int = -1) -> torch.Tensor:
    """log softmax(logits / temperature) of ``response``, normalised over the ``top_k`` tokens (-1: all)."""
    scaled = model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1:-1].float() / temperature
    kept = scaled if top_k == -1 else scaled.topk(top_k, dim=-1).values
    return scaled.gather(-1, torch.tensor(response)[:, None])[:, 0] - kept.logsumexp(-1)


def test_greedy_matches_unbatched_full_recompute(engine, raw_engine, reference):
    greedy = SamplingConfig(temperature=0, max_response_length=12, ignore_eos=True)
    for prompt, completion, raw in zip(PROMPTS, engine.generate(PROMPTS, greedy), raw_engine.generate(PROMPTS, greedy)):
        assert completion.token_ids == greedy_by_full_recompute(reference, prompt, 12)
        assert completion.finish_reason == "length"
        # Greedy log-probs are the temperature-1 ones in both modes (as vLLM's).
        assert torch.allclose(torch.tensor(completion.logprobs),
                              recomputed_logprobs(reference, prompt, completion.token_ids), atol=1e-4)
        assert raw.logprobs == completion.logprobs


@pytest.mark.parametrize("top_k", [-1, 40])
def test_sampled_logprobs_follow_the_logprobs_mode(engine, raw_engine, reference, top_k):
    """processed: log softmax(logits / 0.7), over the top-k when truncating; raw: log softmax(logits).
    The mode changes the reported numbers only: the same seed samples the same tokens."""
    sampling = SamplingConfig(n=3, temperature=0.7, top_k=top_k, max_response_length=10, ignore_eos=True, seed=4)
    for each in (engine, raw_engine):  # the same call index, so the same seeds
        each.load_state_dict({"calls": 0})
    processed, raw = engine.generate(PROMPTS, sampling), raw_engine.generate(PROMPTS, sampling)
    assert len(processed) == 9 and [c.token_ids for c in processed] == [c.token_ids for c in raw]
    for completion, raw_completion in zip(processed, raw):
        prompt, tokens = PROMPTS[completion.prompt_index], completion.token_ids
        expected = recomputed_logprobs(reference, prompt, tokens, temperature=0.7, top_k=top_k)
        assert torch.allclose(torch.tensor(completion.logprobs), expected, atol=1e-4)
        assert torch.allclose(torch.tensor(raw_completion.logprobs), recomputed_logprobs(reference, prompt, tokens),
                              atol=1e-4)


def test_seeds_replicas_and_calls(tiny_llama_dir, engine):
    sampling = SamplingConfig(n=2, temperature=1.0, max_response_length=8, seed=11)
    twin = create_engine(tiny_llama_dir, EngineConfig(name="hf", hf_batch_size=4), dp_rank=0)
    other = create_engine(tiny_llama_dir, EngineConfig(name="hf", hf_batch_size=4), dp_rank=1)
    engine.load_state_dict({"calls": 0})
    first = [c.token_ids for c in engine.generate(PROMPTS, sampling)]
    assert first == [c.token_ids for c in twin.generate(PROMPTS, sampling)]  # same replica, same call
    assert first != [c.token_ids for c in other.generate(PROMPTS, sampling)]  # another replica
    assert first != [c.token_ids for c in engine.generate(PROMPTS, sampling)]  # a later call
    engine.load_state_dict({"calls": 0})  # resume
    assert first == [c.token_ids for c in engine.generate(PROMPTS, sampling)]


def test_validation_seeds_follow_the_prompt_not_the_call_counter(engine):
    """A validation draws the same numbers for a prompt every time, and validating between two training calls
    leaves the second's seeds as they were (a run that validated at its last step resumes like one that did not)."""
    train = SamplingConfig(n=2, temperature=1.0, max_response_length=8, seed=11)
    val = SamplingConfig(n=2, temperature=1.0, max_response_length=8, seed=11, validation=True)
    engine.load_state_dict({"calls": 0})
    engine.generate(PROMPTS, train)
    second = [c.token_ids for c in engine.generate(PROMPTS, train)]
    engine.load_state_dict({"calls": 0})
    engine.generate(PROMPTS, train)
    seen = [c.token_ids for c in engine.generate(PROMPTS, val)]
    assert engine.state_dict() == {"calls": 1}
    assert [c.token_ids for c in engine.generate(PROMPTS, train)] == second
    engine.generate(PROMPTS, train)
    assert [c.token_ids for c in engine.generate(PROMPTS, val)] == seen  # a later validation: the same samples
    assert seen[0] != seen[1]  # a prompt's samples still differ from each other


def test_stops_at_a_stop_token_and_includes_it(engine):
    free = engine.generate(PROMPTS[:1], SamplingConfig(temperature=0, max_response_length=10, ignore_eos=True))[0]
    stop = free.token_ids[4]
    first = free.token_ids.index(stop)
    out = engine.generate(PROMPTS[:1], SamplingConfig(temperature=0, max_response_length=10, stop_token_ids=[stop]))[0]
    assert out.finish_reason == "stop" and out.token_ids == free.token_ids[:first + 1]
    assert out.logprobs == pytest.approx(free.logprobs[:first + 1], abs=1e-5)


def test_top_k_one_is_greedy(engine):
    greedy = engine.generate(PROMPTS, SamplingConfig(temperature=0, max_response_length=8, ignore_eos=True))
    top1 = engine.generate(PROMPTS, SamplingConfig(temperature=1.3, top_k=1, max_response_length=8, ignore_eos=True))
    assert [c.token_ids for c in greedy] == [c.token_ids for c in top1]


def test_warp_keeps_the_smallest_top_p_set():
    scores = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = torch.isfinite(_warp(scores, SamplingConfig(top_p=0.8)))
    assert kept.tolist() == [[True, True, False, False]]
    kept = torch.isfinite(_warp(scores, SamplingConfig(top_p=0.81)))
    assert kept.tolist() == [[True, True, True, False]]
    kept = torch.isfinite(_warp(scores, SamplingConfig(top_k=1)))
    assert kept.tolist() == [[True, False, False, False]]


def test_weight_sync_changes_generation(tiny_llama_dir, engine, reference):
    from transformers import AutoModelForCausalLM

    trained = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    with torch.no_grad(), torch.random.fork_rng():
        torch.manual_seed(0)
        for param in trained.parameters():
            param.add_(0.03 * torch.randn_like(param))
    stats = engine.load_weights(trained.named_parameters(), bucket_bytes=1 << 20)
    assert stats.tensors == len(list(trained.parameters())) and stats.buckets > 1
    try:
        out = engine.generate(PROMPTS, SamplingConfig(temperature=0, max_response_length=8, ignore_eos=True))
        assert [c.token_ids for c in out] == [greedy_by_full_recompute(trained, p, 8) for p in PROMPTS]
    finally:
        engine.load_weights(reference.named_parameters())


@pytest.mark.parametrize("load_format", ["dummy", "dummy_megatron"])
def test_dummy_load_format_serves_the_policy_after_the_first_sync(tiny_llama_dir, engine, reference, load_format):
    """verl's dummy formats: random weights, no generation until a sync; then the same tokens and log-probs
    as the engine that read the checkpoint (the policy at step 1 either way)."""
    config = EngineConfig(name="hf", hf_batch_size=4, max_model_len=256, load_format=load_format)
    dummy = create_engine(tiny_llama_dir, config)
    assert not torch.equal(dummy.model.get_input_embeddings().weight, reference.get_input_embeddings().weight)
    sampling = SamplingConfig(n=2, temperature=0.7, max_response_length=8, ignore_eos=True, seed=4)
    with pytest.raises(EngineStateError, match=f"load_format={load_format} started it from random weights"):
        dummy.generate(PROMPTS, sampling)
    dummy.load_weights(reference.named_parameters())
    engine.load_state_dict({"calls": 0})  # the same call index, so the same seeds
    for synced, loaded in zip(dummy.generate(PROMPTS, sampling), engine.generate(PROMPTS, sampling)):
        assert synced.token_ids == loaded.token_ids and synced.logprobs == pytest.approx(loaded.logprobs, abs=1e-6)
    dummy.shutdown()


def test_prefix_caching_warns_that_the_hf_engine_has_none(tiny_llama_dir):
    with pytest.warns(UserWarning, match="enable_prefix_caching=True has no effect with rollout.name=hf"):
        create_engine(tiny_llama_dir, EngineConfig(name="hf", max_model_len=64)).shutdown()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        create_engine(tiny_llama_dir, EngineConfig(name="hf", max_model_len=64, enable_prefix_caching=False)).shutdown()
