"""M-RoPE position ids of Qwen2-VL-family prompts and responses: a (temporal, height, width) triple per token.

The vision-language models' language model (megatron-core, ``position_embedding_type="mrope"``) rotates each
token by three positions, one per axis; this file computes them for one unpadded sequence from its token ids and
its images' patch grids (``image_grid_thw`` from the image processor), and extends them over generated tokens.

The rule (transformers 5.19's ``get_rope_index`` of Qwen2-VL, Qwen2.5-VL, Qwen3-VL and Qwen3-VL-MoE, identical for
images; meshrl's own code, checked against it in ``tests/data/test_mrope_positions.py``), with ``s`` the position
the next token would take (0 at the start):

* a text token gets ``(s, s, s)``, then ``s <- s + 1``;
* image ``k`` is the run of ``T * h * w`` image pads right after a vision-start token, with
  ``(T, H, W) = image_grid_thw[k]``, ``h = H / m``, ``w = W / m`` (``m = spatial_merge_size``: the vision tower merges
  ``m x m`` patches into one token); the pad at ``(tau * h + eta) * w + omega`` (row-major over the merged grid) gets
  ``(s + tau, s + eta, s + omega)``, then ``s <- s + max(T, h, w)``, i.e. one past the largest position so far.

Images are consumed in the order of ``image_grid_thw``; ``T`` is 1 for an image (the processor repeats it over the
temporal patch), so after an image text resumes at ``s + max(h, w)``, as transformers does.

Qwen3-VL differs from Qwen2.5-VL only for videos (Qwen2.5-VL spaces frames by ``tokens_per_second *
second_per_grid_ts``; Qwen3-VL splits a video into one-frame grids separated by timestamp text) and in how the
rotary frequencies are assigned to the three axes (interleaved sections), which is the model's business, not the
positions'. meshrl refuses videos (``meshrl.data.vision``), so one rule serves both and a video pad is an error.

Generated tokens are text: token ``j`` (from 0) after a sequence of positions ``P`` gets ``max(P) + 1 + j`` on every
axis (``continue_positions``). transformers' ``rope_deltas`` is that offset: ``max(P) + 1 - len(P)``, added to the
token's plain index during decoding.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

# the families whose get_rope_index in transformers 5.19 gives images the rule above (read; the tests run the
# tiny qwen2_5_vl and qwen3_vl)
MROPE_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")
# the key of a prompt's ``multi_modal_inputs`` entry (``meshrl.data.dataset.RLDataset.multi_modal_inputs``) holding
# its 3-D positions, ``[3, prompt length]``: computed with the prompt, continued over the response by the workers
PROMPT_POSITIONS = "prompt_mrope_positions"


def _text(start: int, length: int, device: torch.device) -> torch.Tensor:
    return (torch.arange(length, device=device) + start).expand(3, length)


def mrope_positions(input_ids: torch.Tensor, image_grid_thw: torch.Tensor | None, *, image_token_id: int,
                    vision_start_token_id: int, spatial_merge_size: int,
                    video_token_id: int | None = None) -> torch.Tensor:
    """The ``[3, L]`` (temporal, height, width) positions of the unpadded sequence ``input_ids`` (``[L]``: a prompt,
    or a prompt and its response) whose images have the patch grids ``image_grid_thw`` (``[n_images, 3]``, in order;
    None or empty without images), by the rule of the module docstring. ``ValueError`` when the pads do not match the
    grids (a prompt cut inside an image, a grid from another prompt), when an image does not follow a vision-start
    token, or when a pad of ``video_token_id`` appears (videos are refused)."""
    ids = torch.as_tensor(input_ids)
    if ids.dim() != 1:
        raise ValueError(f"mrope_positions takes one unpadded sequence of shape [L], got {tuple(ids.shape)}")
    if video_token_id is not None and bool((ids == video_token_id).any()):
        raise ValueError(f"the sequence holds video pads (video_token_id {video_token_id}); meshrl refuses videos")
    grids = torch.zeros(0, 3, dtype=torch.long) if image_grid_thw is None else torch.as_tensor(image_grid_thw)
    if grids.dim() != 2 or grids.shape[1] != 3:
        raise ValueError(f"image_grid_thw must be [n_images, 3], got {tuple(grids.shape)}")
    device, length = ids.device, ids.shape[0]
    pads = (ids == image_token_id).nonzero().flatten().tolist()
    expected = [int(t) * (int(h) // spatial_merge_size) * (int(w) // spatial_merge_size) for t, h, w in grids.tolist()]
    if len(pads) != sum(expected):
        raise ValueError(f"{len(pads)} image pads (image_token_id {image_token_id}) but image_grid_thw "
                         f"{grids.tolist()} with spatial_merge_size {spatial_merge_size} needs {sum(expected)}")
    pieces, start, cursor, used = [], 0, 0, 0
    for k, (t, h, w) in enumerate(grids.tolist()):
        if min(t, h, w) <= 0 or h % spatial_merge_size or w % spatial_merge_size:
            raise ValueError(f"image {k}'s grid {[t, h, w]} is empty or not divisible by spatial_merge_size "
                             f"{spatial_merge_size}")
        first = pads[used]  # the image's pads begin at the first pad not yet consumed
        if first == 0 or int(ids[first - 1]) != vision_start_token_id:
            raise ValueError(f"image {k}'s pads at index {first} do not follow a vision-start token "
                             f"({vision_start_token_id})")
        count = expected[k]
        if pads[used + count - 1] != first + count - 1:  # the pads of one image are contiguous
            raise ValueError(f"image {k} needs {count} consecutive image pads from index {first}; the run is shorter")
        pieces.append(_text(start, first - cursor, device))
        start += first - cursor
        gh, gw = h // spatial_merge_size, w // spatial_merge_size
        grid = torch.stack(torch.meshgrid(torch.arange(t, device=device), torch.arange(gh, device=device),
                                          torch.arange(gw, device=device), indexing="ij"))
        pieces.append(grid.reshape(3, -1) + start)
        start += max(t, gh, gw)  # one past the image's largest position
        cursor, used = first + count, used + count
    pieces.append(_text(start, length - cursor, device))
    return torch.cat(pieces, dim=1).long()


def positions_for_config(hf_config: Any) -> functools.partial:
    """``mrope_positions`` with the token ids and merge size of an HF ``Qwen2_5_VLConfig`` / ``Qwen3VLConfig`` (or
    Qwen2-VL's, Qwen3-VL-MoE's) bound: ``positions_for_config(config)(input_ids, image_grid_thw)``. transformers 5.19
    keeps ``image_token_id``, ``video_token_id`` and ``vision_start_token_id`` on the top-level config and
    ``spatial_merge_size`` on ``vision_config``."""
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in MROPE_MODEL_TYPES:
        raise ValueError(f"M-RoPE positions are meshrl's for {', '.join(MROPE_MODEL_TYPES)}; the config is "
                         f"{model_type!r}")
    fields = {}
    for name in ("image_token_id", "vision_start_token_id", "video_token_id"):
        fields[name] = getattr(hf_config, name, None)
        if fields[name] is None:
            raise ValueError(f"the {model_type} config has no {name}")
    merge = getattr(getattr(hf_config, "vision_config", None), "spatial_merge_size", None)
    if merge is None:
        raise ValueError(f"the {model_type} config has no vision_config.spatial_merge_size")
    return functools.partial(mrope_positions, spatial_merge_size=int(merge),
                             **{name: int(value) for name, value in fields.items()})


def continue_positions(positions: torch.Tensor, extra: int) -> torch.Tensor:
    """``positions`` (``[3, L]``) followed by those of ``extra`` generated text tokens: ``max(positions) + 1``,
    ``+ 2``, ... on all three axes (the largest position over all axes: after an image the height / width axes are
    ahead of the temporal one), as transformers' decoding with ``rope_deltas`` gives them."""
    if positions.dim() != 2 or positions.shape[0] != 3:
        raise ValueError(f"positions must be [3, L], got {tuple(positions.shape)}")
    if extra < 0:
        raise ValueError(f"extra must be >= 0, got {extra}")
    start = int(positions.max()) + 1 if positions.numel() else 0
    new = _text(start, extra, positions.device).to(positions.dtype)
    return torch.cat([positions, new], dim=1)
