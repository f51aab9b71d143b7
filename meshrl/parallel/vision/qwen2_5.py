"""Qwen2.5-VL's vision tower (ViT with window attention + patch merger), meshrl's own torch implementation of
transformers' ``Qwen2_5_VisionTransformerPretrainedModel`` (notation and shared math in ``common``).

Forward, ``N`` patches in the processor's merge-block-major order, ``m = spatial_merge_size``, ``U = m*m``:

1. ``x = patch_embed(pixel_values)``: linear over the flattened ``C*T*P*P`` patch, no bias.
2. Window reordering. The merged tokens (groups of ``U`` consecutive patches) of each frame, on its
   ``(h/m) x (w/m)`` grid, are cut into windows of ``k x k`` merged tokens, ``k = window_size // m // patch_size``
   (windows in row order, the last row / column of windows smaller when ``k`` does not divide the grid);
   ``order`` lists the merged tokens window by window, row order inside a window, frame after frame, image after
   image. Patches are permuted by it in whole groups of ``U`` (``x = x[order * U + j]``, ``j < U``), and so are
   their rotary positions: the sequence is then window-contiguous, every frame still contiguous.
3. ``depth`` blocks, pre-norm: ``x = x + attn(rmsnorm1(x))``, ``x = x + mlp(rmsnorm2(x))``;
   ``attn``: qkv (+ bias), 2-D rotary over the patch's (row, column), attention within its frame for the blocks
   of ``fullatt_block_indexes`` and within its window for the others, proj (+ bias);
   ``mlp(x) = down(act(gate(x)) * up(x))`` (SwiGLU for ``hidden_act = silu``), all three with biases.
   RMSNorms have eps 1e-6.
4. Merger: ``y = fc2(gelu(fc1(rmsnorm(x).reshape(-1, U * hidden))))`` (exact erf GELU, whatever ``hidden_act``):
   one row per merged token, still in window order.
5. Inverse reordering: ``embeds[order[i]] = y[i]`` (transformers' ``y[argsort(order)]``), so the rows come back in
   the processor's order, which is the order of the image pad tokens.

Checkpoint names (``common.VisionTower``): ``visual.`` + the parameter name (the checkpoint's own layout:
``patch_embed.proj``, ``blocks.{i}.{norm1,norm2,attn.qkv,attn.proj,mlp.gate_proj,mlp.up_proj,mlp.down_proj}``,
``merger.ln_q``, ``merger.mlp.0`` / ``merger.mlp.2``). Released Qwen2.5-VL checkpoints, and those transformers 5
writes, use ``visual.*`` (transformers' module itself is ``model.visual``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from meshrl.parallel.vision.common import (
    PatchEmbed, RMSNorm, VisionBlock, VisionOutput, VisionTower, activation, frame_bounds, grid_list,
    merge_block_positions, rotary_cos_sin)


class Qwen2_5VisionMLP(nn.Module):
    """``down_proj(act(gate_proj(x)) * up_proj(x))``, each projection with a bias."""

    def __init__(self, hidden: int, intermediate: int, act: str) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=True)
        self.up_proj = nn.Linear(hidden, intermediate, bias=True)
        self.down_proj = nn.Linear(intermediate, hidden, bias=True)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


def qwen2_5_vision_block(config: Any) -> VisionBlock:
    """The pre-norm block with RMSNorms and the SwiGLU MLP."""
    return VisionBlock(config, lambda width: RMSNorm(width, eps=1e-6),
                       Qwen2_5VisionMLP(config.hidden_size, config.intermediate_size, config.hidden_act))


class Qwen2_5PatchMerger(nn.Module):
    """``mlp(ln_q(x).reshape(-1, m*m * hidden))``, ``mlp = Linear(m*m*hidden, m*m*hidden), GELU, Linear(.., out)``:
    the ``m*m`` consecutive patches of a merged token concatenated after the RMSNorm."""

    def __init__(self, hidden: int, out_hidden: int, merge: int) -> None:
        super().__init__()
        self.merged_dim = hidden * merge * merge
        self.ln_q = RMSNorm(hidden, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(self.merged_dim, self.merged_dim), nn.GELU(),
                                 nn.Linear(self.merged_dim, out_hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).reshape(-1, self.merged_dim))


def window_order(grid_thw: Sequence[Sequence[int]], merge: int, window_units: int,
                 device=None) -> tuple[torch.Tensor, list[int]]:
    """(``order``: ``[n_merged]`` merged-token indices window by window (step 2 of the module docstring),
    cumulative patch counts of the windows in that order: the window ``cu_seqlens`` of the reordered sequence)."""
    parts, bounds, offset = [], [0], 0
    for t, h, w in grid_thw:
        rows, cols = h // merge, w // merge
        per_row = -(-cols // window_units)  # windows per row of windows
        window = ((torch.arange(rows, device=device) // window_units)[:, None] * per_row
                  + (torch.arange(cols, device=device) // window_units)[None, :]).flatten()
        # a stable sort by window keeps the row order of the tokens inside each window
        in_frame = torch.argsort(window, stable=True)
        sizes = torch.bincount(window).tolist()  # every window is non-empty: none is padding
        for frame in range(t):
            parts.append(in_frame + offset + frame * rows * cols)
            for size in sizes:
                bounds.append(bounds[-1] + size * merge * merge)
        offset += t * rows * cols
    return torch.cat(parts), bounds


class Qwen2_5VisionTower(VisionTower):
    """Qwen2.5-VL's vision tower from its ``vision_config`` (module docstring)."""

    def __init__(self, config: Any, hf_prefix: str = "visual.") -> None:
        super().__init__(config, hf_prefix, "Qwen2.5-VL")
        self.window_units = config.window_size // config.spatial_merge_size // config.patch_size
        if self.window_units < 1:
            raise ValueError(f"window_size {config.window_size} is smaller than one merged patch "
                             f"({config.spatial_merge_size} x {config.patch_size} pixels)")
        self.fullatt_block_indexes = frozenset(config.fullatt_block_indexes)
        self.patch_embed = PatchEmbed(config.in_channels, config.temporal_patch_size, config.patch_size,
                                      config.hidden_size, bias=False)
        self.blocks = nn.ModuleList(qwen2_5_vision_block(config) for _ in range(config.depth))
        self.merger = Qwen2_5PatchMerger(config.hidden_size, config.out_hidden_size, config.spatial_merge_size)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> VisionOutput:
        """``VisionOutput(embeds [n_merged, out_hidden_size], deepstack=())`` of the ``[N, C*T*P*P]`` patches of
        the images of ``grid_thw``."""
        grid = grid_list(grid_thw)
        device = pixel_values.device
        x = self.embed_patches(pixel_values, grid)
        unit = self.merge * self.merge
        order, window_bounds = window_order(grid, self.merge, self.window_units, device)
        patch_order = (order[:, None] * unit + torch.arange(unit, device=device)).flatten()
        x = x[patch_order]
        rope = rotary_cos_sin(merge_block_positions(grid, self.merge, device)[patch_order], self.head_dim,
                              self.rope_theta)
        # windows never straddle frames and frames keep their order, so the frame bounds hold after the reordering
        full_bounds = frame_bounds(grid)
        for index, block in enumerate(self.blocks):
            x = block(x, rope, full_bounds if index in self.fullatt_block_indexes else window_bounds)
        merged = self.merger(x)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=device)
        return VisionOutput(embeds=merged[inverse])

