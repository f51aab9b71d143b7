"""Single-process unit checks: HF config mapping, layout validation, the conversion table, padding packing."""

from __future__ import annotations

import pytest
import torch

from meshrl.models.families import hf_layout
from meshrl.models.tiny import TinySpec, tiny_config
from meshrl.parallel import convert_cli, forward, hf_conversion, layers, model_builder, schedule
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


def test_qkv_views_follow_megatrons_grouped_layout() -> None:
    """linear_qkv rows per KV group are [q heads of the group; k; v] and TP keeps whole groups."""
    spec = model_builder.model_spec(tiny_config(LLAMA))  # 4 q heads, 2 KV groups, head_dim 64
    pieces = {p.hf_name: p for p in hf_layout(spec)}
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


def test_trim_rows_moves_valid_tokens_first_and_unpack_restores_alignment() -> None:
    ids = torch.tensor([[5, 6, 7, 0, 0], [0, 0, 8, 9, 10], [11, 0, 12, 13, 0]])
    mask = torch.tensor([[1, 1, 1, 0, 0], [0, 0, 1, 1, 1], [1, 0, 1, 1, 0]])
    inputs = forward.trim_rows(ids, mask)
    assert inputs.input_ids.tolist() == [[5, 6, 7], [8, 9, 10], [11, 12, 13]]
    assert inputs.packed_seq_params is None
    # A per-position value v[t] computed at packed position t concerns the next token.
    out = forward.unpack(inputs.input_ids.float() * 10, inputs)
    assert out.tolist() == [[0, 50, 60, 0, 0], [0, 0, 0, 80, 90], [0, 0, 110, 120, 0]]


def test_pack_thd_lays_sequences_end_to_end_in_slots_and_unpack_restores_alignment() -> None:
    ids = torch.tensor([[5, 6, 7, 0, 0], [0, 0, 0, 0, 8], [11, 0, 12, 13, 14]])
    mask = torch.tensor([[1, 1, 1, 0, 0], [0, 0, 0, 0, 1], [1, 0, 1, 1, 1]])
    inputs = forward.pack_thd(ids, mask, pad_multiple=2)
    assert inputs.input_ids.tolist() == [[5, 6, 7, 0, 8, 0, 11, 12, 13, 14]]
    assert inputs.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 0, 1, 2, 3]]
    params = inputs.packed_seq_params
    assert params.qkv_format == "thd" and params.max_seqlen_q == params.max_seqlen_kv == 4
    assert params.cu_seqlens_q.tolist() == params.cu_seqlens_kv.tolist() == [0, 3, 4, 8]
    assert params.cu_seqlens_q_padded.tolist() == params.cu_seqlens_kv_padded.tolist() == [0, 4, 6, 10]
    out = forward.unpack(inputs.input_ids.float() * 10, inputs)
    assert out.tolist() == [[0, 50, 60, 0, 0], [0, 0, 0, 0, 0], [0, 0, 110, 120, 130]]


@pytest.mark.parametrize("packed", [False, True])
def test_output_mask_selects_the_positions_that_predict_its_tokens(packed: bool) -> None:
    ids = torch.tensor([[5, 6, 7, 0, 0], [0, 0, 8, 9, 10], [11, 0, 12, 13, 14]])
    mask = torch.tensor([[1, 1, 1, 0, 0], [0, 0, 1, 1, 1], [1, 0, 1, 1, 1]])
    # wanted: tokens 7 and 13, 14; token 8 is a first token (nothing predicts it), column 3 of row 0 padding
    output_mask = torch.tensor([[0, 0, 1, 1, 0], [0, 0, 1, 0, 0], [0, 0, 0, 1, 1]])
    inputs = (forward.pack_thd(ids, mask, pad_multiple=2) if packed else forward.trim_rows(ids, mask))
    full = forward.unpack(inputs.input_ids.float() * 10, inputs)
    forward.select_outputs(inputs, output_mask)
    selected = inputs.selected
    # the positions hold the tokens before the wanted ones: 6 (predicts 7), 12 and 13
    assert inputs.input_ids.reshape(-1)[selected].tolist() == [6, 12, 13]
    assert inputs.selected_tokens.tolist() == [7, 13, 14]
    out = forward.unpack(inputs.input_ids.reshape(-1)[selected].float()[None] * 10, inputs)
    assert out.tolist() == (full * output_mask * mask).tolist() == [[0, 0, 60, 0, 0], [0] * 5, [0, 0, 0, 120, 130]]


def test_shared_prompt_layout_runs_a_groups_prompt_once_and_each_response_after_it() -> None:
    """Rows 0, 2 and 3 share the prompt [5, 6] (left-padded differently), row 1 has its own; prompts end at column 3.
    Row 3's response is empty: it is predicted nothing and adds no slot."""
    ids = torch.tensor([[0, 5, 6, 7, 8], [4, 5, 6, 9, 0], [0, 5, 6, 10, 0], [0, 5, 6, 0, 0]])
    mask = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 0], [0, 1, 1, 1, 0], [0, 1, 1, 0, 0]])
    inputs = forward.pack_shared(ids, mask, prefix_columns=3, pad_multiple=2)
    assert inputs.input_ids.tolist() == [[5, 6, 7, 8, 10, 0, 4, 5, 6, 9]]  # prompt, two responses, row 1
    assert inputs.position_ids.tolist() == [[0, 1, 2, 3, 2, 3, 0, 1, 2, 3]]
    params = inputs.packed_seq_params
    assert params.cu_seqlens_q_padded.tolist() == [0, 2, 4, 6, 10] and params.cu_seqlens_q.tolist() == [0, 2, 4, 5, 9]
    assert params.segments == (None, (0, 2), (0, 2), None) and params.max_seqlen_q == 4
    # every source token's packed position holds that token; its predictor the token before it in its row
    flat = inputs.input_ids.reshape(-1)
    assert torch.equal(flat[inputs.packed_index], ids.reshape(-1)[inputs.source_index])
    assert inputs.predictor.tolist() == [-1, 0, 1, 2, -1, 6, 7, 8, -1, 0, 1, -1, 0]
    forward.select_outputs(inputs, (torch.arange(5) >= 3).long().expand(4, 5) * mask)
    # the prompt's last position predicts each response's first token (7 and 10); 7 predicts 8
    assert inputs.selected.tolist() == [1, 2, 8, 1] and inputs.selected_tokens.tolist() == [7, 8, 9, 10]
    out = forward.unpack(torch.tensor([1.0, 2.0, 3.0, 4.0]), inputs)
    assert out.tolist() == [[0, 0, 0, 1, 2], [0, 0, 0, 3, 0], [0, 0, 0, 4, 0], [0] * 5]


def test_prefix_mask_sees_the_prompt_and_the_response_causally_within_the_window() -> None:
    from meshrl.parallel.shared_prefix import prefix_mask

    assert prefix_mask(2, 3, None, "cpu").int().tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    # window 1 (megatron's window_size[0]): a query sees itself and the key before it
    assert prefix_mask(2, 2, 1, "cpu").int().tolist() == [[0, 1, 1, 0], [0, 0, 1, 1]]


def test_select_hidden_reads_megatrons_sequence_first_layout() -> None:
    hidden = torch.arange(2 * 3 * 4, dtype=torch.float).view(3, 2, 4)  # [n=3, r=2, h=4]
    picked = forward.select_hidden(hidden, torch.tensor([4, 1]))  # flat [r, n]: (row 1, pos 1), (row 0, pos 1)
    assert picked.shape == (2, 1, 4)
    assert torch.equal(picked[:, 0], torch.stack([hidden[1, 1], hidden[1, 0]]))


def test_unpack_zeroes_padding_even_when_values_are_not_finite() -> None:
    ids, mask = torch.tensor([[1, 2, 0]]), torch.tensor([[1, 1, 0]])
    for inputs in (forward.trim_rows(ids, mask), forward.pack_thd(ids, mask, pad_multiple=2)):
        values = torch.tensor([[float("-inf"), 3.0]])
        assert forward.unpack(values, inputs).tolist() == [[0.0, float("-inf"), 0.0]]


def test_packed_sdpa_attention_is_causal_within_each_slot_only() -> None:
    """THD input (``[t, heads, d]``, slots of cu_seqlens_q_padded; an empty one too) against explicit causal
    softmax attention on each sequence alone."""
    from types import SimpleNamespace

    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType

    config = model_builder.transformer_config(model_builder.model_spec(tiny_config(LLAMA)), ParallelConfig(),
                                              torch.float32)
    tp = SimpleNamespace(size=lambda: 1, rank=lambda: 0)
    attention = layers.sdpa_core_attention_class()(
        config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self",
        pg_collection=SimpleNamespace(tp=tp))
    lengths, slots = [5, 1, 0, 8], [6, 2, 0, 8]
    heads, groups, dim = config.num_attention_heads, config.num_query_groups, config.kv_channels
    g = torch.Generator().manual_seed(0)
    q = torch.randn(sum(slots), heads, dim, generator=g)
    k, v = (torch.randn(sum(slots), groups, dim, generator=g) for _ in range(2))
    cu = torch.tensor([0, *torch.tensor(slots).cumsum(0).tolist()], dtype=torch.int32)
    cu_real = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_real, cu_seqlens_kv=cu_real, cu_seqlens_q_padded=cu,
                             cu_seqlens_kv_padded=cu, max_seqlen_q=8, max_seqlen_kv=8)
    out = attention(q, k, v, None, packed_seq_params=params)
    assert out.shape == (sum(slots), heads * dim)
    for start, length in zip(cu[:-1].tolist(), lengths):
        part = slice(start, start + length)
        keys, values = (t[part].repeat_interleave(heads // groups, dim=1) for t in (k, v))
        scores = torch.einsum("shd,thd->hst", q[part], keys) / dim**0.5
        scores = scores.masked_fill(torch.ones(length, length, dtype=torch.bool).triu(1), float("-inf"))
        expected = torch.einsum("hst,thd->shd", scores.softmax(-1), values).reshape(length, heads * dim)
        assert torch.allclose(out[part], expected, atol=1e-6, rtol=0)


@pytest.mark.parametrize("m,pp,expected", [(4, 2, 2), (3, 2, 3), (5, 2, 3), (6, 4, 6), (8, 4, 4), (9, 4, 5)])
def test_interleaved_group_size(m: int, pp: int, expected: int) -> None:
    assert schedule._interleaving_group_size(m, pp) == expected


def test_interleaved_needs_pp_micro_batches() -> None:
    with pytest.raises(ValueError, match="at least PP=4 micro-batches"):
        schedule._interleaving_group_size(3, 4)


def test_cpu_layer_spec_is_megatrons_local_spec_with_sdpa_attention() -> None:
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    spec = model_builder._layer_spec(False, model_builder.model_spec(tiny_config(LLAMA)))
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


def test_packed_sequences_as_requested_except_cuda_without_transformer_engine(monkeypatch):
    from meshrl.parallel import model_builder

    monkeypatch.setattr(model_builder.torch.cuda, "is_available", lambda: False)
    assert model_builder.packed_sequences(True) and not model_builder.packed_sequences(False)
    monkeypatch.setattr(model_builder.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(model_builder, "transformer_engine_available", lambda: False)
    with pytest.warns(UserWarning, match="Transformer Engine"):
        assert not model_builder.packed_sequences(True)
    monkeypatch.setattr(model_builder, "transformer_engine_available", lambda: True)
    assert model_builder.packed_sequences(True)
