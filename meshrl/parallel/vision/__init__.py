"""meshrl's vision towers of the vision-language models: the ViT and patch merger that turn an image's patches into
the embeddings the language model reads at the image pad tokens.

Plain torch modules (no transformers modeling classes, no megatron), replicated on every rank of the first
pipeline stage, not split over tensor parallelism. ``TOWERS`` maps a model's ``model_type`` to its tower class;
``build_vision_tower`` builds one from the HF config's ``vision_config``.

Contract of a tower (``common.VisionTower``):

- ``forward(pixel_values [N_patches, C*T*P*P], grid_thw [n_images, 3]) -> VisionOutput(embeds, deepstack)``, the
  inputs as the model's processor gives them (``meshrl.data.vision.image_inputs``), ``embeds`` in the order of the
  image pad tokens of the prompt(s).
- ``hf_names()``: parameter name -> checkpoint tensor name (the checkpoint's prefix + the parameter name).
- ``load_hf(read)``: every parameter from ``read(checkpoint name)``, shapes checked.

Modules: ``common`` (output record, name rule, shared math), ``qwen2_5`` (Qwen2.5-VL), ``qwen3`` (Qwen3-VL).
"""

from __future__ import annotations

from typing import Any

import torch

from meshrl.parallel.vision.common import VisionOutput, VisionTower
from meshrl.parallel.vision.qwen2_5 import Qwen2_5VisionTower
from meshrl.parallel.vision.qwen3 import Qwen3VisionTower

# model_type of the HF config -> its vision tower class
TOWERS: dict[str, type[VisionTower]] = {"qwen2_5_vl": Qwen2_5VisionTower, "qwen3_vl": Qwen3VisionTower}

__all__ = ["TOWERS", "VisionOutput", "VisionTower", "build_vision_tower", "tower_parameters"]


def build_vision_tower(hf_config: Any, dtype: torch.dtype = torch.float32,
                       device: torch.device | str | None = None) -> VisionTower:
    """The vision tower of ``hf_config`` (a ``Qwen2_5_VLConfig`` / ``Qwen3VLConfig``: its ``model_type`` picks the
    class of ``TOWERS``, its ``vision_config`` the shapes), its parameters in ``dtype`` on ``device`` (the CPU when
    None), freshly initialised: fill them with ``load_hf``. ``ValueError`` for a model type without a tower."""
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in TOWERS:
        raise ValueError(f"meshrl has no vision tower for model_type {model_type!r}; one of {', '.join(TOWERS)}")
    with torch.device(device if device is not None else "cpu"):
        tower = TOWERS[model_type](hf_config.vision_config)
    return tower.to(dtype=dtype)


def tower_parameters(hf_config: Any) -> int:
    """The parameters of ``hf_config``'s vision tower (built on the meta device: nothing allocated); what the first
    pipeline stage holds on every TP rank besides its language-model layers (``meshrl plan``)."""
    return sum(p.numel() for p in build_vision_tower(hf_config, device="meta").parameters())
