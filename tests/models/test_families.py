"""The model-family registry: each family's HF config reading and refusals, its conversion table against the
transformers model it names, its megatron-core options, its tiny model and its parameter count."""

from __future__ import annotations

import pytest
import torch

from meshrl.models import families
from meshrl.models.hf_classes import hf_class
from meshrl.models.families import FAMILY_MODULES, checkpoint_shapes, family, hf_layout, model_spec, text_model_types
from meshrl.models.tiny import TinySpec, tiny_config, tiny_spec
from meshrl.memory_plan import stage_parameters

MODEL_TYPES = text_model_types()  # the vision-language families: tests/models/test_vision_language.py


def test_every_registered_family_loads_with_its_transformers_classes() -> None:
    assert {"llama", "qwen2", "qwen3", "mistral", "gemma", "gemma2", "gemma3_text"} <= set(MODEL_TYPES)
    for model_type in MODEL_TYPES:
        fam = family(model_type)
        assert fam.model_type == model_type
        for name in (fam.config_class, fam.policy_class, fam.critic_class):
            assert hf_class(name).__name__ == name
        assert tiny_config(tiny_spec(model_type)).model_type == model_type


def hf_model(model_type: str, critic: bool):
    config = tiny_config(tiny_spec(model_type))
    fam = family(model_type)
    if critic:
        config.num_labels = 1
    with torch.device("meta"):
        return hf_class(fam.critic_class if critic else fam.policy_class)(config)


@pytest.mark.parametrize("critic", [False, True], ids=["policy", "critic"])
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_conversion_table_is_exactly_the_hf_models_tensors(model_type: str, critic: bool) -> None:
    """Names and shapes of the family's own transformers class as its checkpoints hold them (transformers
    fuses MoE experts in memory and writes them per expert; a tied lm_head is not a tensor of its own)."""
    from transformers.core_model_loading import revert_weight_conversion

    model = hf_model(model_type, critic)
    expected = {name: tuple(t.shape) for name, t in revert_weight_conversion(model, model.state_dict()).items()
                if not (name == "lm_head.weight" and model.config.tie_word_embeddings)}
    assert checkpoint_shapes(model_spec(model.config), critic) == expected


@pytest.mark.parametrize("critic", [False, True], ids=["policy", "critic"])
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_plan_counts_the_families_parameters(model_type: str, critic: bool) -> None:
    """``meshrl plan``'s total against transformers' own parameter count (tied weights once)."""
    model = hf_model(model_type, critic)
    assert stage_parameters(model_spec(model.config), critic=critic) == sum(p.numel() for p in model.parameters())


def test_qwen3_features_q_k_norms_and_its_own_head_dim() -> None:
    spec = model_spec(tiny_config(tiny_spec("qwen3")))
    assert spec.qk_norm and not spec.qkv_bias
    assert spec.num_attention_heads * spec.head_dim != spec.hidden_size  # head_dim read, not derived
    norms = [p for p in hf_layout(spec) if p.hf_name.endswith(("q_norm.weight", "k_norm.weight"))]
    assert len(norms) == 2 * spec.num_layers
    assert all(p.shape == (spec.head_dim,) and p.tp_dim is None for p in norms)  # replicated over TP
    assert families.transformer_options(spec)["qk_layernorm"] is True
    assert families.layer_spec_options(spec) == {"qk_layernorm": True}
    llama = model_spec(tiny_config(tiny_spec("llama")))
    assert families.transformer_options(llama)["qk_layernorm"] is False


def changed(model_type: str, **fields):
    config = tiny_config(tiny_spec(model_type))
    for key, value in fields.items():
        setattr(config, key, value)
    return config


@pytest.mark.parametrize("model_type,fields,message", [
    ("llama", dict(attention_bias=True), "attention_bias=True: Llama with q/k/v/o biases"),
    ("llama", dict(mlp_bias=True), "mlp_bias=True"),
    ("qwen2", dict(use_sliding_window=True), "use_sliding_window=True: sliding-window attention"),
    ("qwen3", dict(attention_bias=True), "attention_bias=True: Qwen3 with q/k/v/o biases"),
    ("qwen3", dict(use_sliding_window=True), "use_sliding_window=True"),
    ("mistral", dict(sliding_window=4096, max_position_embeddings=32768),
     "sliding_window=4096: meshrl does not implement sliding-window attention yet"),
    ("qwen3", dict(hidden_act="gelu"), "hidden_act='gelu': only SiLU"),
    ("mistral", dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}),
     "rope_type='yarn': only 'default' RoPE"),
    ("qwen3", dict(partial_rotary_factor=0.5), "partial_rotary_factor=0.5"),
    ("llama", dict(attention_dropout=0.1), "attention_dropout=0.1: meshrl trains without dropout"),
    ("gemma", dict(hidden_act="gelu"), "hidden_act='gelu': meshrl implements Gemma's GeGLU with gelu_pytorch_tanh"),
    ("gemma", dict(attention_bias=True), "attention_bias=True: Gemma with q/k/v/o biases"),
    ("gemma2", dict(hidden_activation="silu"), "hidden_activation='silu'"),
    ("gemma2", dict(use_bidirectional_attention=True), "use_bidirectional_attention=True: bidirectional"),
    ("gemma3_text", dict(layer_types=["chunked_attention", "full_attention"]),
     "layer_types=.*builds sliding_attention"),
    ("gemma3_text", dict(rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                                          "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
     "rope_parameters=.*'linear'.*only 'default' RoPE is implemented for each layer type"),
])
def test_unsupported_config_fields_are_refused_by_name(model_type: str, fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=f"{model_type} config not supported by meshrl: .*{message}"):
        model_spec(changed(model_type, **fields))


def test_every_refused_field_is_named_at_once() -> None:
    with pytest.raises(ValueError) as error:
        model_spec(changed("qwen3", attention_bias=True, use_sliding_window=True))
    assert "attention_bias" in str(error.value) and "use_sliding_window" in str(error.value)


def test_a_mistral_window_that_never_slides_is_full_attention() -> None:
    for window in (None, 2048, 4096):  # the tiny model has 2048 positions
        assert model_spec(changed("mistral", sliding_window=window)).model_type == "mistral"


def test_an_unregistered_family_names_the_supported_ones() -> None:
    config = tiny_config(tiny_spec("llama"))
    config.model_type = "deepseek_v2"
    with pytest.raises(ValueError, match="model_type 'deepseek_v2' is not supported; supported: llama, qwen2, qwen3, "
                                         "mistral, gemma, gemma2, gemma3_text, qwen2_moe, qwen3_moe, mixtral, phi3, "
                                         "glm4, deepseek_v3, qwen2_5_vl, qwen3_vl"):
        model_spec(config)


def test_tiny_models_resolve_for_every_family() -> None:
    from meshrl.models.resolve import TINY_MODELS

    assert TINY_MODELS == {f"tiny:{module}": t for t, module in FAMILY_MODULES.items()}
    assert TINY_MODELS["tiny:gemma3"] == "gemma3_text"
    # the shapes tests and recipes have always used for tiny:llama / tiny:qwen2 (their cache folders)
    assert tiny_spec("llama") == TinySpec()
    assert tiny_spec("qwen2") == TinySpec(arch="qwen2", hidden_size=256, tie_word_embeddings=False)
    assert tiny_spec("mistral", num_hidden_layers=4).num_hidden_layers == 4


def test_the_trainer_refuses_an_unsupported_model_before_any_worker(tmp_path, monkeypatch, capsys) -> None:
    """``python -m meshrl.trainer.main`` on a Mistral-7B-v0.1-like folder (a window of 4096 in 32k positions):
    one message naming the model path and the field, exit 2, Ray never started."""
    from meshrl.trainer.main import main
    from meshrl.workers import cluster

    def no_ray(cfg):
        raise AssertionError("Ray started")

    monkeypatch.setattr(cluster, "start_ray", no_ray)
    folder = tmp_path / "mistral-v0.1"
    changed("mistral", sliding_window=4096, max_position_embeddings=32768).save_pretrained(folder)
    code = main(["--config-name", "cpu_tiny_grpo", f"actor_rollout_ref.model.path={folder}",
                 f"trainer.default_local_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert err.startswith("meshrl: actor_rollout_ref.model.path: mistral config not supported by meshrl: "
                          "sliding_window=4096")


def test_gemma_features_are_read_from_each_generations_config() -> None:
    """Gemma 1: zero-centred norms, GeGLU, scaled embeddings only; Gemma 2 adds post norms, the pre-attention
    scalar, both soft-caps and the sliding layers of ``layer_types``; Gemma 3 adds q/k norms and the local
    RoPE base, read from the per-layer-type ``rope_parameters``."""
    gemma, gemma2, gemma3 = (model_spec(tiny_config(tiny_spec(t))) for t in ("gemma", "gemma2", "gemma3_text"))
    for spec in (gemma, gemma2, gemma3):
        assert spec.activation == "gelu_tanh" and spec.zero_centered_norms and spec.embedding_scale
    assert not gemma.post_norms and gemma.sliding_window is None and gemma.softmax_scale is None
    config = tiny_config(tiny_spec("gemma2"))
    assert gemma2.post_norms and gemma2.softmax_scale == config.query_pre_attn_scalar ** -0.5
    assert (gemma2.attn_logit_softcap, gemma2.final_logit_softcap) == (config.attn_logit_softcapping,
                                                                       config.final_logit_softcapping)
    assert gemma2.sliding_layers == tuple(i for i, t in enumerate(config.layer_types) if t == "sliding_attention")
    assert gemma2.sliding_layers == (0,) and gemma2.local_rope_theta is None and not gemma2.qk_norm
    config = tiny_config(tiny_spec("gemma3_text"))
    assert gemma3.qk_norm and gemma3.attn_logit_softcap is None
    assert gemma3.rope_theta == config.rope_parameters["full_attention"]["rope_theta"] == 1e6
    assert gemma3.local_rope_theta == config.rope_parameters["sliding_attention"]["rope_theta"] == 1e4
    options = families.transformer_options(gemma3)
    assert options["window_size"] == (config.sliding_window - 1, 0)
    assert options["window_attn_skip_freq"] == [1, 0]  # megatron's list: 1 = this layer is windowed
    assert options["layernorm_zero_centered_gamma"] and options["activation_func"] is families.gelu_tanh
    assert "window_size" not in families.transformer_options(gemma)


def test_a_spec_read_back_from_json_equals_the_original() -> None:
    """Checkpoints store the spec as JSON, where the sliding layers become a list."""
    import json

    spec = model_spec(tiny_config(tiny_spec("gemma3_text")))
    assert families.ModelSpec(**json.loads(json.dumps(spec.to_dict()))) == spec
