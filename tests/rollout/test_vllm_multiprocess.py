"""The standalone (multiprocess) vLLM engine: weights travel as one flat byte buffer per bucket."""

from __future__ import annotations

import pytest
import torch

from meshrl.rollout import EngineConfig, SamplingConfig, WeightSyncError, create_engine
from meshrl.rollout.flat_buckets import flatten_bucket, unflatten_bucket

PROMPTS = [[1, 2, 3, 4], [5, 6, 7], list(range(300, 320))]
GREEDY = SamplingConfig(temperature=0, max_response_length=10, ignore_eos=True)


def test_flat_buckets_round_trip():
    bucket = [("a", torch.randn(3, 4)), ("b", torch.arange(5, dtype=torch.float64)),
              ("c", torch.randn(4, 3).t()), ("d", torch.randn(2, dtype=torch.bfloat16))]
    layout, flat = flatten_bucket(bucket)
    assert flat.dtype == torch.uint8 and flat.numel() == sum(t.numel() * t.element_size() for _, t in bucket)
    restored = unflatten_bucket(layout, torch.frombuffer(bytearray(flat.numpy().tobytes()), dtype=torch.uint8))
    for (name, tensor), (got_name, got) in zip(bucket, restored):
        assert name == got_name and got.dtype == tensor.dtype and torch.equal(got, tensor)


@pytest.mark.vllm
@pytest.mark.timeout(240)
def test_multiprocess_engine_syncs_through_flat_buffers(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    engine = create_engine(tiny_llama_dir, EngineConfig(in_process=False, kv_cache_memory_bytes=128 << 20,
                                                        max_model_len=256, max_num_seqs=16))
    try:
        reference = create_engine(tiny_llama_dir, EngineConfig(name="hf"))
        assert [c.token_ids for c in engine.generate(PROMPTS, GREEDY)] == [
            c.token_ids for c in reference.generate(PROMPTS, GREEDY)]
        policy = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
        with torch.no_grad():
            for param in policy.parameters():
                param.add_(0.02 * torch.randn(param.shape, generator=torch.Generator().manual_seed(param.numel())))
        stats = engine.load_weights(policy.named_parameters(), bucket_bytes=1 << 20)
        assert stats.buckets > 1
        reference.load_weights(policy.named_parameters())
        expected = [c.token_ids for c in reference.generate(PROMPTS, GREEDY)]
        assert [c.token_ids for c in engine.generate(PROMPTS, GREEDY)] == expected
        with pytest.raises(WeightSyncError, match="model.norm.weight"):
            engine.load_weights([("model.norm.weight", torch.zeros(3))])
        assert [c.token_ids for c in engine.generate(PROMPTS, GREEDY)] == expected
    finally:
        engine.shutdown()
