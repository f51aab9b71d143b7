"""Resharding mixture-of-experts weights into vLLM's fused-MoE layers: Megatron (TP1, in process) ->
``iter_hf_weights`` (per-expert HF names) -> an in-process vLLM engine started from random weights
(``load_format=dummy``) in 1 MiB buckets, so every expert, router and shared-expert tensor it serves came through
the sync and fused layers straddle buckets. vLLM's own Qwen2-MoE / Qwen3-MoE / Mixtral code is the independent
check: its log-probs of sampled tokens must be those of the family's transformers class holding the exported
weights (fp32, CPU). Before the CPU experts were re-prepacked after a reload (``rollout/vllm_worker.py``) they
were off by ~1 nat."""

from __future__ import annotations

import pytest
import torch
from test_family_vllm import perturbed_megatron, served_logprob_error, tp1  # noqa: F401  (the fixture)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]


# Qwen2-MoE (shared expert and its gate, the seed's family) and DeepSeek-V3 (multi-latent attention on vLLM's CPU
# MLA backend, a dense first layer, sigmoid grouped routing with the synced e_score_correction_bias) in `make test`;
# Qwen3-MoE (top-k softmax routing, no shared expert) and Mixtral (block_sparse_moe names) in `make test-extended`:
# their experts take the same resharding path as Qwen2-MoE's routed ones, under other HF names.
@pytest.mark.parametrize("model_type", ["qwen2_moe", "deepseek_v3",
                                        *(pytest.param(m, marks=pytest.mark.extended)
                                          for m in ("qwen3_moe", "mixtral"))])
def test_engine_serves_the_resharded_experts(tp1, tmp_path, model_type: str) -> None:  # noqa: F811
    from transformers import AutoModelForCausalLM

    from meshrl.parallel import hf_conversion

    model_dir, hf_config, chunks = perturbed_megatron(model_type)
    exported = hf_conversion.save_hf_checkpoint(chunks, hf_config, tmp_path / "export", tokenizer_dir=model_dir)
    reference = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32, attn_implementation="eager").eval()
    synced, expected, worst = served_logprob_error(model_dir, hf_config, chunks, reference)
    assert synced == expected
    assert worst <= 1e-4, worst
