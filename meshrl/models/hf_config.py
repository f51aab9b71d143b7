"""``actor_rollout_ref.model.override_config``: verl's overrides of the policy's Hugging Face config (DAPO's scripts set
``max_position_embeddings``), applied wherever meshrl reads that config, so every copy of the model is the same one:
the trainer's and the reference's Megatron models, the vLLM engine (its ``hf_overrides``), the HF export, and the
driver's checks and plan.

verl's two spellings are both read: the overrides themselves, or under ``model_config`` (its Megatron form). As verl's
``update_model_config``: a mapping value updates a sub-config (a dict-valued field is merged), any other value is set.
Unlike verl, a field the model's config does not have is refused (verl would set it, and the model would ignore it).
``attn_implementation`` picks verl's FSDP attention kernels: the Megatron model has its own, so it is dropped here and
named in the start-up warning (``meshrl.config.key_policy``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from omegaconf import OmegaConf

KEY = "actor_rollout_ref.model.override_config"
FSDP_ONLY = ("attn_implementation",)


def model_overrides(override_config: Any) -> dict[str, Any]:
    """The overrides to apply: ``override_config`` (or its ``model_config``) as plain values, less ``FSDP_ONLY``."""
    values = OmegaConf.to_container(override_config) if OmegaConf.is_config(override_config) else \
        dict(override_config or {})
    values = values.get("model_config", values)
    return {key: value for key, value in values.items() if key not in FSDP_ONLY}


def apply_overrides(config: Any, overrides: Mapping[str, Any], prefix: str = KEY) -> Any:
    """``config`` with ``overrides`` set on it (in place; returned). Raises ``ValueError`` naming the key of a field
    ``config`` does not have."""
    for key, value in overrides.items():
        if not hasattr(config, key):
            raise ValueError(f"{prefix}.{key}: the model's config "
                             f"({getattr(config, 'model_type', type(config).__name__)}) "
                             f"has no field {key!r}; check its config.json for the name")
        current = getattr(config, key)
        if isinstance(value, Mapping) and isinstance(current, Mapping):
            setattr(config, key, {**current, **value})
        elif isinstance(value, Mapping):
            apply_overrides(current, value, f"{prefix}.{key}")
        else:
            setattr(config, key, value)
    return config


def load_model_config(model_dir: Any, override_config: Any = None, trust_remote_code: bool = False) -> Any:
    """The Hugging Face config of ``model_dir`` with ``override_config`` applied (``model_overrides``)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    return apply_overrides(config, model_overrides(override_config))
