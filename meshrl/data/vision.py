"""Images in prompts (verl's multi-modal layout) and the vision-language model's processor.

Rows carry their images under ``data.image_key`` (``images``: a list of ``{"bytes": ..., "path": ...}`` dicts as
``datasets`` writes PIL images to parquet, PIL images, or file paths) and mark where each goes with ``<image>`` in
a message's text, in order; ``prompt_messages`` turns such a prompt into chat messages whose content is a list of
``{"type": "image"}`` / ``{"type": "text"}`` items (verl's ``RLHFDataset._build_messages``), checking that the
row has one image per ``<image>``.

The processor is transformers' own class for the model (``PROCESSORS``), built from the model folder's image
processor and the tokenizer: ``AutoProcessor`` would also build the video processor, which needs torchvision,
and no torchvision build for the pinned CPU torch is on the registry (the one there is CUDA-linked and breaks
``import transformers``: ``operator torchvision::nms does not exist``). So the image processor is transformers'
PIL implementation (the same fields of ``preprocessor_config.json``, the same resizing and normalisation) and
videos are refused. The processor renders the chat template, expands each image's pad token to one per merged
patch, and gives ``pixel_values`` and ``image_grid_thw`` (verl's ``multi_modal_inputs``).
"""

from __future__ import annotations

import io
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

# model_type -> transformers' processor class of the family
PROCESSORS = {"qwen2_vl": "Qwen2VLProcessor", "qwen2_5_vl": "Qwen2_5_VLProcessor", "qwen3_vl": "Qwen3VLProcessor"}
IMAGE_PLACEHOLDER, VIDEO_PLACEHOLDER = "<image>", "<video>"


class ImageDataError(ValueError):
    """A row's images do not match its ``<image>`` placeholders, or one does not load (the message says which)."""


def load_processor(model_dir: str | Path, tokenizer: Any, model_type: str) -> Any:
    """transformers' processor of ``model_type`` (one of ``PROCESSORS``) over the folder's image processor and
    ``tokenizer``, without a video processor (module docstring)."""
    import transformers
    from transformers import Qwen2VLImageProcessorPil

    if model_type not in PROCESSORS:
        raise ValueError(f"{model_type} has no image processor in meshrl; images are read for "
                         f"{', '.join(PROCESSORS)}")
    base = getattr(transformers, PROCESSORS[model_type])

    class ImageOnly(base):  # the processor's own logic; its check of the (absent) video processor skipped
        def check_argument_for_proper_class(self, argument_name, argument):
            if argument_name == "video_processor" and argument is None:
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    image_processor = Qwen2VLImageProcessorPil.from_pretrained(model_dir)
    return ImageOnly(image_processor=image_processor, tokenizer=tokenizer, video_processor=None,
                     chat_template=tokenizer.chat_template)


def load_image(image: Any) -> Any:
    """An RGB PIL image from a row's entry: a PIL image, a ``{"bytes": ...}`` / ``{"path": ...}`` dict (parquet's
    form of ``datasets`` images), or a path."""
    from PIL import Image

    if isinstance(image, Image.Image):
        return image.convert("RGB")
    if isinstance(image, Mapping):
        if image.get("bytes") is not None:
            return Image.open(io.BytesIO(image["bytes"])).convert("RGB")
        if image.get("path"):
            return Image.open(image["path"]).convert("RGB")
        raise ImageDataError(f"an image entry has neither bytes nor a path: keys {sorted(image)}")
    if isinstance(image, (str, os.PathLike)):
        return Image.open(image).convert("RGB")
    raise ImageDataError(f"an image must be a PIL image, a {{'bytes'|'path': ...}} dict or a path, got "
                         f"{type(image).__name__}")


def prompt_messages(messages: Sequence[Mapping[str, Any]], images: Sequence[Any]) -> tuple[list[dict], list[Any]]:
    """(chat messages with typed content, the loaded images in their order) of a prompt whose texts mark each of
    ``images`` with ``<image>`` (verl's layout); a prompt without images is returned as it is."""
    if not images:
        return [dict(m) for m in messages], []
    loaded, built = [load_image(image) for image in images], []
    used = 0
    for message in messages:
        content = message["content"]
        if not isinstance(content, str):
            raise ImageDataError(f"a {message['role']} message's content is {type(content).__name__}; the text "
                                 "with <image> placeholders is expected")
        items = []
        for segment in re.split(f"({re.escape(IMAGE_PLACEHOLDER)}|{re.escape(VIDEO_PLACEHOLDER)})", content):
            if segment == VIDEO_PLACEHOLDER:
                raise ImageDataError("<video>: videos need torchvision's video processor, which the CPU build of "
                                     "torch here has none of (meshrl.data.vision)")
            if segment == IMAGE_PLACEHOLDER:
                if used == len(loaded):
                    raise ImageDataError(f"{used + 1} <image> placeholders, but the row has {len(loaded)} image(s)")
                items.append({"type": "image", "image": loaded[used]})
                used += 1
            elif segment:
                items.append({"type": "text", "text": segment})
        built.append({**message, "content": items})
    if used != len(loaded):
        raise ImageDataError(f"the row has {len(loaded)} image(s) but its prompt marks {used} with <image>")
    return built, loaded


def encode_prompt(processor: Any, messages: list[dict], images: list[Any],
                  chat_template_kwargs: Mapping[str, Any] | None = None) -> tuple[list[int], dict[str, Any]]:
    """(prompt token ids with each image's pads expanded, ``{"pixel_values", "image_grid_thw"}`` or {}) of a prompt
    from ``prompt_messages``, as verl's dataset and agent loop render it: the chat template with the generation
    prompt, then the processor on the text and the images."""
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                         **dict(chat_template_kwargs or {}))
    if not images:
        return processor.tokenizer(text, add_special_tokens=False)["input_ids"], {}
    inputs = processor(text=[text], images=images, return_tensors="pt")
    return inputs["input_ids"][0].tolist(), {"pixel_values": inputs["pixel_values"],
                                            "image_grid_thw": inputs["image_grid_thw"]}


def image_inputs(processor: Any, images: Sequence[Any]) -> dict[str, Any]:
    """``{"pixel_values", "image_grid_thw"}`` of a row's ``images`` (as stored), from the processor's image
    processor: what ``encode_prompt`` gave with the prompt's ids."""
    inputs = processor.image_processor(images=[load_image(image) for image in images], return_tensors="pt")
    return {"pixel_values": inputs["pixel_values"], "image_grid_thw": inputs["image_grid_thw"]}
