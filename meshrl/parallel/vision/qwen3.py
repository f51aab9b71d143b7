"""Qwen3-VL's vision tower (ViT + patch merger + deepstack mergers), meshrl's own torch implementation of
transformers' ``Qwen3VLVisionModel`` (notation and shared math in ``common``).

Forward, ``N`` patches in the processor's merge-block-major order, ``m = spatial_merge_size``:

1. ``x = patch_embed(pixel_values) + pos``: linear over the flattened ``C*T*P*P`` patch, with a bias; ``pos`` is
   the learned ``S x S`` position table (``pos_embed``, ``S = sqrt(num_position_embeddings)``, row-major) resampled
   bilinearly, corners aligned, to the frame's ``h x w`` patch grid, as transformers does
   (``fast_pos_embed_interpolate``, now ``vision_utils.get_vision_interpolation_indices_and_weights`` with
   ``align_corners=True``): the patch at row ``r`` sits at ``y = r * (S-1) / max(h-1, 1)`` on the table (columns
   alike, ``x``), and ``pos = sum over the 4 taps (y0|y0+1, x0|x0+1) of (1-|y-ty|)(1-|x-tx|) * table[ty*S + tx]``
   (``y0 = floor(y)``, taps clamped to the table, their weights from the unclamped tap), summed in fp32 (the
   weights are fp32) and cast to the activations' dtype. Every frame of a video gets the same ``pos``.
2. ``depth`` blocks, pre-norm: ``x = x + attn(layernorm1(x))``, ``x = x + mlp(layernorm2(x))``: LayerNorms with
   bias, eps 1e-6; ``attn``: qkv (+ bias), 2-D rotary over the patch's (row, column), attention within its frame
   only, proj (+ bias); ``mlp(x) = linear_fc2(act(linear_fc1(x)))`` with ``act`` the config's ``hidden_act``
   (``gelu_pytorch_tanh``, the tanh GELU, in the released configs).
3. Deepstack: after block ``deepstack_visual_indexes[j]``, ``deepstack_merger_list[j]`` merges the hidden states:
   ``fc2(gelu(fc1(layernorm(x.reshape(-1, m*m * hidden)))))`` (the norm *after* concatenating the ``m*m``
   patches, over ``m*m * hidden``).
4. Merger: ``fc2(gelu(fc1(layernorm(x).reshape(-1, m*m * hidden))))`` (the norm per patch, over ``hidden``).
   The mergers' GELU is the exact erf one whatever ``hidden_act``.

There is no window reordering: ``embeds`` rows are in the processor's order, the image pad tokens' order.
``deepstack`` holds the features in block order (transformers appends them as the blocks run; the language model
adds feature ``i`` after its decoder layer ``i``); ``deepstack_visual_indexes`` must be distinct block indexes.

Checkpoint names (``common.VisionTower``): ``model.visual.`` + the parameter name (the checkpoint's own layout:
``patch_embed.proj``, ``pos_embed``, ``blocks.{i}.{norm1,norm2,attn.qkv,attn.proj,mlp.linear_fc1,mlp.linear_fc2}``,
``merger.{norm,linear_fc1,linear_fc2}``, ``deepstack_merger_list.{j}.{norm,linear_fc1,linear_fc2}``), as released
Qwen3-VL checkpoints and transformers 5 name them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from meshrl.parallel.vision.common import (
    PatchEmbed, VisionBlock, VisionOutput, VisionTower, activation, frame_bounds, grid_list,
    merge_block_positions, rotary_cos_sin)


class Qwen3VisionMLP(nn.Module):
    """``linear_fc2(act(linear_fc1(x)))``, both with biases."""

    def __init__(self, hidden: int, intermediate: int, act: str) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(hidden, intermediate, bias=True)
        self.linear_fc2 = nn.Linear(intermediate, hidden, bias=True)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


def qwen3_vision_block(config: Any) -> VisionBlock:
    """The pre-norm block with LayerNorms and the two-layer MLP."""
    return VisionBlock(config, lambda width: nn.LayerNorm(width, eps=1e-6),
                       Qwen3VisionMLP(config.hidden_size, config.intermediate_size, config.hidden_act))


class Qwen3PatchMerger(nn.Module):
    """``linear_fc2(gelu(linear_fc1(z)))`` over the ``m*m`` consecutive patches of a merged token concatenated:
    ``z = layernorm(x).reshape(-1, m*m*hidden)`` (the final merger) or ``layernorm(x.reshape(-1, m*m*hidden))``
    (``post_shuffle_norm``: the deepstack mergers)."""

    def __init__(self, hidden: int, out_hidden: int, merge: int, post_shuffle_norm: bool) -> None:
        super().__init__()
        self.merged_dim = hidden * merge * merge
        self.post_shuffle_norm = post_shuffle_norm
        self.norm = nn.LayerNorm(self.merged_dim if post_shuffle_norm else hidden, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.merged_dim, self.merged_dim)
        self.act = nn.GELU()
        self.linear_fc2 = nn.Linear(self.merged_dim, out_hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.post_shuffle_norm:
            z = self.norm(x.reshape(-1, self.merged_dim))
        else:
            z = self.norm(x).reshape(-1, self.merged_dim)
        return self.linear_fc2(self.act(self.linear_fc1(z)))


def _axis_taps(size: int, side: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(``[size, 2]`` table rows / columns ``floor(y), floor(y)+1`` clamped to the table, their ``[size, 2]`` fp32
    weights ``1 - frac, frac``) of the ``size`` patch rows (or columns) on a ``side``-long table axis, corners
    aligned (step 1 of the module docstring)."""
    y = torch.arange(size, device=device, dtype=torch.float32) * (side - 1) / max(size - 1, 1)
    low = torch.floor(y)
    frac = y - low
    taps = (low.long()[:, None] + torch.arange(2, device=device)).clamp(0, side - 1)
    return taps, torch.stack([1 - frac, frac], dim=-1)


def interpolation_taps(grid_thw: Sequence[Sequence[int]], side: int, merge: int,
                       device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(``[N, 4]`` rows of the flattened position table, ``[N, 4]`` fp32 bilinear weights) of every patch in the
    processor's merge-block-major order, taps ordered (y0 x0, y0 x1, y1 x0, y1 x1) like transformers' sum."""
    indices, weights = [], []
    for t, h, w in grid_thw:
        row_taps, row_weights = _axis_taps(h, side, device)
        col_taps, col_weights = _axis_taps(w, side, device)
        index = (row_taps[:, None, :, None] * side + col_taps[None, :, None, :]).reshape(h, w, 4)
        weight = (row_weights[:, None, :, None] * col_weights[None, :, None, :]).reshape(h, w, 4)
        block = (h // merge, merge, w // merge, merge, 4)
        indices.append(index.reshape(block).transpose(1, 2).reshape(-1, 4).repeat(t, 1))
        weights.append(weight.reshape(block).transpose(1, 2).reshape(-1, 4).repeat(t, 1))
    return torch.cat(indices), torch.cat(weights)


class Qwen3VisionTower(VisionTower):
    """Qwen3-VL's vision tower from its ``vision_config`` (module docstring)."""

    def __init__(self, config: Any, hf_prefix: str = "model.visual.") -> None:
        super().__init__(config, hf_prefix, "Qwen3-VL")
        self.side = int(config.num_position_embeddings ** 0.5)
        if self.side * self.side != config.num_position_embeddings:
            raise ValueError(f"num_position_embeddings {config.num_position_embeddings} is not a square grid")
        self.deepstack_visual_indexes = tuple(config.deepstack_visual_indexes)
        if len(set(self.deepstack_visual_indexes)) != len(self.deepstack_visual_indexes) or not all(
                0 <= i < config.depth for i in self.deepstack_visual_indexes):
            raise ValueError(f"deepstack_visual_indexes {list(self.deepstack_visual_indexes)} must be distinct "
                             f"block indexes below depth {config.depth}")
        self.patch_embed = PatchEmbed(config.in_channels, config.temporal_patch_size, config.patch_size,
                                      config.hidden_size, bias=True)
        self.pos_embed = nn.Embedding(config.num_position_embeddings, config.hidden_size)
        self.blocks = nn.ModuleList(qwen3_vision_block(config) for _ in range(config.depth))
        self.merger = Qwen3PatchMerger(config.hidden_size, config.out_hidden_size, self.merge, False)
        self.deepstack_merger_list = nn.ModuleList(
            Qwen3PatchMerger(config.hidden_size, config.out_hidden_size, self.merge, True)
            for _ in self.deepstack_visual_indexes)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> VisionOutput:
        """``VisionOutput(embeds [n_merged, out_hidden_size], deepstack)`` of the ``[N, C*T*P*P]`` patches of the
        images of ``grid_thw``."""
        grid = grid_list(grid_thw)
        device = pixel_values.device
        x = self.embed_patches(pixel_values, grid)
        positions = merge_block_positions(grid, self.merge, device)  # also checks the grids against the merge
        index, weight = interpolation_taps(grid, self.side, self.merge, device)
        x = x + (self.pos_embed(index) * weight[..., None]).sum(1).to(x.dtype)
        rope = rotary_cos_sin(positions, self.head_dim, self.rope_theta)
        bounds = frame_bounds(grid)
        merger_of = {block: j for j, block in enumerate(self.deepstack_visual_indexes)}
        deepstack = []
        for number, block in enumerate(self.blocks):
            x = block(x, rope, bounds)
            if number in merger_of:
                deepstack.append(self.deepstack_merger_list[merger_of[number]](x))
        return VisionOutput(embeds=self.merger(x), deepstack=tuple(deepstack))
