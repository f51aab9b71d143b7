"""Phi-3's fused HF tensors and sliding window: the reader's view of a fused checkpoint, its shape check, and the
run lengths refused where vLLM would attend past the window the trainer applies."""

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoConfig

from meshrl.models.families import checkpoint_shapes, model_spec
from meshrl.models.tiny import tiny_config, tiny_model_dir, tiny_spec
from meshrl.parallel.hf_conversion import FusedHFReader, HFCheckpointReader
from meshrl.rollout.serving_limits import engine_window_problems


def test_a_part_reads_its_rows_of_the_fused_tensor_and_its_tp_shard():
    folder = tiny_model_dir(tiny_spec("phi3"))
    spec = model_spec(AutoConfig.from_pretrained(folder))
    raw = HFCheckpointReader(folder)
    reader = FusedHFReader(raw, spec)
    qkv = raw.read("model.layers.1.self_attn.qkv_proj.weight")
    q_rows, kv_rows = spec.num_attention_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    k = reader.read("model.layers.1.self_attn.k_proj.weight")
    assert (torch.equal(k, qkv[q_rows:q_rows + kv_rows])
            and reader.shape("model.layers.1.self_attn.k_proj.weight") == k.shape)
    # TP rank 1 of 2 of v: the second half of v's rows only
    v1 = reader.read("model.layers.1.self_attn.v_proj.weight", 0, 1, 2)
    assert torch.equal(v1, qkv[q_rows + kv_rows + kv_rows // 2:])
    gate_up = raw.read("model.layers.0.mlp.gate_up_proj.weight")
    assert torch.equal(reader.read("model.layers.0.mlp.up_proj.weight"), gate_up[spec.ffn_hidden_size:])
    assert "model.layers.0.mlp.up_proj.weight" in reader and "model.layers.0.mlp.up_proj.weight" not in raw
    assert set(raw.file_of) == set(checkpoint_shapes(spec))  # the tiny folder is a genuine Phi-3 checkpoint


def test_a_fused_tensor_of_the_wrong_size_is_named(tmp_path):
    folder = tiny_model_dir(tiny_spec("phi3"))
    spec = model_spec(AutoConfig.from_pretrained(folder))
    raw = HFCheckpointReader(folder)
    tensors = {name: raw.read(name) for name in raw.file_of}
    tensors["model.layers.0.self_attn.qkv_proj.weight"] = tensors["model.layers.0.self_attn.qkv_proj.weight"][:-64]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model.layers.0.self_attn.qkv_proj.weight has shape \(448, 128\) but the "
                                         r"config implies \(512, 128\) \(its parts q_proj, k_proj, v_proj stacked\)"):
        FusedHFReader(HFCheckpointReader(tmp_path), spec)


def test_vllm_is_refused_where_sequences_outgrow_phi3s_window():
    windowed = tiny_config(tiny_spec("phi3"))
    windowed.sliding_window = 64
    (problem,) = engine_window_problems("vllm", windowed, sequence_length=65)
    assert "without its 64-token sliding window" in problem and "max_response_length <= 64" in problem
    assert engine_window_problems("vllm", windowed, sequence_length=64) == []
    assert engine_window_problems("hf", windowed, sequence_length=65) == []  # transformers slides it
    # Gemma 2's windows come with layer_types, which vLLM reads
    assert engine_window_problems("vllm", tiny_config(tiny_spec("gemma2")), sequence_length=4096) == []


def test_preflight_refuses_lora_on_fused_projections_and_a_sliding_vllm_run():
    from meshrl.config import ConfigError, load_config
    from meshrl.trainer.main import preflight

    base = ["actor_rollout_ref.model.path=tiny:phi3", "actor_rollout_ref.rollout.name=vllm"]
    with pytest.raises(ConfigError, match="LoRA on phi3, whose HF checkpoint fuses its projections"):
        preflight(load_config([*base, "actor_rollout_ref.model.lora_rank=8"], recipe="cpu_tiny_grpo"))
    assert preflight(load_config(base, recipe="cpu_tiny_grpo")).lora is None  # tiny:phi3 has no window
