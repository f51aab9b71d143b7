"""The in-process vLLM engine against Hugging Face transformers (fp32, CPU): generation, weight sync.

One engine serves the whole module (start-up costs seconds). Its model is a tiny tied-embedding Llama
with enough decoder layers beside its embedding, so a bucket-bounded sync is measurably smaller than the
model. Weight changes come from a real AdamW step on an HF copy, or from seeded perturbations.
"""

from __future__ import annotations

import dataclasses
import os
import random

import pytest
import torch

from meshrl.rollout import (
    EngineConfig,
    EngineStateError,
    LiveBytesMeter,
    SamplingConfig,
    WeightSyncError,
    create_engine,
)
from meshrl.rollout.hf_engine import _warp

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(240)]

PROMPTS = [[1, 9690, 198, 2683, 359], [5, 6, 7], list(range(300, 340)), [42] * 9]
GREEDY = SamplingConfig(temperature=0, max_response_length=16, ignore_eos=True)
SAMPLED = SamplingConfig(n=2, temperature=0.8, top_k=50, top_p=0.95, max_response_length=16, ignore_eos=True,
                         seed=5)
MIB = 1 << 20


@pytest.fixture(scope="module")
def model_dir():
    from meshrl.models.tiny import TinySpec, tiny_model_dir

    return tiny_model_dir(TinySpec(num_hidden_layers=12))


ENGINE = EngineConfig(kv_cache_memory_bytes=256 * MIB, max_model_len=256, max_num_seqs=32)


@pytest.fixture(scope="module")
def engine(model_dir):
    """The default engine (processed_logprobs)."""
    engine = create_engine(model_dir, ENGINE)
    yield engine
    engine.shutdown()


UNCOMPILED = """
import os, sys
from meshrl.rollout import EngineConfig, SamplingConfig, create_engine
engine = create_engine(sys.argv[1], EngineConfig(kv_cache_memory_bytes=64 << 20, max_model_len=64, max_num_seqs=4))
engine.generate([[1, 2, 3]], SamplingConfig(temperature=0.5, max_response_length=4, ignore_eos=True, seed=1))
from vllm.v1.sample.ops.logprobs import batched_count_greater_than
print(hasattr(batched_count_greater_than, "_torchdynamo_orig_callable"), os.environ.get("TORCHDYNAMO_DISABLE"))
"""


@pytest.mark.extended
def test_a_cpu_engine_leaves_vllms_sampler_uncompiled_and_the_switch_as_it_was(model_dir):
    """Without TORCHDYNAMO_DISABLE in the environment (a run started outside make), a CPU engine's start keeps vLLM
    from wrapping its sampler ops in torch.compile (an inductor C++ build on the first generate: 10-17 s measured),
    and leaves the variable unset for the trainer's own compiled regions."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TORCHDYNAMO_DISABLE"}
    done = subprocess.run([sys.executable, "-c", UNCOMPILED, str(model_dir)], env=env, capture_output=True,
                          text=True, timeout=200)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-2:] == ["False", "None"], done.stdout[-2000:]


@pytest.fixture(scope="module")
def raw_engine(model_dir, engine):
    """A second in-process engine beside ``engine`` (~2 s to start), reporting raw_logprobs."""
    raw = create_engine(model_dir, dataclasses.replace(ENGINE, logprobs_mode="raw_logprobs"))
    yield raw
    raw.shutdown()


@pytest.fixture(scope="module")
def configured_engine(model_dir, engine):
    """An engine beside ``engine`` with verl's rollout keys away from their defaults: random initial weights
    (load_format=dummy), no prefix cache, stats logging on, and one engine argument passed through."""
    configured = create_engine(model_dir, dataclasses.replace(
        ENGINE, load_format="dummy", enable_prefix_caching=False, disable_log_stats=False,
        vllm_kwargs={"max_logprobs": 7}))
    yield configured
    configured.shutdown()


@pytest.fixture(scope="module")
def hf_engine(model_dir):
    engine = create_engine(model_dir, EngineConfig(name="hf", max_model_len=256))
    yield engine
    engine.shutdown()


@pytest.fixture
def policy(model_dir, engine):
    """A trainable HF copy of the engine's model; the engine is reset to the checkpoint afterwards."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    yield model
    engine.load_weights(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).named_parameters())


def perturb(model, seed: int, scale: float = 0.02) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(scale * torch.randn(param.shape, generator=generator))


def adamw_step(model) -> None:
    """One real optimizer step on a next-token loss."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ids = torch.tensor([PROMPTS[0] + PROMPTS[1] + PROMPTS[3]])
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


@torch.no_grad()
def hf_greedy(model, prompt: list[int], steps: int) -> list[int]:
    ids = list(prompt)
    for _ in range(steps):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


@torch.no_grad()
def hf_logprobs(model, prompt: list[int], response: list[int], processed: SamplingConfig | None = None
                ) -> torch.Tensor:
    """log softmax of HF's logits for ``response``, or of those logits ``processed`` as the HF engine's
    sampler does it (temperature, top-k, top-p: dropped tokens -inf)."""
    logits = model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1:-1].float()
    if processed is not None:
        logits = _warp(logits, processed)
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None])[:, 0]


def assert_engine_serves(engine, model) -> None:
    """Greedy tokens equal HF greedy; sampled tokens' log-probs equal HF's recomputation (<= 1e-4)."""
    model.eval()
    greedy = engine.generate(PROMPTS, GREEDY)
    assert [c.token_ids for c in greedy] == [hf_greedy(model, p, GREEDY.max_response_length) for p in PROMPTS]
    for completion in greedy:  # the temperature-1 log-probs in both modes
        expected = hf_logprobs(model, PROMPTS[completion.prompt_index], completion.token_ids)
        assert (torch.tensor(completion.logprobs) - expected).abs().max() <= 1e-4
    processed = SAMPLED if engine.config.logprobs_mode == "processed_logprobs" else None
    for completion in engine.generate(PROMPTS, SAMPLED):
        expected = hf_logprobs(model, PROMPTS[completion.prompt_index], completion.token_ids, processed)
        assert (torch.tensor(completion.logprobs) - expected).abs().max() <= 1e-4


def fresh_copies(model):
    """The model's tensors as new buffers, the way iter_hf_weights yields them."""
    for name, param in model.named_parameters():
        yield name, param.detach().clone()


def test_engine_matches_hf_before_any_sync(engine, policy):
    assert_engine_serves(engine, policy)


@pytest.mark.parametrize("top_k", [-1, 5])
def test_logprobs_modes_at_a_temperature(engine, raw_engine, model_dir, top_k):
    """processed_logprobs: log softmax(logits / 0.7) of an HF forward on the same tokens, normalised over
    the top-k when truncating; raw_logprobs: log softmax(logits). The mode changes the reported numbers
    only: the same seed samples the same tokens."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    sampling = SamplingConfig(n=2, temperature=0.7, top_k=top_k, max_response_length=16, ignore_eos=True, seed=9)
    for each in (engine, raw_engine):  # the same call index, so the same seeds
        each.load_state_dict({"calls": 0})
    processed, raw = engine.generate(PROMPTS, sampling), raw_engine.generate(PROMPTS, sampling)
    assert [c.token_ids for c in processed] == [c.token_ids for c in raw]
    for completion, raw_completion in zip(processed, raw):
        prompt, tokens = PROMPTS[completion.prompt_index], completion.token_ids
        expected = hf_logprobs(model, prompt, tokens, processed=sampling)
        assert (torch.tensor(completion.logprobs) - expected).abs().max() <= 1e-4
        assert (torch.tensor(raw_completion.logprobs) - hf_logprobs(model, prompt, tokens)).abs().max() <= 1e-4


def test_sync_after_an_optimizer_step_matches_hf_and_the_fallback(engine, hf_engine, policy):
    before = [c.token_ids for c in engine.generate(PROMPTS, GREEDY)]
    adamw_step(policy)
    stats = engine.load_weights(policy.named_parameters(), bucket_bytes=MIB)
    assert stats.tensors == len(engine.expected_weights()) and stats.buckets > 3
    assert_engine_serves(engine, policy)
    after = [c.token_ids for c in engine.generate(PROMPTS, GREEDY)]
    assert after != before  # the step changed the policy, and the engine follows it
    hf_engine.load_weights(policy.named_parameters())
    assert [c.token_ids for c in hf_engine.generate(PROMPTS, GREEDY)] == after


def test_repeated_syncs_with_different_bucket_sizes(engine, policy):
    for round_, bucket in enumerate([64 << 10, 4 * MIB, 1 << 40]):
        perturb(policy, seed=round_)
        engine.load_weights(fresh_copies(policy), bucket_bytes=bucket)
        assert_engine_serves(engine, policy)


def sync_layer_peak(sizes: list[int], bucket: int) -> int:
    """Most bytes the sync layer itself holds: a full bucket plus the tensor that overflowed it."""
    peak, filled = 0, 0
    for size in sizes:
        if filled and filled + size > bucket:
            peak, filled = max(peak, filled + size), 0
        filled += size
    return max(peak, filled)


def test_sync_memory_is_bounded_by_the_bucket(engine, policy):
    sizes = [shape.numel() * 4 for shape in engine.expected_weights().values()]
    names = list(engine.expected_weights())
    layer = max(sum(s for n, s in zip(names, sizes) if n.startswith(f"model.layers.{i}.")) for i in range(12))
    small = sync_layer_peak(sizes, MIB) + layer  # + one layer vLLM buffers until all its tensors arrived
    assert small < 0.8 * sum(sizes)  # so the bound below is not trivially met
    peaks = {}
    for bucket in (MIB, 1 << 40):
        meter = LiveBytesMeter()
        engine.load_weights(meter.wrap(fresh_copies(policy)), bucket_bytes=bucket)
        assert meter.live == 0  # the engine kept no reference to a sent tensor
        peaks[bucket] = meter.peak
    assert peaks[MIB] <= small
    assert peaks[1 << 40] == sum(sizes)
    assert_engine_serves(engine, policy)


def test_a_failing_sync_raises_and_the_engine_keeps_working(engine, policy):
    before = [c.token_ids for c in engine.generate(PROMPTS, GREEDY)]
    perturb(policy, seed=7)
    stream = list(fresh_copies(policy))
    bad_first = [(stream[0][0], stream[0][1][:, :-1])] + stream[1:]
    with pytest.raises(WeightSyncError, match="model.embed_tokens.weight"):
        engine.load_weights(bad_first, bucket_bytes=MIB)
    assert [c.token_ids for c in engine.generate(PROMPTS, GREEDY)] == before  # untouched

    index = [n for n, _ in stream].index("model.layers.5.mlp.down_proj.weight")
    name, tensor = stream[index]
    bad_later = stream[:index] + [(name, tensor[:, :-1])] + stream[index + 1:]
    with pytest.raises(WeightSyncError, match=name.replace(".", r"\.")):
        engine.load_weights(bad_later, bucket_bytes=MIB)
    with pytest.raises(EngineStateError, match="full weight sync"):
        engine.generate(PROMPTS, GREEDY)
    engine.load_weights(stream, bucket_bytes=MIB)
    assert_engine_serves(engine, policy)


def test_seeds_decide_the_samples(engine):
    state = engine.state_dict()
    first = [c.token_ids for c in engine.generate(PROMPTS, SAMPLED)]
    later = [c.token_ids for c in engine.generate(PROMPTS, SAMPLED)]
    engine.load_state_dict(state)
    again = [c.token_ids for c in engine.generate(PROMPTS, SAMPLED)]
    engine.load_state_dict(state)
    other = [c.token_ids for c in engine.generate(PROMPTS, SamplingConfig(**{**SAMPLED.__dict__, "seed": 6}))]
    assert again == first and later != first and other != first
    assert first[0] != first[1]  # two samples of one prompt differ


def test_stop_tokens_end_responses(engine):
    free = engine.generate(PROMPTS[:1], GREEDY)[0]
    stop = free.token_ids[5]
    out = engine.generate(PROMPTS[:1], SamplingConfig(temperature=0, max_response_length=16, stop_token_ids=[stop]))[0]
    assert out.finish_reason == "stop" and out.token_ids == free.token_ids[:free.token_ids.index(stop) + 1]


def test_generation_leaves_process_state_alone(engine):
    torch.manual_seed(123)
    random.seed(123)
    expected_torch, expected_py = torch.rand(3), random.random()
    torch.manual_seed(123)
    random.seed(123)
    torch._C.set_num_threads(1)
    engine.generate(PROMPTS, SAMPLED)
    assert torch.equal(torch.rand(3), expected_torch) and random.random() == expected_py
    assert torch.set_num_threads is torch._C.set_num_threads and torch.get_num_threads() == 1


def test_sleep_frees_the_kv_cache_and_waking_serves_the_same_tokens(engine):
    """The CPU engine's own sleep (``free_cache_engine``): the process's RSS falls by the KV cache's 256 MiB and
    rises again at wake-up; generating while asleep is refused; after waking, greedy tokens and their log-probs
    are those of before."""
    import psutil

    before = [(c.token_ids, c.logprobs) for c in engine.generate(PROMPTS, GREEDY)]
    rss = psutil.Process().memory_info().rss
    engine.sleep()
    asleep = psutil.Process().memory_info().rss
    engine.sleep()  # idempotent
    with pytest.raises(EngineStateError, match="asleep"):
        engine.generate(PROMPTS, GREEDY)
    engine.wake_up(("weights",))  # the weights never left: still asleep
    with pytest.raises(EngineStateError, match="asleep"):
        engine.generate(PROMPTS, GREEDY)
    engine.wake_up(("kv_cache",))
    awake = psutil.Process().memory_info().rss
    assert rss - asleep >= 0.9 * ENGINE.kv_cache_memory_bytes, (rss, asleep)
    assert awake - asleep >= 0.9 * ENGINE.kv_cache_memory_bytes, (asleep, awake)
    assert [(c.token_ids, c.logprobs) for c in engine.generate(PROMPTS, GREEDY)] == before


def _weight_memory(worker) -> tuple[int, int, int]:
    """In the engine's worker: (bytes under the model's parameters, layers with a CPU kernel, of them dropped)."""
    from meshrl.rollout.vllm_worker import _dropped_linear, _parameter_storages

    model = worker.model_runner.get_model()
    kernels = [m.cpu_linear for m in model.modules() if getattr(m, "cpu_linear", None) is not None]
    return (sum(s.nbytes() for s in _parameter_storages(model)), len(kernels),
            sum(kernel is _dropped_linear for kernel in kernels))


def test_level_2_sleep_drops_the_weights_and_the_next_sync_serves_the_policy(engine, policy, monkeypatch):
    """sleep_level=2 on CPU (verl's level, the trainer's unless only adapters are synced): the parameters' memory
    and the CPU kernels' packed weights go with the KV cache; waking gives the memory back zeroed and generating
    is refused until a full sync, which the trainer makes while the engine sleeps; then the policy's tokens and
    log-probs, exactly."""
    monkeypatch.setattr(engine, "config", dataclasses.replace(engine.config, sleep_level=2))
    perturb(policy, seed=3)
    engine.load_weights(policy.named_parameters())
    before = [(c.token_ids, c.logprobs) for c in engine.generate(PROMPTS, GREEDY)]
    (held, kernels, dropped), = engine.llm.collective_rpc(_weight_memory)
    assert held > 0 and kernels > 12 and dropped == 0
    engine.sleep()
    assert engine.weights_dropped and not engine.weights_complete
    assert engine.llm.collective_rpc(_weight_memory) == [(0, kernels, kernels)]
    engine.wake_up()
    assert engine.llm.collective_rpc(_weight_memory) == [(held, kernels, kernels)]
    with pytest.raises(EngineStateError, match="slept at level 2, which drops its weights"):
        engine.generate(PROMPTS, GREEDY)
    engine.sleep()
    engine.load_weights(policy.named_parameters())  # wakes the weights, then fills them
    assert engine.weights_complete and not engine.weights_dropped
    with pytest.raises(EngineStateError, match="asleep"):  # the KV cache still is
        engine.generate(PROMPTS, GREEDY)
    engine.wake_up(("kv_cache",))
    assert engine.llm.collective_rpc(_weight_memory) == [(held, kernels, 0)]
    assert [(c.token_ids, c.logprobs) for c in engine.generate(PROMPTS, GREEDY)] == before


def test_engine_arg_names_are_vllms_engine_args_fields():
    from vllm.engine.arg_utils import EngineArgs

    from meshrl.rollout.base import vllm_engine_arg_names

    assert vllm_engine_arg_names() == {f.name for f in dataclasses.fields(EngineArgs)}


def test_verl_rollout_keys_reach_vllm(configured_engine, engine):
    configured, default = configured_engine.llm.llm_engine, engine.llm.llm_engine
    assert (configured.vllm_config.cache_config.enable_prefix_caching,
            default.vllm_config.cache_config.enable_prefix_caching) == (False, True)
    assert (configured.vllm_config.load_config.load_format,
            default.vllm_config.load_config.load_format) == ("dummy", "auto")
    assert (configured.log_stats, default.log_stats) == (True, False)
    assert (configured.vllm_config.model_config.max_logprobs, default.vllm_config.model_config.max_logprobs) == (7, 20)


def test_a_dummy_engine_serves_the_policy_after_the_first_sync(configured_engine, engine, policy):
    """Random weights until a sync; then the same tokens and log-probs as the engine that read the checkpoint."""
    with pytest.raises(EngineStateError, match="load_format=dummy started it from random weights"):
        configured_engine.generate(PROMPTS, GREEDY)
    configured_engine.load_weights(policy.named_parameters())
    assert_engine_serves(configured_engine, policy)
    for each in (engine, configured_engine):  # the same call index, so the same seeds
        each.load_state_dict({"calls": 0})
    for synced, loaded in zip(configured_engine.generate(PROMPTS, SAMPLED), engine.generate(PROMPTS, SAMPLED)):
        assert synced.token_ids == loaded.token_ids and synced.logprobs == pytest.approx(loaded.logprobs, abs=1e-5)
