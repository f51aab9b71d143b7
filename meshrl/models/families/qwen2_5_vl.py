"""Qwen2.5-VL (``Qwen2_5_VLForConditionalGeneration``): Qwen2's language model with multimodal RoPE, and a vision
tower (window-attention ViT and patch merger, ``meshrl.parallel.vision.qwen2_5``) whose features replace the
embeddings of the image pad tokens.

The language model's fields are the HF config's ``text_config`` (``families.model_spec`` reads them there);
``rope_parameters.mrope_section`` (the released configs' ``rope_scaling: {type: mrope}``, which transformers reads
as default RoPE with sections) gives ``ModelSpec.mrope_section``. The released checkpoints (and transformers 5's
``save_pretrained``) name the language model's tensors as Qwen2's (``model.layers.*``, ``model.embed_tokens``,
``lm_head``), so Qwen2's tensor table applies as it is; the vision tower's are ``visual.*``.
"""

from meshrl.models.families import Family, Refusal


def mrope_sections(text_config, model_type: str) -> tuple[int, ...]:
    """``rope_parameters.mrope_section`` of a Qwen-VL text config: three widths (temporal, height, width), else
    ``ValueError`` naming ``model_type``."""
    sections = (getattr(text_config, "rope_parameters", None) or {}).get("mrope_section")
    if not sections or len(sections) != 3:
        raise ValueError(f"{model_type} config: rope_parameters.mrope_section={sections!r}, expected three sections "
                         "(temporal, height, width) as the released configs give")
    return tuple(sections)


def _mrope_fields(text_config) -> dict:
    return dict(mrope_section=mrope_sections(text_config, "qwen2_5_vl"), vision=True)


FAMILY = Family(
    model_type="qwen2_5_vl",
    hf_prefix="Qwen2_5_VL",
    policy_name="Qwen2_5_VLForConditionalGeneration",
    vision_language=True,
    qkv_bias=True,
    refusals=(
        Refusal("use_sliding_window", lambda v, c: not v,
                "sliding-window attention is not implemented in meshrl yet; set it to false"),
    ),
    derives_head_dim=True,
    spec_fields=_mrope_fields,
)
