"""actor_rollout_ref.model.override_config (meshrl.models.hf_config): verl's overrides of the policy's Hugging Face
config, in both of verl's spellings, refused for a field the config lacks, attn_implementation FSDP-only; the
driver's config of the model has them (what preflight checks). The whole path (trainer, engine, export) runs in
tests/e2e/test_verl_scripts.py's DAPO script."""

from __future__ import annotations

import pytest

from meshrl.config import ConfigError, load_config
from meshrl.config.validate import validate_config
from meshrl.models.hf_config import apply_overrides, load_model_config, model_overrides
from meshrl.models.resolve import resolve_model_path
from meshrl.trainer.main import model_config


@pytest.fixture(scope="module")
def tiny():
    return resolve_model_path("tiny:llama")


def test_overrides_set_fields_merge_dict_fields_and_refuse_unknown_ones(tiny):
    base = load_model_config(tiny)
    config = load_model_config(tiny, {"max_position_embeddings": 32768, "initializer_range": 0.5})
    assert (config.max_position_embeddings, config.initializer_range) == (32768, 0.5)
    assert config.max_position_embeddings != base.max_position_embeddings
    # verl's Megatron spelling, and attn_implementation left to verl's FSDP models
    assert model_overrides({"model_config": {"initializer_range": 1.0}}) == {"initializer_range": 1.0}
    assert model_overrides({"attn_implementation": "eager", "initializer_range": 1.0}) == {"initializer_range": 1.0}
    with pytest.raises(ValueError, match=r"override_config.max_position_embedings: the model's config \(llama\) "
                                         "has no field"):
        apply_overrides(base, {"max_position_embedings": 1})
    # a dict-valued field takes the given entries and keeps the others
    merged = apply_overrides(load_model_config(tiny), {"rope_parameters": {"rope_theta": 5e5}})
    assert merged.rope_parameters == {**base.rope_parameters, "rope_theta": 5e5}


def test_the_driver_reads_the_overridden_config_and_names_a_wrong_key():
    cfg = load_config(["+actor_rollout_ref.model.override_config.max_position_embeddings=32768"],
                      recipe="cpu_tiny_grpo")
    validate_config(cfg)
    assert model_config(cfg).max_position_embeddings == 32768
    bad = load_config(["+actor_rollout_ref.model.override_config.hidden_sise=8"], recipe="cpu_tiny_grpo")
    with pytest.raises(ConfigError, match="actor_rollout_ref.model.override_config.hidden_sise"):
        model_config(bad)


def test_the_critics_overrides_stay_refused_and_attn_implementation_is_named_fsdp_only():
    with pytest.raises(ConfigError, match="HF config overrides of the critic are not built"):
        validate_config(load_config(["+critic.model.override_config.initializer_range=1.0"], recipe="cpu_tiny_grpo"))
    warnings = validate_config(load_config(["+actor_rollout_ref.model.override_config.attn_implementation=eager"],
                                           recipe="cpu_tiny_grpo")).warnings
    assert any("actor_rollout_ref.model.override_config.attn_implementation=eager" in w for w in warnings)
