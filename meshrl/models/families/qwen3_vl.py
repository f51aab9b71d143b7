"""Qwen3-VL (``Qwen3VLForConditionalGeneration``, dense): Qwen3's language model (q/k RMSNorm, its own head_dim, no
QKV bias) with interleaved multimodal RoPE and deepstack, and a vision tower (ViT with a learned, resampled position
table, patch merger and deepstack mergers: ``meshrl.parallel.vision.qwen3``) whose features replace the embeddings
of the image pad tokens.

What differs from Qwen2.5-VL (``qwen2_5_vl``), as ``ModelSpec`` fields:

- ``mrope_interleaved``: the ``head_dim / 2`` rotary frequencies take their (temporal, height, width) axis
  interleaved (``T H W T H W ... T T``: transformers' ``apply_interleaved_mrope``), not in consecutive sections.
  transformers 5.19 always interleaves for this model type, whatever ``rope_parameters.mrope_interleaved`` says, so
  the spec does too (``meshrl.parallel.layers.interleaved_mrope_class`` computes it).
- ``deepstack_layers``: the tower's features after each block of ``vision_config.deepstack_visual_indexes`` are
  added to the hidden states at the image pad tokens after decoder layers 0, 1, ... (``families.model_spec`` counts
  them; ``meshrl.parallel.vision_language.images_in_embeddings`` adds them, on the first pipeline stage).
- ``lm_prefix``: transformers 5 (and the released checkpoints) name the language model's tensors
  ``model.language_model.{embed_tokens,layers.*,norm}``, the tower's ``model.visual.*``; the output layer is
  ``lm_head`` (absent when tied: the 2B / 4B models).

The language model's fields are the HF config's ``text_config``; tied embeddings are the top-level config's field,
which transformers ties by.
"""

from meshrl.models.families import Family, Refusal
from meshrl.models.families.qwen2_5_vl import mrope_sections


def _spec_fields(text_config) -> dict:
    return dict(mrope_section=mrope_sections(text_config, "qwen3_vl"), mrope_interleaved=True, vision=True,
                lm_prefix="model.language_model.")


FAMILY = Family(
    model_type="qwen3_vl",
    hf_prefix="Qwen3VL",
    policy_name="Qwen3VLForConditionalGeneration",
    vision_language=True,
    qk_norm=True,
    refusals=(
        # HF puts the bias on o_proj too, which megatron's add_qkv_bias does not cover
        Refusal("attention_bias", lambda v, c: not v, "Qwen3-VL with q/k/v/o biases is not implemented"),
    ),
    spec_fields=_spec_fields,
)
