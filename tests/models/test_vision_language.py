"""The vision-language families (issue 40), Qwen2.5-VL and Qwen3-VL: their specs read from the text config, their
conversion tables (language model and vision tower) against transformers' checkpoints, the image features scattered
at the pad tokens (and Qwen3-VL's deepstack features added there), Qwen3-VL's interleaved M-RoPE against
transformers', and what is refused.
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


def test_context_parallelism_and_what_a_run_does_not_do_yet_are_refused(config):
    from transformers import AutoConfig

    from meshrl.config.validate import validate_config
    from meshrl.models.embedded import smollm2_hf_dir

    spec = model_spec(config)
    problems = layout_problems(spec, state.ParallelConfig(context_parallel=2))
    assert [key for key, _ in problems] == ["context_parallel_size"] and "vision-language" in problems[0][1]

    def refused(*overrides):
        cfg = load_config([f"actor_rollout_ref.model.path={tiny_vl_model_dir('qwen2_5_vl')}", *overrides],
                          recipe="cpu_tiny_grpo")
        return [line.split(":")[0] for line in vision_language_runs(Checked(cfg, validate_config(cfg), config))]

    assert refused("actor_rollout_ref.rollout.name=hf") == []
    assert refused("actor_rollout_ref.rollout.name=vllm") == ["actor_rollout_ref.rollout.name"]
    assert refused("actor_rollout_ref.rollout.name=hf", "actor_rollout_ref.model.lora_rank=8",
                   "algorithm.adv_estimator=gae") == ["critic.enable"]  # LoRA runs (test_lora_vision_language.py)
    # multi-turn (tests/rollout/test_agent_images.py) and the one-step-off / fully async trainers run; V1's modes not
    assert refused("actor_rollout_ref.rollout.name=hf", "actor_rollout_ref.rollout.multi_turn.enable=True") == []
    assert refused("actor_rollout_ref.rollout.name=hf", "trainer.async_mode=one_step_off") == []
    assert refused("actor_rollout_ref.rollout.name=vllm", "trainer.use_v1=True", "trainer.v1.trainer_mode="
                   "colocate_async") == ["actor_rollout_ref.rollout.name", "trainer.v1.trainer_mode=colocate_async"]
    cfg = load_config([], recipe="cpu_tiny_grpo")  # a text model: nothing of it
    assert vision_language_runs(Checked(cfg, validate_config(cfg), AutoConfig.from_pretrained(smollm2_hf_dir()))) == []


# Qwen3-VL: Qwen3's language model under transformers 5's names, interleaved M-RoPE, deepstack features.

@pytest.fixture(scope="module")
def qwen3_config():
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(tiny_vl_model_dir("qwen3_vl"))


def test_qwen3_vl_spec_is_qwen3s_text_model_with_interleaved_mrope_and_deepstack(qwen3_config, config):
    spec, text = model_spec(qwen3_config), qwen3_config.text_config
    assert spec.vision and spec.mrope_interleaved and spec.mrope_section == tuple(text.rope_parameters["mrope_section"])
    assert spec.deepstack_layers == len(qwen3_config.vision_config.deepstack_visual_indexes) == 1
    assert spec.lm_prefix == "model.language_model." and spec.qk_norm and not spec.qkv_bias
    assert (spec.num_attention_heads, spec.num_kv_heads, spec.head_dim) == (4, 2, 64)  # splits at TP2
    assert spec.tie_word_embeddings == qwen3_config.tie_word_embeddings
    assert "qwen3_vl" not in text_model_types() and family("qwen3_vl").policy_class == \
        "Qwen3VLForConditionalGeneration"
    # transformers ties by the top-level field, which a released text_config may not repeat
    vision = qwen3_config.vision_config.to_dict()
    untied = type(qwen3_config)(text_config={**text.to_dict(), "tie_word_embeddings": True}, vision_config=vision,
                                tie_word_embeddings=False)
    assert not model_spec(untied).tie_word_embeddings
    assert model_spec(config).lm_prefix == "model." and not model_spec(config).deepstack_layers  # Qwen2.5-VL's
    with pytest.raises(ValueError, match="Qwen3-VL with q/k/v/o biases"):
        model_spec(type(qwen3_config)(text_config={**text.to_dict(), "attention_bias": True}, vision_config=vision))


def test_qwen3_vl_conversion_table_is_exactly_the_checkpoints_tensors(qwen3_config):
    from transformers import Qwen3VLForConditionalGeneration
    from transformers.core_model_loading import revert_weight_conversion

    from meshrl.parallel.hf_conversion import HFCheckpointReader, model_layout

    with torch.device("meta"):
        model = Qwen3VLForConditionalGeneration(qwen3_config)
    expected = {name: tuple(t.shape) for name, t in revert_weight_conversion(model, model.state_dict()).items()
                if not (name == "lm_head.weight" and qwen3_config.tie_word_embeddings)}
    pieces = model_layout(qwen3_config, model_spec(qwen3_config))
    assert {p.hf_name: p.shape for p in pieces} == expected and len(pieces) == len(expected)
    reader = HFCheckpointReader(tiny_vl_model_dir("qwen3_vl"))  # and what save_pretrained wrote
    assert all(p.hf_name in reader and reader.shape(p.hf_name) == p.shape for p in pieces)
    tower = [p for p in pieces if p.hf_name.startswith("model.visual.")]
    assert any(".deepstack_merger_list.0." in p.hf_name for p in tower)
    assert tower and all(p.stage == "embed" and p.tp_dim is None and p.mcore.startswith("vision_tower.")
                         for p in tower)
    assert all(p.hf_name.startswith(("model.language_model.", "model.visual.", "lm_head.")) for p in pieces)


def test_interleaved_mrope_matches_transformers():
    """The axis rule against transformers' own recomposition (sections whose interleaving runs past the frequencies
    too), and meshrl's rotary module's angles against ``Qwen3VLTextRotaryEmbedding``'s cos / sin."""
    from transformers import Qwen3VLTextConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding

    from meshrl.parallel import cpu_compat
    from meshrl.parallel.layers import interleaved_mrope_axes, interleaved_mrope_class

    for sections, frequencies in (([24, 20, 20], 64), ([16, 8, 8], 32), ([4, 10, 2], 16)):
        hf = Qwen3VLTextRotaryEmbedding.__new__(Qwen3VLTextRotaryEmbedding)
        hf.mrope_section = sections
        axis_of = hf.recomposition_frequencies(torch.arange(3.0)[:, None].repeat(1, frequencies))
        assert torch.equal(axis_of[:frequencies].long(), interleaved_mrope_axes(sections, frequencies))
    assert interleaved_mrope_axes([24, 20, 20], 64)[:6].tolist() == [0, 1, 2, 0, 1, 2]
    cpu_compat.apply()  # megatron's rotary module allocates on torch.cuda.current_device()
    text = Qwen3VLTextConfig(head_dim=64, hidden_size=128, num_attention_heads=4,
                             rope_parameters={"rope_type": "default", "rope_theta": 5e5, "mrope_section": [16, 8, 8]})
    positions = torch.randint(0, 300, (3, 2, 11))
    cos, sin = Qwen3VLTextRotaryEmbedding(text)(torch.zeros(1, dtype=torch.float32), positions)  # [b, s, D]
    rotary = interleaved_mrope_class()(kv_channels=64, rotary_percent=1.0, rotary_base=5e5)
    emb = rotary(positions, [16, 8, 8]).cpu()
    assert emb.shape == (11, 2, 1, 64)
    angles = emb[:, :, 0].transpose(0, 1)
    assert torch.equal(angles.cos(), cos) and torch.equal(angles.sin(), sin)


def test_deepstack_features_add_at_the_pad_tokens_in_order_and_by_shard():
    from meshrl.parallel.vision_language import add_image_features

    pad = 9
    ids = torch.tensor([[1, pad, pad, 2, 0, 0], [pad, 3, 4, pad, pad, 5]])  # [b, s]
    hidden = torch.full((6, 2, 4), 0.5)  # megatron's [s, b, h]
    features = torch.arange(5, dtype=torch.float32)[:, None].expand(5, 4) + 1
    out = add_image_features(hidden, ids, features, pad)
    assert out[..., 0].t().tolist() == [[0.5, 1.5, 2.5, 0.5, 0.5, 0.5], [3.5, 0.5, 0.5, 4.5, 5.5, 0.5]]
    halves = [add_image_features(hidden[3 * r:3 * r + 3], ids, features, pad, sequence_shard=(r, 2)) for r in range(2)]
    assert torch.equal(torch.cat(halves), out) and out.is_contiguous()
    with pytest.raises(ValueError, match="has 5 image pad tokens but its images give 4 features"):
        add_image_features(hidden, ids, features[:4], pad)


def test_deepstack_layers_must_be_on_the_first_chunk_and_recomputed_by_the_uniform_method(qwen3_config):
    import dataclasses

    from meshrl.parallel.model_builder import transformer_config

    spec = model_spec(qwen3_config)  # 2 layers, deepstack after layer 0
    assert layout_problems(spec, state.ParallelConfig(pipeline_parallel=2)) == []
    assert layout_problems(spec, state.ParallelConfig(tensor_parallel=2)) == []
    deeper = dataclasses.replace(spec, num_layers=8, deepstack_layers=3)  # the released ones: 3 of 28 / 36 layers
    assert layout_problems(deeper, state.ParallelConfig(pipeline_parallel=2)) == []  # layers 0-3 on the first stage
    for parallel in (state.ParallelConfig(pipeline_parallel=4), state.ParallelConfig(pipeline_parallel=2,
                                                                                     virtual_pipeline=2)):
        problems = layout_problems(deeper, parallel)  # two layers in the tower's chunk
        assert [key for key, _ in problems] == ["pipeline_model_parallel_size"], problems
        assert "deepstack features are added after layers 0..2" in problems[0][1]
    with pytest.raises(ValueError, match="deepstack features need a vision tower"):
        dataclasses.replace(spec, vision=False)
    with pytest.raises(ValueError, match="recompute_method=block with Qwen3-VL's deepstack"):
        transformer_config(spec, state.ParallelConfig(), torch.float32, recompute_granularity="full",
                           recompute_method="block", recompute_num_layers=1)
    transformer_config(spec, state.ParallelConfig(), torch.float32, recompute_granularity="full",
                       recompute_method="uniform", recompute_num_layers=1)


def test_full_recompute_with_deepstack_is_refused_but_by_the_uniform_method(qwen3_config, config):
    """enable_gradient_checkpointing (megatron's uniform method) recomputes the deepstack layers with their features
    as checkpoint arguments (vision_language.recompute_deepstack_layers; exact to transformers in the multi-process
    launches); another method is refused."""
    from meshrl.config.run_plan import build_run_plan
    from meshrl.workers.model_setup import deepstack_runs_without_full_recompute

    def problems(hf_config, *overrides):
        cfg = load_config([f"actor_rollout_ref.model.path={tiny_vl_model_dir('qwen3_vl')}", *overrides],
                          recipe="cpu_tiny_grpo")
        return deepstack_runs_without_full_recompute(Checked(cfg, build_run_plan(cfg), hf_config))

    assert problems(qwen3_config) == []
    assert problems(qwen3_config, "actor_rollout_ref.model.enable_gradient_checkpointing=True") == []
    override = "+actor_rollout_ref.actor.megatron.override_transformer_config"
    block = [f"{override}.recompute_granularity=full", f"{override}.recompute_method=block",
             f"{override}.recompute_num_layers=1"]
    (line,) = problems(qwen3_config, *block)
    assert line.startswith("actor_rollout_ref.actor.megatron.override_transformer_config: recompute_method=block")
    assert problems(config, *block) == []  # no deepstack
