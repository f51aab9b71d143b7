"""meshrl's M-RoPE positions (meshrl.data.mrope_positions) against transformers' own: ``get_rope_index`` of the tiny
Qwen2.5-VL and Qwen3-VL models on prompts from meshrl's processor (text only, images of several sizes, an image first,
a left-padded batch), and the positions the models' decoding feeds the language model for generated tokens."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from meshrl.data import vision
from meshrl.data.mrope_positions import continue_positions, positions_for_config
from meshrl.models.tiny_vision import tiny_vl_model_dir

MODEL_TYPES = ("qwen2_5_vl", "qwen3_vl")
# (height, width) of the images: not square, so the height and width axes end apart
SIZES = ((56, 84), (112, 56), (84, 84))


def _image(height: int, width: int, seed: int):
    from PIL import Image

    return Image.fromarray(np.random.default_rng(seed).integers(0, 255, (height, width, 3), dtype=np.uint8))


class Tiny:
    """The tiny model of a family, its processor and meshrl's positions bound to its config."""

    def __init__(self, model_type: str):
        from transformers import AutoModelForImageTextToText, AutoTokenizer

        folder = tiny_vl_model_dir(model_type)
        self.tokenizer = AutoTokenizer.from_pretrained(folder)
        self.processor = vision.load_processor(folder, self.tokenizer, model_type)
        self.model = AutoModelForImageTextToText.from_pretrained(folder).eval()
        self.config = self.model.config
        self.positions = positions_for_config(self.config)

    def prompt(self, text: str, images: list) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(ids [L], image_grid_thw or None) of a user message ``text`` with ``<image>`` marks, as meshrl renders it."""
        messages, loaded = vision.prompt_messages([{"role": "user", "content": text}], images)
        ids, inputs = vision.encode_prompt(self.processor, messages, loaded)
        return torch.tensor(ids), inputs.get("image_grid_thw")

    def reference(self, ids: torch.Tensor, grid: torch.Tensor | None,
                  attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """transformers' ``get_rope_index`` of a batch ``ids`` ([B, L]), with the processor's own modality ids."""
        types = torch.tensor(self.processor.create_mm_token_type_ids(ids))
        positions, _ = self.model.model.get_rope_index(ids, mm_token_type_ids=types, image_grid_thw=grid,
                                                       attention_mask=attention_mask)
        return positions


@pytest.fixture(scope="module", params=MODEL_TYPES)
def tiny(request) -> Tiny:
    return Tiny(request.param)


def _check_image_layout(tiny: Tiny, ids: torch.Tensor, grid: torch.Tensor, positions: torch.Tensor) -> None:
    """What the comparison could hide if both sides were wrong the same way: each image's pads hold its merged
    grid (height and width axes spanning h and w values), and text after an image is one past everything before."""
    merge = tiny.config.vision_config.spatial_merge_size
    pads = (ids == tiny.config.image_token_id).nonzero().flatten()
    used = 0
    for t, h, w in grid.tolist():
        block = positions[:, pads[used: used + t * h * w // merge ** 2]]
        assert block[1].max() - block[1].min() == h // merge - 1 and block[2].max() - block[2].min() == w // merge - 1
        after = int(pads[used + t * h * w // merge ** 2 - 1]) + 1
        assert (positions[:, after] == positions[:, :after].max() + 1).all()
        used += t * h * w // merge ** 2


@pytest.mark.parametrize("case", ["text only", "one image", "two images with text between", "prompt and response"])
def test_positions_match_transformers_get_rope_index(tiny, case):
    images = {"text only": [], "one image": [_image(*SIZES[0], 0)],
              "two images with text between": [_image(*SIZES[0], 0), _image(*SIZES[1], 1)],
              "prompt and response": [_image(*SIZES[1], 1)]}[case]
    text = {"two images with text between": "<image>Is this the same as<image>?"}.get(case, "<image>" * len(images)
                                                                                        + "What is 2 + 3?")
    ids, grid = tiny.prompt(text, images)
    if case == "prompt and response":
        response = torch.tensor(tiny.tokenizer("The answer is 5.<|im_end|>", add_special_tokens=False)["input_ids"])
        prompt_positions = tiny.positions(ids, grid)
        ids = torch.cat([ids, response])
    assert int((ids == tiny.config.image_token_id).sum()) > 0 or not images
    ours = tiny.positions(ids, grid)
    assert ours.shape == (3, len(ids)) and ours.dtype == torch.long
    assert torch.equal(ours, tiny.reference(ids[None], grid)[:, 0])
    if images:
        assert len(grid) == len(images)
        _check_image_layout(tiny, ids, grid, ours)
    else:
        assert torch.equal(ours, torch.arange(len(ids)).expand(3, -1))
    if case == "prompt and response":  # a response's positions are the prompt's continued
        assert torch.equal(continue_positions(prompt_positions, len(response)), ours)


def test_an_image_at_the_very_start(tiny):
    """The processor on a text that opens with an image (no chat template): its pads start at index 1."""
    inputs = tiny.processor(text=["<|vision_start|><|image_pad|><|vision_end|>Describe it."],
                            images=[_image(*SIZES[1], 2)], return_tensors="pt")
    ids, grid = inputs["input_ids"][0], inputs["image_grid_thw"]
    assert int(ids[0]) == tiny.config.vision_start_token_id and int(ids[1]) == tiny.config.image_token_id
    ours = tiny.positions(ids, grid)
    assert torch.equal(ours, tiny.reference(ids[None], grid)[:, 0])
    assert (ours[:, 1] == 1).all()  # the image's first pad: right after the one text token
    _check_image_layout(tiny, ids, grid, ours)


def _batch(tiny: Tiny):
    """A left-padded batch of three prompts (no image, one image, two images) from the processor, and each row's
    images' grids."""
    rows = [("What is 2 + 3?", []), ("<image>What is this?", [_image(*SIZES[0], 3)]),
            ("<image>and<image>: which is larger?", [_image(*SIZES[1], 4), _image(*SIZES[2], 5)])]
    texts, images = [], []
    for text, row_images in rows:
        messages, loaded = vision.prompt_messages([{"role": "user", "content": text}], row_images)
        texts.append(tiny.processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))
        images.extend(loaded)
    inputs = tiny.processor(text=texts, images=images, padding=True, padding_side="left", return_tensors="pt")
    grids = inputs["image_grid_thw"].split([len(row_images) for _, row_images in rows])
    assert (inputs["attention_mask"] == 0).any(dim=1).sum() == len(rows) - 1  # all but the longest row padded
    assert (inputs["attention_mask"][:, -1] == 1).all()  # left padding
    return inputs, grids


def test_left_padded_batch_matches_transformers_on_each_rows_tokens(tiny):
    inputs, grids = _batch(tiny)
    reference = tiny.reference(inputs["input_ids"], inputs["image_grid_thw"], inputs["attention_mask"])
    for row, (ids, mask) in enumerate(zip(inputs["input_ids"], inputs["attention_mask"].bool(), strict=True)):
        grid = grids[row] if len(grids[row]) else None
        assert torch.equal(tiny.positions(ids[mask], grid), reference[:, row, mask])


def test_generated_tokens_continue_as_transformers_generate_feeds_them(tiny):
    """transformers' ``generate`` (greedy, 3 new tokens) on the left-padded batch: the positions its language model
    is given (captured by a hook: the prompt's, then one per decoded token) are, on each row's tokens, meshrl's of
    the prompt continued by ``continue_positions``."""
    inputs, grids = _batch(tiny)
    new, seen = 3, []
    hook = tiny.model.model.language_model.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs["position_ids"].clone()), with_kwargs=True)
    try:
        with torch.no_grad():
            out = tiny.model.generate(**inputs, max_new_tokens=new, min_new_tokens=new, do_sample=False)
    finally:
        hook.remove()
    assert out.shape[1] == inputs["input_ids"].shape[1] + new and len(seen) == new  # the last token is not fed
    # generate passes [4, B, L]: the plain text positions, then the three M-RoPE axes
    fed = torch.cat([positions[-3:] for positions in seen], dim=-1)
    for row, mask in enumerate(inputs["attention_mask"].bool()):
        ids = inputs["input_ids"][row][mask]
        ours = continue_positions(tiny.positions(ids, grids[row] if len(grids[row]) else None), new - 1)
        keep = torch.cat([mask, torch.ones(new - 1, dtype=torch.bool)])
        assert torch.equal(ours, fed[:, row, keep])


def test_generated_tokens_continue_as_transformers_rope_deltas_give_them(tiny):
    """The model's own decoding path without given positions (``compute_3d_position_ids``: a token's index plus
    the cached ``rope_deltas``), step by step with the cache: the same positions as ``continue_positions``."""
    ids, grid = tiny.prompt("<image>Is it<image>?", [_image(*SIZES[0], 6), _image(*SIZES[1], 7)])
    types = torch.tensor(tiny.processor.create_mm_token_type_ids([ids.tolist()]))
    pixels = vision.image_inputs(tiny.processor, [_image(*SIZES[0], 6), _image(*SIZES[1], 7)])["pixel_values"]
    seen = []
    hook = tiny.model.model.language_model.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs["position_ids"].clone()), with_kwargs=True)
    try:
        with torch.no_grad():
            out = tiny.model(input_ids=ids[None], pixel_values=pixels, image_grid_thw=grid, mm_token_type_ids=types,
                             use_cache=True)
            cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
            for _ in range(3):
                out = tiny.model(input_ids=token, past_key_values=cache, use_cache=True)
                cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
    finally:
        hook.remove()
    fed = torch.cat([positions[-3:, 0] for positions in seen], dim=-1)
    ours = tiny.positions(ids, grid)
    assert ours.max() + 1 < len(ids)  # the images make positions lag the indices: rope_deltas is not 0
    assert torch.equal(continue_positions(ours, 3), fed)


def test_config_fields_and_refusals(tiny):
    config = tiny.config
    bound = positions_for_config(config)
    assert bound.keywords == {"image_token_id": config.image_token_id, "video_token_id": config.video_token_id,
                              "vision_start_token_id": config.vision_start_token_id,
                              "spatial_merge_size": config.vision_config.spatial_merge_size}
    assert tiny.tokenizer.convert_ids_to_tokens([config.image_token_id, config.vision_start_token_id]) == [
        "<|image_pad|>", "<|vision_start|>"]
    ids, grid = tiny.prompt("<image>What is this?", [_image(*SIZES[0], 8)])
    with pytest.raises(ValueError, match="video"):
        bound(torch.cat([ids, torch.tensor([config.vision_start_token_id, config.video_token_id])]), grid)
    pads = (ids == config.image_token_id).nonzero().flatten()
    with pytest.raises(ValueError, match="image pads"):  # a prompt cut inside its image
        bound(ids[: int(pads[-1])], grid)
    with pytest.raises(ValueError, match="image pads"):  # no grid for the image
        bound(ids, None)
    with pytest.raises(ValueError, match="vision-start"):  # the image's vision-start token cut off
        bound(ids[int(pads[0]):], grid)
    with pytest.raises(ValueError, match="qwen3_vl"):
        positions_for_config(type("Config", (), {"model_type": "llama"})())
    assert torch.equal(continue_positions(bound(ids, grid), 0), bound(ids, grid))
