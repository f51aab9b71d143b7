"""Engine-independent parts of meshrl.rollout: configs, seeds, the factory, bucketing, sync semantics."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest
import torch

from meshrl.rollout import (
    Completion,
    EngineConfig,
    EngineStateError,
    EngineUnavailableError,
    LiveBytesMeter,
    RolloutEngine,
    SamplingConfig,
    WeightSyncError,
    colocated_rollout,
    create_engine,
    iter_buckets,
)
from meshrl.rollout.base import OWNED_VLLM_ARGS, request_seed
from meshrl.rollout.engines import unsupported_rollout_features

KIB = 1 << 10


class StubEngine(RolloutEngine):
    """Records every call; keeps its weights in a dict."""

    name = "stub"

    def __init__(self, path, shapes: dict[str, tuple[int, ...]], load_format: str = "auto") -> None:
        super().__init__(path, EngineConfig(name="hf", max_model_len=64, load_format=load_format), dp_rank=0)
        self.weights = {name: torch.zeros(shape) for name, shape in shapes.items()}
        self.events: list = []

    def _generate(self, prompts, sampling, seeds, max_tokens):
        return [Completion(i, j, [7], [-0.5], "length") for i in range(len(prompts)) for j in range(sampling.n)]

    def expected_weights(self):
        return {name: w.shape for name, w in self.weights.items()}

    def begin_weight_update(self):
        self.events.append("begin")

    def load_weight_bucket(self, bucket):
        self.events.append(("bucket", [name for name, _ in bucket]))
        for name, tensor in bucket:
            self.weights[name].copy_(tensor)

    def _finish_weight_update(self):
        self.events.append("finish")

    def sleep(self):
        self.events.append("sleep")

    def wake_up(self, tags=None):
        self.events.append(("wake", tuple(tags or ())))


SHAPES = {"model.embed_tokens.weight": (64, 32), **{f"model.layers.{i}.mlp.up_proj.weight": (32, 16)
                                                      for i in range(6)}, "model.norm.weight": (32,)}


def fresh_weights(value: float = 1.0):
    """A stream of new buffers, as iter_hf_weights yields them."""
    for name, shape in SHAPES.items():
        yield name, torch.full(shape, value)


@pytest.fixture
def engine(tmp_path):
    return StubEngine(tmp_path, SHAPES)


# --- configs --------------------------------------------------------------------------------

def test_sampling_config_validates_and_makes_greedy():
    with pytest.raises(ValueError, match="top_k"):
        SamplingConfig(top_k=0)
    with pytest.raises(ValueError, match="identical"):
        SamplingConfig(n=4, temperature=0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingConfig(top_p=0)
    greedy = SamplingConfig(n=4, temperature=0.7, top_k=20, max_response_length=9, stop_token_ids=[5]).as_greedy()
    assert greedy.greedy and greedy.n == 1 and greedy.top_k == -1
    assert greedy.max_response_length == 9 and greedy.stop_token_ids == (5,)


def test_configs_from_verl_rollout_section():
    from meshrl.config.schema import RolloutConfig

    section = RolloutConfig(n=4, temperature=0.8, top_k=50, response_length=128, prompt_length=256,
                            seed=3, tensor_model_parallel_size=1, kv_cache_memory_bytes=1 << 28)
    sampling = SamplingConfig.from_rollout(section)
    assert (sampling.n, sampling.temperature, sampling.top_k, sampling.max_response_length, sampling.seed) == (
        4, 0.8, 50, 128, 3)
    assert SamplingConfig.from_rollout(section, validation=True).greedy  # val_kwargs: do_sample=False
    engine = EngineConfig.from_rollout(section, max_num_seqs=8)
    assert (engine.name, engine.max_model_len, engine.kv_cache_memory_bytes, engine.max_num_seqs) == (
        "vllm", 384, 1 << 28, 8)
    assert engine.logprobs_mode == EngineConfig().logprobs_mode == "processed_logprobs"  # verl's default
    raw = RolloutConfig(response_length=8, logprobs_mode="raw_logprobs")
    assert EngineConfig.from_rollout(raw).logprobs_mode == "raw_logprobs"
    # verl's enable_sleep_mode=False (its fully async scripts' +key): the engine never sleeps
    assert engine.free_cache_engine and not EngineConfig.from_rollout(RolloutConfig(enable_sleep_mode=False)
                                                                      ).free_cache_engine
    assert SamplingConfig.from_rollout({"do_sample": False, "response_length": 4}).greedy
    with pytest.raises(TypeError, match="unknown EngineConfig field"):
        EngineConfig.from_rollout(section, kv_cache_bytes=1)
    with pytest.raises(ValueError, match="response_length"):
        SamplingConfig.from_rollout(SimpleNamespace(n=1))


@pytest.mark.parametrize("mode", ["raw_logits", "processed_logits"])
def test_logits_modes_are_refused(mode):
    with pytest.raises(ValueError, match=f"logprobs_mode={mode} makes the engine return logits"):
        EngineConfig(logprobs_mode=mode)
    with pytest.raises(ValueError, match="must be one of"):
        EngineConfig(logprobs_mode="processed")


def test_request_seeds_are_distinct_and_deterministic():
    seeds = {request_seed(r, c, i) for r in range(3) for c in range(3) for i in range(50)}
    assert len(seeds) == 450 and max(seeds) < 2 ** 62
    assert request_seed(1, 2, 3) == request_seed(1, 2, 3)


def test_selecting_vllm_without_vllm_names_the_fallback(monkeypatch, tmp_path):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    with pytest.raises(EngineUnavailableError, match="rollout.name=hf"):
        create_engine(tmp_path, EngineConfig(name="vllm"))
    with pytest.raises(ValueError, match="rollout.name"):
        EngineConfig(name="sglang")


def test_sleep_level_2_is_refused_with_lora_adapters():
    """Level 2 drops the base weights, which an adapter sync never resends (the worker picks 1 for adapters)."""
    assert EngineConfig(sleep_level=2).sleep_level == 2 and EngineConfig(sleep_level=1, max_lora_rank=8)
    with pytest.raises(ValueError, match="sleep_level=2 drops the base weights.*sleep_level=1"):
        EngineConfig(sleep_level=2, max_lora_rank=8)
    with pytest.raises(ValueError, match="sleep_level must be 1 or 2"):
        EngineConfig(sleep_level=3)


needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="checks vLLM's EngineArgs")
ROLLOUT = "actor_rollout_ref.rollout."


def rollout_section(*overrides: str):
    from meshrl.config import load_config

    return load_config([f"{'+' if '.engine_kwargs.' in o else ''}{ROLLOUT}{o}"
                        for o in overrides]).actor_rollout_ref.rollout


def test_verl_engine_keys_reach_the_engine_config():
    """enable_prefix_caching, load_format, disable_log_stats and engine_kwargs.vllm.* (verl's keys) parse and
    land in EngineConfig as plain values; a None engine argument is unset, as in verl."""
    rollout = rollout_section("enable_prefix_caching=False", "load_format=dummy_megatron", "disable_log_stats=False",
                              "engine_kwargs.vllm.max_logprobs=7", "engine_kwargs.vllm.kv_cache_dtype=null",
                              "engine_kwargs.vllm.compilation_config.cudagraph_capture_sizes=[4,8]")
    config = EngineConfig.from_rollout(rollout)
    assert (config.enable_prefix_caching, config.load_format, config.random_init, config.disable_log_stats) == (
        False, "dummy_megatron", True, False)
    assert config.vllm_kwargs == {"max_logprobs": 7, "compilation_config": {"cudagraph_capture_sizes": [4, 8]}}
    assert type(config.vllm_kwargs["compilation_config"]["cudagraph_capture_sizes"]) is list  # not OmegaConf's
    defaults = EngineConfig.from_rollout(rollout_section())
    # verl's default: the engine starts from random weights and the policy worker's first sync replaces them
    assert (defaults.enable_prefix_caching, defaults.load_format, defaults.random_init, defaults.vllm_kwargs) == (
        True, "dummy", True, {})


def test_engine_arguments_meshrl_sets_are_refused_with_the_key_to_set():
    with pytest.raises(ValueError, match=r"engine_kwargs\.vllm\.seed: .*set actor_rollout_ref\.rollout\.seed instead"):
        EngineConfig(vllm_kwargs={"seed": 3})
    with pytest.raises(ValueError, match=r"engine_kwargs\.vllm\.max_model_len: .*data\.max_prompt_length"):
        EngineConfig(vllm_kwargs={"max_model_len": 4096})
    with pytest.raises(ValueError, match="rollout.name=hf takes no vLLM engine arguments"):
        EngineConfig(name="hf", vllm_kwargs={"max_logprobs": 7})


def test_every_argument_the_vllm_engine_sets_is_owned():
    """engine_kwargs.vllm can never collide with (or silently replace) an argument meshrl passes to vLLM."""
    from meshrl.rollout.vllm_engine import VLLMEngine

    config = EngineConfig(vllm_kwargs={"max_logprobs": 7})
    for cuda in (False, True):
        for colocated in (False, True):
            fake = SimpleNamespace(model_path="m", _cuda=cuda, dp_rank=0, _cpu_attention_backend=None)
            kwargs = VLLMEngine._engine_kwargs(fake, config, colocated)
            assert set(kwargs) - {"max_logprobs"} <= set(OWNED_VLLM_ARGS) and kwargs["max_logprobs"] == 7
            assert kwargs["load_format"] == "auto"
    dummy = VLLMEngine._engine_kwargs(SimpleNamespace(model_path="m", _cuda=False, dp_rank=0,
                                                      _cpu_attention_backend=None),
                                      EngineConfig(load_format="dummy_megatron"), False)
    assert dummy["load_format"] == "dummy"
    # an fp32 MLA model on an AMX CPU (serving_limits.vllm_cpu_mla_backend): vLLM's reference MLA backend, unless the
    # rollout's engine_kwargs choose an attention_config themselves
    mla = SimpleNamespace(model_path="m", _cuda=False, dp_rank=0, _cpu_attention_backend="CPU_MLA")
    assert VLLMEngine._engine_kwargs(mla, EngineConfig(), False)["attention_config"] == {"backend": "CPU_MLA"}
    chosen = EngineConfig(vllm_kwargs={"attention_config": {"backend": "AMX_MLA"}})
    assert VLLMEngine._engine_kwargs(mla, chosen, False)["attention_config"] == {"backend": "AMX_MLA"}


@needs_vllm
def test_engine_arguments_vllm_lacks_are_refused_with_a_suggestion():
    with pytest.raises(ValueError,
                       match=r"engine_kwargs\.vllm\.max_logprob: not an argument .* did you mean max_logprobs"):
        EngineConfig(vllm_kwargs={"max_logprob": 7})
    with pytest.raises(ValueError, match=r"mm_processor_cache_size: .*did you mean .*mm_processor_cache_gb"):
        EngineConfig(vllm_kwargs={"mm_processor_cache_size": 1})


def test_an_engine_argument_vllm_renamed_reaches_it_under_its_new_name():
    """verl's image scripts pass disable_mm_preprocessor_cache, which vLLM 0.32 spells mm_processor_cache_gb=0."""
    assert EngineConfig(vllm_kwargs={"disable_mm_preprocessor_cache": True}).vllm_kwargs == {"mm_processor_cache_gb": 0}
    assert EngineConfig(vllm_kwargs={"disable_mm_preprocessor_cache": False}).vllm_kwargs == {}


def test_load_formats_meshrl_cannot_load_are_refused():
    with pytest.raises(ValueError, match="load_format: 'gguf' is not one meshrl's engines load: auto, hf"):
        EngineConfig(load_format="gguf")


def test_a_dummy_load_format_generates_only_after_a_full_sync(tmp_path):
    engine = StubEngine(tmp_path, SHAPES, load_format="dummy")
    assert not engine.weights_complete
    with pytest.raises(EngineStateError, match="load_format=dummy started it from random weights"):
        engine.generate([[1]], SamplingConfig())
    engine.load_weights(fresh_weights())
    assert engine.weights_complete and len(engine.generate([[1]], SamplingConfig())) == 1


def test_unsupported_rollout_features_one_line_per_feature():
    assert unsupported_rollout_features(rollout_section()) == []
    lines = unsupported_rollout_features(rollout_section(
        "engine_kwargs.sglang.attention_backend=triton", "engine_kwargs.trtllm.batch_wait_timeout_iters=32",
        "engine_kwargs.vllm.max_model_len=4096", "load_format=gguf"))
    keys = [line.split(":")[0] for line in lines]
    assert keys == [f"{ROLLOUT}{k}" for k in ("engine_kwargs.sglang", "engine_kwargs.trtllm", "load_format",
                                               "engine_kwargs.vllm.max_model_len")]
    assert "engines are vllm and hf" in lines[0] and "(attention_backend)" in lines[0]
    # Mappings and attribute objects work as OmegaConf nodes do.
    assert unsupported_rollout_features(SimpleNamespace(name="hf", engine_kwargs={"vllm": {"max_logprobs": 7}})) == [
        f"{ROLLOUT}engine_kwargs.vllm: rollout.name=hf takes no vLLM engine arguments (max_logprobs); remove them, "
        "or choose rollout.name=vllm"]


def test_generate_layout_and_prompt_checks(engine):
    out = engine.generate([[1, 2], [3]], SamplingConfig(n=3))
    assert [(c.prompt_index, c.sample_index) for c in out] == [(i, j) for i in range(2) for j in range(3)]
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        engine.generate([[1], []], SamplingConfig())
    with pytest.raises(ValueError, match="max_model_len"):
        engine.generate([list(range(64))], SamplingConfig())
    assert engine.state_dict() == {"calls": 1}


# --- bucketing and memory -------------------------------------------------------------------

def test_buckets_respect_the_size_and_send_oversize_tensors_alone():
    sizes = [3, 3, 10, 1, 1, 1, 4]
    stream = [(f"t{i}", torch.zeros(n, dtype=torch.uint8)) for i, n in enumerate(sizes)]
    buckets = [[name for name, _ in b] for b in iter_buckets(stream, bucket_bytes=6)]
    assert buckets == [["t0", "t1"], ["t2"], ["t3", "t4", "t5"], ["t6"]]
    with pytest.raises(ValueError):
        next(iter_buckets(stream, 0))


@pytest.mark.parametrize("bucket_kib", [4, 16, 10_000])
def test_sync_memory_is_bounded_by_the_bucket(engine, bucket_kib):
    meter = LiveBytesMeter()
    stats = engine.load_weights(meter.wrap(fresh_weights(2.0)), bucket_bytes=bucket_kib * KIB)
    total = sum(torch.Size(s).numel() * 4 for s in SHAPES.values())
    largest = max(torch.Size(s).numel() * 4 for s in SHAPES.values())
    assert stats.tensors == len(SHAPES) and stats.bytes == total
    assert all(torch.equal(w, torch.full_like(w, 2.0)) for w in engine.weights.values())
    # One bucket being filled plus the tensor that overflowed it, never the model.
    assert meter.peak <= max(bucket_kib * KIB, largest) + largest
    if bucket_kib * KIB >= total:
        assert meter.peak == total and stats.buckets == 1
    assert meter.live == 0


# --- failures ---------------------------------------------------------------------------------

def test_a_bad_first_tensor_leaves_the_engine_untouched(engine):
    engine.load_weights(fresh_weights(1.0))
    engine.events.clear()
    stream = [("model.embed_tokens.weight", torch.zeros(64, 31))] + list(fresh_weights(5.0))[1:]
    with pytest.raises(WeightSyncError, match=r"'model.embed_tokens.weight' has shape \(64, 31\)"):
        engine.load_weights(stream, bucket_bytes=KIB)
    assert engine.events == [] and engine.weights_complete
    assert all(torch.equal(w, torch.ones_like(w)) for w in engine.weights.values())
    engine.generate([[1]], SamplingConfig())


def test_a_bad_tensor_after_loaded_buckets_blocks_generation_until_a_full_sync(engine):
    stream = list(fresh_weights(3.0))
    trainer_copy = [(n, t.clone()) for n, t in stream]
    stream[4] = ("model.layers.3.mlp.up_proj.weight", torch.zeros(16, 32))
    with pytest.raises(WeightSyncError, match="model.layers.3.mlp.up_proj.weight"):
        engine.load_weights(stream, bucket_bytes=2 * KIB)
    assert engine.events[0] == "begin" and engine.events[-1] == "finish"
    sent = [name for event in engine.events if isinstance(event, tuple) for name in event[1]]
    assert "model.layers.3.mlp.up_proj.weight" not in sent
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(stream[:4], trainer_copy[:4]))  # trainer intact
    assert not engine.weights_complete
    with pytest.raises(EngineStateError, match="full weight sync"):
        engine.generate([[1]], SamplingConfig())
    engine.load_weights(fresh_weights(4.0))
    assert engine.weights_complete and engine.generate([[1]], SamplingConfig())


@pytest.mark.parametrize("stream, message", [
    ([("lm_head.weight", torch.zeros(64, 32))], "do not send lm_head.weight"),
    ([("model.layers.0.mlp.up_proj.weigth", torch.zeros(32, 16))], "did you mean 'model.layers.0.mlp.up_proj.weight'"),
    ([("model.norm.weight", torch.zeros(32)), ("model.norm.weight", torch.zeros(32))], "sent twice"),
    ([("model.norm.weight", torch.zeros(32, dtype=torch.long))], "floating point"),
    (list(fresh_weights())[:-1], "ended without 1 of the engine's 8 tensors"),
])
def test_sync_errors_name_the_problem(engine, stream, message):
    with pytest.raises(WeightSyncError, match=message):
        engine.load_weights(stream, bucket_bytes=KIB)


def test_an_error_raised_by_the_stream_itself_closes_the_update(engine):
    def broken():
        yield from list(fresh_weights())[:3]
        raise RuntimeError("gather failed")

    with pytest.raises(RuntimeError, match="gather failed"):
        engine.load_weights(broken(), bucket_bytes=KIB)
    assert engine.events[-1] == "finish" and not engine.weights_complete


# --- colocation hand-off ----------------------------------------------------------------------

def test_colocated_rollout_orders_the_hand_off(engine):
    calls = []
    with colocated_rollout(engine, fresh_weights(), offload_trainer=lambda: calls.append("offload"),
                           onload_trainer=lambda: calls.append("onload")) as active:
        engine.events.append("generate")
        calls.append("body")
        active.generate([[1]], SamplingConfig())
    events = [e if isinstance(e, str) or e[0] == "wake" else "bucket" for e in engine.events]
    assert events[0] == ("wake", ("weights",)) and events[1] == "begin"
    assert events[-4:] == ["finish", ("wake", ("kv_cache",)), "generate", "sleep"]
    assert calls == ["offload", "body", "onload"]


def test_colocated_rollout_failed_sync_never_touches_the_trainer(engine):
    calls = []
    with pytest.raises(WeightSyncError):
        with colocated_rollout(engine, [("nope", torch.zeros(1))], offload_trainer=lambda: calls.append("off"),
                               onload_trainer=lambda: calls.append("on")):
            pytest.fail("the body must not run")
    assert calls == [] and engine.events == [("wake", ("weights",)), "sleep"]


def test_colocated_rollout_restores_the_trainer_when_generation_fails(engine):
    calls = []
    with pytest.raises(KeyError):
        with colocated_rollout(engine, offload_trainer=lambda: calls.append("off"),
                               onload_trainer=lambda: calls.append("on")):
            raise KeyError("boom")
    assert calls == ["off", "on"] and engine.events[-1] == "sleep"


def test_every_engine_name_has_an_engine():
    """rollout.name's choices (EngineConfig) and the engine table (create_engine) name the same engines."""
    from meshrl.rollout.base import ENGINE_NAMES
    from meshrl.rollout.engines import ENGINES

    assert tuple(ENGINES) == ENGINE_NAMES
