"""vLLM's LoRA adapter path (``meshrl.rollout.lora_adapter``), in process at TP1 on the tiny Llama: the Megatron
policy's adapters (TP-gathered, PEFT-named by ``peft_io.iter_adapter_weights``) go into an engine that holds the
base weights from the model folder, in memory, as a new adapter per sync. The independent reference is the HF
model holding the merged weights (equal to the trainer's outputs within 1e-5, ``test_lora.py``): the engine's
log-probs of its sampled tokens must be that model's after every sync, and a refused stream must leave the served
adapter in place.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from mp_worker import hf_model
from test_lora import ALL, lora_model, train

from meshrl.parallel import lora, peft_io

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from test_family_vllm import PROMPTS, hf_logprobs, tp1  # noqa: E402,F401  (tp1: a fixture)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]


def served_gap(completions, reference) -> float:
    """The largest |engine - ``reference``| log-prob of a sampled token."""
    return max(float((torch.tensor(c.logprobs) - hf_logprobs(reference, PROMPTS[c.prompt_index], c.token_ids))
                     .abs().max()) for c in completions)


def merged_hf(path, chunks):
    model = hf_model(path, critic=False)
    missing, unexpected = model.load_state_dict(dict(peft_io.iter_merged_weights(chunks, model.config)), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    model.tie_weights()
    return model.eval()


def test_adapter_sync_serves_the_trainers_policy(tp1, tiny_llama_dir) -> None:
    from meshrl.rollout import EngineConfig, SamplingConfig, create_engine
    from meshrl.rollout.weight_sync import WeightSyncError

    settings = lora.LoraSettings(rank=8, alpha=16, targets=ALL)
    chunks = lora_model(tiny_llama_dir, settings)
    train(chunks, 2)  # B != 0: the adapters change the outputs
    config = peft_io.adapter_config(settings, str(tiny_llama_dir))
    sampling = SamplingConfig(n=2, max_response_length=12, ignore_eos=True, seed=3)
    engine = create_engine(tiny_llama_dir, EngineConfig(kv_cache_memory_bytes=128 << 20, max_model_len=256,
                                                        max_num_seqs=16, max_lora_rank=8))
    try:
        gaps = {"base": served_gap(engine.generate(PROMPTS, sampling), hf_model(tiny_llama_dir, critic=False))}
        for sync in (1, 2):
            stats = engine.load_adapter(peft_io.iter_adapter_weights(chunks), config)
            # 2 layers x 7 modules x (A, B): r * (in + out) numbers each, not the weights
            assert (stats.tensors, engine.lora_request.lora_int_id) == (28, sync)
            served = engine.generate(PROMPTS, sampling)
            gaps[sync] = served_gap(served, merged_hf(tiny_llama_dir, chunks))
            if sync == 1:
                synced_first = merged_hf(tiny_llama_dir, chunks)
                train(chunks, 2)
        # the second sync really moved the served policy away from the first
        gaps["second_vs_first_policy"] = served_gap(served, synced_first)
        # a refused stream (rank 4 tensors for a rank-8 config) leaves adapter 2 served
        with pytest.raises(WeightSyncError, match="shape"):
            engine.load_adapter(((name, t[:4] if name.endswith("lora_A.weight") else t[:, :4])
                                 for name, t in peft_io.iter_adapter_weights(chunks)), config)
        assert engine.lora_request.lora_int_id == 2
        gaps["after_refusal"] = served_gap(engine.generate(PROMPTS, sampling), merged_hf(tiny_llama_dir, chunks))
    finally:
        engine.shutdown()
    print(gaps)
    assert max(gaps["base"], gaps[1], gaps[2], gaps["after_refusal"]) < 1e-4  # fp32: measured ~2e-6
    assert gaps["second_vs_first_policy"] > 1e-3
