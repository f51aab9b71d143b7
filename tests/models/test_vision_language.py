"""Qwen2.5-VL's family (issue 40): its spec read from the text config, its conversion table (language model and
vision tower) against transformers' checkpoint, the image features scattered at the pad tokens, and what is refused.
Parity with transformers on image prompts at TP1 / TP2 (with sequence parallelism) / PP2 runs in the multi-process
launches (``tests/parallel/vl_checks.py``)."""

from __future__ import annotations

import pytest
import torch

from meshrl.config import load_config
from meshrl.config.refusals import Checked
from meshrl.models.families import family, model_spec, text_model_types, transformer_options
from meshrl.models.tiny_vision import tiny_vl_model_dir
from meshrl.parallel import state
from meshrl.parallel.model_builder import layout_problems
from meshrl.parallel.vision_language import scatter_image_features, vision_language_runs


@pytest.fixture(scope="module")
def config():
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(tiny_vl_model_dir("qwen2_5_vl"))


def test_the_spec_is_the_text_configs_with_mrope_sections(config):
    spec = model_spec(config)
    text = config.text_config
    assert spec.vision and spec.mrope_section == tuple(text.rope_parameters["mrope_section"])
    assert (spec.num_layers, spec.hidden_size, spec.num_kv_heads) == (text.num_hidden_layers, text.hidden_size,
                                                                      text.num_key_value_heads)
    assert spec.qkv_bias and transformer_options(spec)["mrope_section"] == list(spec.mrope_section)
    assert "qwen2_5_vl" not in text_model_types() and family("qwen2_5_vl").policy_class == \
        "Qwen2_5_VLForConditionalGeneration"
    # the released configs' rope_scaling {type: mrope} is read as sections
    released = type(config)(text_config=dict(rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]},
                                             hidden_size=3584, num_attention_heads=28, num_key_value_heads=4))
    assert model_spec(released).mrope_section == (16, 24, 24)
    with pytest.raises(ValueError, match="sections must cover half of head_dim"):
        model_spec(type(config)(text_config=dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                                  "mrope_section": [8, 8, 8]},
                                                  hidden_size=128, num_attention_heads=4)))


def test_the_conversion_table_is_exactly_the_checkpoints_tensors(config):
    """Every tensor transformers writes for the model (language model and vision tower, released names), with its
    shape, once; the tower's held whole by the first stage."""
    from transformers import Qwen2_5_VLForConditionalGeneration
    from transformers.core_model_loading import revert_weight_conversion

    from meshrl.parallel.hf_conversion import model_layout

    with torch.device("meta"):
        model = Qwen2_5_VLForConditionalGeneration(config)
    expected = {name: tuple(t.shape) for name, t in revert_weight_conversion(model, model.state_dict()).items()
                if not (name == "lm_head.weight" and config.tie_word_embeddings)}
    pieces = model_layout(config, model_spec(config))
    assert {p.hf_name: p.shape for p in pieces} == expected and len(pieces) == len(expected)
    tower = [p for p in pieces if p.hf_name.startswith("visual.")]
    assert tower and all(p.stage == "embed" and p.tp_dim is None and p.mcore.startswith("vision_tower.")
                         for p in tower)


def test_image_features_replace_the_pad_embeddings_in_order_and_by_shard():
    pad = 9
    ids = torch.tensor([[1, pad, pad, 2, 0, 0], [pad, 3, 4, pad, pad, 5]])  # [b, s]
    embeddings = torch.zeros(6, 2, 4)  # megatron's [s, b, h]
    features = torch.arange(5, dtype=torch.float32)[:, None].expand(5, 4) + 1  # feature k is all k + 1
    out = scatter_image_features(embeddings, ids, features, pad)
    got = out[..., 0].t()  # back to [b, s]
    assert got.tolist() == [[0, 1, 2, 0, 0, 0], [3, 0, 0, 4, 5, 0]]  # row by row, as transformers' masked_scatter
    assert out.is_contiguous()
    halves = [scatter_image_features(embeddings[3 * r:3 * r + 3], ids, features, pad, sequence_shard=(r, 2))
              for r in range(2)]
    assert torch.equal(torch.cat(halves), out)  # each sequence-parallel shard takes its own rows
    with pytest.raises(ValueError, match="has 5 image pad tokens but its images give 4 features"):
        scatter_image_features(embeddings, ids, features[:4], pad)


def test_context_parallelism_and_a_training_run_are_refused(config):
    spec = model_spec(config)
    problems = layout_problems(spec, state.ParallelConfig(context_parallel=2))
    assert [key for key, _ in problems] == ["context_parallel_size"] and "vision-language" in problems[0][1]
    cfg = load_config([f"actor_rollout_ref.model.path={tiny_vl_model_dir('qwen2_5_vl')}"], recipe="cpu_tiny_grpo")
    (problem,) = vision_language_runs(Checked(cfg, hf_config=config))
    assert problem.startswith("actor_rollout_ref.model.path: qwen2_5_vl is a vision-language model")
    from transformers import AutoConfig

    from meshrl.models.embedded import smollm2_hf_dir

    assert vision_language_runs(Checked(cfg, hf_config=AutoConfig.from_pretrained(smollm2_hf_dir()))) == []
