"""Tiny random vision-language models (Qwen2.5-VL, Qwen3-VL), written from transformers' own config classes, for
tests of the multi-modal data path (and, as it is built, the model path: issue 40).

Each folder is what a released checkpoint holds: ``config.json`` (the text model's and the vision tower's shapes,
the image / video / vision-start token ids), the weights, a tokenizer and ``preprocessor_config.json`` (the image
processor's patch, merge and pixel bounds). The tokenizer is the embedded SmolLM2 one with Qwen's four vision
tokens added and Qwen's chat template (an image item renders as ``<|vision_start|><|image_pad|><|vision_end|>``,
which the processor expands to one pad per merged patch), so the vocabulary is real and the ids of the vision
tokens are the tokenizer's. Both have two KV heads, so that their language models split at TP2 (Qwen3-VL's, as
Qwen3's, 4 heads x 64 = 256 query width on a 128-wide residual stream). Pixel bounds are small (a 56 x 56 image is
4 merged patches) so tests run in milliseconds; the architectures' own fields (M-RoPE sections, window attention,
Qwen3-VL's deepstack layers: one, after decoder layer 0, so that PP2 keeps it on the first stage) are kept.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from meshrl.atomic_io import cached_dir
from meshrl.runtime import cache_dir

VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for item in message['content'] %}{% if item['type'] == 'image' %}"
    "{{ '<|vision_start|><|image_pad|><|vision_end|>' }}{% elif item['type'] == 'video' %}"
    "{{ '<|vision_start|><|video_pad|><|vision_end|>' }}{% elif item['type'] == 'text' %}{{ item['text'] }}"
    "{% endif %}{% endfor %}{% endif %}{{ '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# model_type -> (config class, model class, the text model's and the vision tower's shapes, the image processor's)
TINY_VL = {
    "qwen2_5_vl": ("Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration",
                   dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                                "mrope_section": [8, 4, 4]}),
                   dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=128,
                        patch_size=14, window_size=56, fullatt_block_indexes=[1]),
                   dict(patch_size=14)),
    "qwen3_vl": ("Qwen3VLConfig", "Qwen3VLForConditionalGeneration",
                 dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=64, rope_parameters={"rope_type": "default",
                                                                           "rope_theta": 10000.0,
                                                                           "mrope_section": [16, 8, 8]}),
                 dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=128,
                      patch_size=16, num_position_embeddings=64, deepstack_visual_indexes=[0]),
                 dict(patch_size=16)),
}
# Pixel bounds of the tiny processors: at most 16 merged patches an image.
MIN_PIXELS, MAX_PIXELS = 28 * 28, 28 * 28 * 16


def tiny_vl_model_dir(model_type: str, seed: int = 0) -> Path:
    """The cached HF folder of the tiny ``model_type`` (one of ``TINY_VL``), built on first use."""
    if model_type not in TINY_VL:
        raise ValueError(f"no tiny vision-language model {model_type!r}; one of {', '.join(TINY_VL)}")

    def build(tmp: Path) -> None:
        import torch
        import transformers
        from transformers import AutoTokenizer, Qwen2VLImageProcessorPil

        from meshrl.models.embedded import smollm2_hf_dir

        config_class, model_class, text, vision, image = TINY_VL[model_type]
        tokenizer = AutoTokenizer.from_pretrained(smollm2_hf_dir())
        tokenizer.add_special_tokens({"additional_special_tokens": list(VISION_TOKENS)})
        tokenizer.chat_template = CHAT_TEMPLATE
        start, end, image_pad, video_pad = tokenizer.convert_tokens_to_ids(list(VISION_TOKENS))
        vocab = -(-len(tokenizer) // 64) * 64  # a multiple of 64: every TP size the tests use divides it
        config = getattr(transformers, config_class)(
            text_config={**text, "vocab_size": vocab, "tie_word_embeddings": True,
                         "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id},
            vision_config=vision, image_token_id=image_pad, video_token_id=video_pad,
            vision_start_token_id=start, vision_end_token_id=end, tie_word_embeddings=True)
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            model = getattr(transformers, model_class)(config).to(torch.float32)
            with torch.no_grad():  # peaked distributions, as the text tiny models (meshrl.models.tiny)
                for name, param in model.named_parameters():
                    if param.dim() >= 2:
                        param.normal_(0.0, 0.08)
        model.config.eos_token_id = model.generation_config.eos_token_id = tokenizer.eos_token_id
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        Qwen2VLImageProcessorPil(**image, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS).save_pretrained(tmp)
        (tmp / "meshrl_tiny_spec.json").write_text(json.dumps({"model_type": model_type, "seed": seed}))

    # the shapes' digest in the name: a changed table builds a new folder instead of reading a stale one
    digest = hashlib.sha256(json.dumps(TINY_VL[model_type], sort_keys=True).encode()).hexdigest()[:10]
    return cached_dir(cache_dir() / "models" / f"tiny-{model_type}-s{seed}-{digest}", "model.safetensors", build)
