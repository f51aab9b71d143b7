"""Single-process unit checks: HF config mapping, layout validation, the conversion table, padding packing."""

from __future__ import annotations

import pytest
import torch

from meshrl.models.tiny import TinySpec, build_tiny_model, tiny_config
from meshrl.parallel import convert_cli, forward, hf_conversion, model_builder, schedule
from meshrl.parallel.state import ParallelConfig

LLAMA = TinySpec()
QWEN2 = TinySpec(arch="qwen2", hidden_size=256, tie_word_embeddings=False)


def smollm2_like():
    """SmolLM2-135M's architecture (30 layers, 9 heads / 3 KV heads, tied), no weights needed."""
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                       num_key_value_heads=3, head_dim=64, vocab_size=49152, tie_word_embeddings=True,
                       rope_theta=100000.0, rms_norm_eps=1e-5, max_position_embeddings=8192)


def test_model_spec_reads_llama_and_qwen2_features() -> None:
    llama = model_builder.model_spec(tiny_config(LLAMA))
    qwen2 = model_builder.model_spec(tiny_config(QWEN2))
    assert (llama.num_kv_heads, llama.head_dim, llama.tie_word_embeddings, llama.qkv_bias) == (2, 64, True, False)
    assert (qwen2.num_kv_heads, qwen2.tie_word_embeddings, qwen2.qkv_bias) == (2, False, True)
    assert model_builder.model_spec(smollm2_like()).rope_theta == 100000.0


def test_unsupported_configs_are_refused() -> None:
    config = tiny_config(LLAMA)
    config.rope_parameters = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}
    with pytest.raises(ValueError, match="rope_type 'llama3'"):
        model_builder.model_spec(config)
    config = tiny_config(LLAMA)
    config.model_type = "mistral"
    with pytest.raises(ValueError, match="model_type 'mistral'"):
        model_builder.model_spec(config)


@pytest.mark.parametrize("layout,message", [
    (ParallelConfig(tensor_parallel=2), "TP=2 does not divide num_attention_heads=9"),
    (ParallelConfig(tensor_parallel=3, pipeline_parallel=4),
     "PP=4 x virtual PP=1 does not divide num_hidden_layers=30"),
    (ParallelConfig(tensor_parallel=9), "TP=9 does not divide num_key_value_heads=3"),
    (ParallelConfig(pipeline_parallel=2, virtual_pipeline=2), "virtual PP=2 does not divide num_hidden_layers=30"),
])
def test_impossible_layouts_name_the_constraint(layout: ParallelConfig, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("=", "=")):
        model_builder.check_layout(model_builder.model_spec(smollm2_like()), layout)


def test_vocabulary_is_never_padded() -> None:
    spec = model_builder.model_spec(smollm2_like())
    model_builder.check_layout(spec, ParallelConfig(tensor_parallel=3, pipeline_parallel=2))
    odd = model_builder.ModelSpec(**{**spec.to_dict(), "vocab_size": 49153})
    with pytest.raises(ValueError, match="does not divide vocab_size=49153; meshrl does not pad"):
        model_builder.check_layout(odd, ParallelConfig(tensor_parallel=3))


def test_parallel_config_validation() -> None:
    with pytest.raises(ValueError, match="virtual_pipeline needs pipeline_parallel >= 2"):
        ParallelConfig(virtual_pipeline=2)
    with pytest.raises(ValueError, match="not divisible by TP\\*PP\\*CP"):
        ParallelConfig(tensor_parallel=2, pipeline_parallel=2).data_parallel_size(6)
    assert ParallelConfig(tensor_parallel=2).data_parallel_size(8) == 4


@pytest.mark.parametrize("spec,critic", [(LLAMA, False), (QWEN2, False), (QWEN2, True)])
def test_conversion_table_covers_exactly_the_hf_tensors(spec: TinySpec, critic: bool) -> None:
    from transformers import AutoModelForTokenClassification

    config = tiny_config(spec)
    if critic:
        config.num_labels = 1
        model = AutoModelForTokenClassification.from_config(config)
    else:
        model = build_tiny_model(spec)
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()
                if not (name == "lm_head.weight" and config.tie_word_embeddings)}
    table = {piece.hf_name: piece.shape for piece in hf_conversion.hf_layout(model_builder.model_spec(config), critic)}
    assert table == expected


def test_qkv_views_follow_megatrons_grouped_layout() -> None:
    """linear_qkv rows per KV group are [q heads of the group; k; v] and TP keeps whole groups."""
    spec = model_builder.model_spec(tiny_config(LLAMA))  # 4 q heads, 2 KV groups, head_dim 64
    pieces = {p.hf_name: p for p in hf_conversion.hf_layout(spec)}
    d, groups, per_group = spec.head_dim, spec.num_kv_heads, spec.num_attention_heads // spec.num_kv_heads
    fused = torch.arange(groups * (per_group + 2) * d, dtype=torch.float32).unsqueeze(1)
    rows = fused.view(groups, per_group + 2, d)
    for part, index in (("q", slice(0, per_group)), ("k", slice(per_group, per_group + 1)),
                        ("v", slice(per_group + 1, per_group + 2))):
        view = hf_conversion._part_view(fused, pieces[f"model.layers.0.self_attn.{part}_proj.weight"], spec, tp=1)
        assert torch.equal(view.reshape(-1), rows[:, index].reshape(-1))
    shard = fused[: fused.shape[0] // 2]  # TP rank 0 of 2 holds KV group 0 whole
    q0 = hf_conversion._part_view(shard, pieces["model.layers.0.self_attn.q_proj.weight"], spec, tp=2)
    assert torch.equal(q0.reshape(-1), rows[0, :per_group].reshape(-1))


def test_spec_mismatch_names_the_hf_field() -> None:
    base = model_builder.model_spec(tiny_config(LLAMA))
    other = model_builder.ModelSpec(**{**base.to_dict(), "num_kv_heads": 4, "ffn_hidden_size": 512})
    with pytest.raises(convert_cli.ConfigMismatch, match="num_key_value_heads: checkpoint has 2, HF config has 4"):
        convert_cli.compare_specs(base, other)
    with pytest.raises(convert_cli.ConfigMismatch, match="intermediate_size"):
        convert_cli.compare_specs(base, other)


def test_pack_moves_valid_tokens_first_and_unpack_restores_alignment() -> None:
    ids = torch.tensor([[5, 6, 7, 0, 0], [0, 0, 8, 9, 10], [11, 0, 12, 13, 0]])
    mask = torch.tensor([[1, 1, 1, 0, 0], [0, 0, 1, 1, 1], [1, 0, 1, 1, 0]])
    packed = forward.pack(ids, mask)
    assert packed.input_ids[:, :3].tolist() == [[5, 6, 7], [8, 9, 10], [11, 12, 13]]
    assert packed.input_ids.shape == (3, 3) and bool(packed.valid.all())
    # A per-position value v[t] computed at packed position t concerns the next token.
    values = packed.input_ids.float() * 10
    out = forward.unpack(values, packed)
    assert out.tolist() == [[0, 50, 60, 0, 0], [0, 0, 0, 80, 90], [0, 0, 110, 120, 0]]


def test_unpack_zeroes_padding_even_when_values_are_not_finite() -> None:
    ids = torch.tensor([[1, 2, 0]])
    packed = forward.pack(ids, torch.tensor([[1, 1, 0]]))
    values = torch.tensor([[float("-inf"), 3.0]])
    assert forward.unpack(values, packed).tolist() == [[0.0, float("-inf"), 0.0]]


@pytest.mark.parametrize("m,pp,expected", [(4, 2, 2), (3, 2, 3), (5, 2, 3), (6, 4, 6), (8, 4, 4), (9, 4, 5)])
def test_interleaved_group_size(m: int, pp: int, expected: int) -> None:
    assert schedule._interleaving_group_size(m, pp) == expected


def test_interleaved_needs_pp_micro_batches() -> None:
    with pytest.raises(ValueError, match="at least PP=4 micro-batches"):
        schedule._interleaving_group_size(3, 4)


def test_cpu_layer_spec_is_megatrons_local_spec_with_sdpa_attention() -> None:
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    spec = model_builder._layer_spec(use_te=False)
    core = spec.submodules.self_attention.submodules.core_attention
    assert issubclass(core, DotProductAttention) and core.__name__ == "SDPACoreAttention"
    assert spec.submodules.input_layernorm is not None  # local spec: separate norms (not TE's fused ones)


def test_optimizer_config_validation() -> None:
    from meshrl.parallel.optimizer import OptimizerConfig

    with pytest.raises(ValueError, match="needs decay_steps"):
        OptimizerConfig(schedule="cosine")
    with pytest.raises(ValueError, match="must exceed warmup_steps"):
        OptimizerConfig(schedule="cosine", warmup_steps=10, decay_steps=10)
    with pytest.raises(ValueError, match="is not one of"):
        OptimizerConfig(schedule="wsd")
