"""Resharding into vLLM for the families with their own structure: Megatron (TP1, in process) -> ``iter_hf_weights``
-> an in-process vLLM engine that started from random weights (``load_format=dummy``), so every tensor it serves
came through the sync, Qwen3's q_norm / k_norm and Gemma's zero-centred norms and post norms included. vLLM's own
model code for the family is the independent check: its log-probs of sampled tokens must be those of the family's
transformers class holding the exported weights (fp32, CPU) — for Gemma 2 / 3 with soft-capping and the tiny
models' 4-token window, which the 40-token prompt passes."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]

PROMPTS = [[1, 9690, 198, 2683, 359], [5, 6, 7], list(range(300, 340))]


@pytest.fixture(scope="module")
def tp1():
    from meshrl.parallel import state

    state.initialize(state.ParallelConfig())
    yield
    state.destroy()


@torch.no_grad()
def hf_logprobs(model, prompt: list[int], response: list[int]) -> torch.Tensor:
    logits = model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None])[:, 0]


def perturbed_megatron(model_type: str):
    """(folder, HF config, Megatron chunks) of the family's tiny model at TP1, its weights moved off the folder's
    (a stand-in for training: the synced weights are neither the folder's nor the engine's random ones)."""
    from transformers import AutoConfig

    from meshrl.models.tiny import tiny_model_dir, tiny_spec
    from meshrl.parallel import hf_conversion, model_builder

    model_dir = tiny_model_dir(tiny_spec(model_type))
    hf_config = AutoConfig.from_pretrained(model_dir)
    chunks = model_builder.build_model(hf_config)
    hf_conversion.load_hf_weights(chunks, model_dir)
    generator = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for param in (p for chunk in chunks for p in chunk.parameters()):
            param.add_(0.02 * torch.randn(param.shape, generator=generator))
    return model_dir, hf_config, chunks


def served_logprob_error(model_dir, hf_config, chunks, reference) -> tuple[int, int, float]:
    """Sync ``chunks`` into an in-process vLLM engine started from random weights (1 MiB buckets), sample from it;
    (tensors synced, tensors the engine expects, the largest |engine - ``reference``| log-prob of a sampled token)."""
    from meshrl.parallel import hf_conversion
    from meshrl.rollout import EngineConfig, SamplingConfig, create_engine

    engine = create_engine(model_dir, EngineConfig(kv_cache_memory_bytes=128 << 20, max_model_len=256,
                                                   max_num_seqs=16, load_format="dummy"))
    try:
        stats = engine.load_weights(hf_conversion.iter_hf_weights(chunks, hf_config), bucket_bytes=1 << 20)
        expected = len(engine.expected_weights())
        completions = engine.generate(PROMPTS, SamplingConfig(n=2, max_response_length=12, ignore_eos=True, seed=3))
    finally:
        engine.shutdown()
    worst = max(float((torch.tensor(c.logprobs) - hf_logprobs(reference, PROMPTS[c.prompt_index], c.token_ids))
                      .abs().max()) for c in completions)
    return stats.tensors, expected, worst


@pytest.mark.parametrize("model_type", ["qwen3", "mistral", "gemma", "gemma2", "gemma3_text", "phi3", "glm4"])
def test_engine_serves_the_resharded_megatron_weights(tp1, model_type: str) -> None:
    from transformers import AutoModelForCausalLM

    from meshrl.parallel import hf_conversion

    model_dir, hf_config, chunks = perturbed_megatron(model_type)
    exported = {name: tensor.clone() for name, tensor in hf_conversion.iter_hf_weights(chunks, hf_config)}
    # eager: HF's SDPA attention skips Gemma 2's attention soft-capping (logits off by 1.5 on tiny:gemma2)
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    missing, unexpected = reference.load_state_dict(exported, strict=False)
    assert unexpected == [] and set(missing) <= {"lm_head.weight"}  # tied: lm_head is embed_tokens
    synced, expected, worst = served_logprob_error(model_dir, hf_config, chunks, reference)
    assert synced == len(exported) == expected
    assert worst <= 1e-4, worst
