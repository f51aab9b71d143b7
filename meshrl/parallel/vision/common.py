"""Pieces shared by meshrl's vision towers (``qwen2_5``, ``qwen3``): the output record, the checkpoint-name rule and
loading, and the math both ViTs use.

Notation: a batch of images is ``grid_thw`` (``[n_images, 3]``: frames ``t``, patch rows ``h``, patch columns ``w``
per image) and ``N = sum(t * h * w)`` patches, ``m = spatial_merge_size``. The processor lays each frame's patches
out *merge-block major*: the ``m x m`` patches that the merger fuses into one token are consecutive, blocks in row
order (patch ``(r, c)`` of a frame is at ``((r // m) * (w // m) + c // m) * m*m + (r % m) * m + c % m``).

- Patch embedding: a patch is ``C*T*P*P`` values (channels, temporal patch, rows, columns, in that order); the
  checkpoint's ``Conv3d`` with stride = kernel = ``(T, P, P)`` over one patch is exactly the linear map
  ``x @ W.reshape(hidden, C*T*P*P).T (+ b)``, which is what runs (the weight keeps the Conv3d shape, so the
  checkpoint's tensor loads and exports as it is).
- 2-D rotary (both towers): head dim ``D``, ``F = D / 4`` frequencies ``inv_freq_i = theta**(-2i / (D/2))``; a
  patch at ``(h, w)`` (its row and column in its frame) gets angles ``a = [h * inv_freq, w * inv_freq]`` (``D/2``)
  repeated twice (``D``), and ``rope(x) = x * cos(a) + rotate_half(x) * sin(a)`` with ``rotate_half([x1, x2]) =
  [-x2, x1]`` over the whole head (the first half of the head dim is rotated with the second half). Angles and the
  rotation are computed in fp32 and cast back to the activations' dtype, as transformers does.
- Attention: ``softmax(q k^T / sqrt(D)) v`` per head inside each segment of ``cu_seqlens`` only (an image frame,
  or a Qwen2.5-VL window); ``segment_attention`` runs torch SDPA on the segments batched by length.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class VisionOutput:
    """What a tower gives the language model.

    Attributes:
        embeds: ``[n_merged_tokens, out_hidden_size]``, the merged tokens of all images in order (image by image,
            each frame's tokens in row order of its merged grid): the rows transformers scatters into the image pad
            positions of the prompt, in order.
        deepstack: Qwen3-VL's merged features of the hidden states after each block of ``deepstack_visual_indexes``
            (each ``[n_merged_tokens, out_hidden_size]``, in block order: feature ``i`` is added to the language
            model's hidden states after its decoder layer ``i``); empty for Qwen2.5-VL.
    """

    embeds: torch.Tensor
    deepstack: tuple[torch.Tensor, ...] = field(default_factory=tuple)


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


# config ``hidden_act`` -> function: the entries of transformers' ACT2FN these towers' configs use, the same ops
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh"),
    "quick_gelu": _quick_gelu,
}


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The function of a config's ``hidden_act``; ``ValueError`` for one meshrl does not implement."""
    if name not in ACTIVATIONS:
        raise ValueError(f"vision tower activation {name!r} is not implemented; one of {', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[name]


class RMSNorm(nn.Module):
    """``weight * (x / sqrt(mean(x**2) + eps))``, the normalisation in fp32 and cast back to ``x``'s dtype before
    the weight multiplies (transformers' Qwen2 RMSNorm: in bf16 the product is a bf16 * bf16 one)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


class PatchEmbed(nn.Module):
    """Patch embedding ``[N, C*T*P*P] -> [N, hidden]``: ``x @ W.reshape(hidden, -1).T (+ b)`` with ``W`` of the
    checkpoint's Conv3d shape ``[hidden, C, T, P, P]`` (module docstring). ``proj`` only holds the parameters (its
    name matches the checkpoint's ``patch_embed.proj.*``); its conv is never run."""

    def __init__(self, in_channels: int, temporal_patch_size: int, patch_size: int, hidden: int, bias: bool) -> None:
        super().__init__()
        kernel = (temporal_patch_size, patch_size, patch_size)
        self.proj = nn.Conv3d(in_channels, hidden, kernel_size=kernel, stride=kernel, bias=bias)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        weight = self.proj.weight
        flat = weight.reshape(weight.shape[0], -1)
        if pixel_values.dim() != 2 or pixel_values.shape[1] != flat.shape[1]:
            raise ValueError(f"pixel_values must be [n_patches, {flat.shape[1]}] (C*T*P*P), got "
                             f"{tuple(pixel_values.shape)}")
        return F.linear(pixel_values.to(weight.dtype), flat, self.proj.bias)


class VisionAttention(nn.Module):
    """Multi-head self-attention of both towers: ``qkv`` (``[3 * dim, dim]`` + bias; output rows ``[q; k; v]``,
    each heads-major ``[num_heads, head_dim]``), 2-D rotary on q and k, attention within the ``cu_seqlens``
    segments, ``proj`` (+ bias)."""

    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"vision hidden_size {dim} is not a multiple of num_heads {num_heads}")
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=True)
        self.proj = nn.Linear(dim, dim, bias=True)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], bounds: Sequence[int]) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).reshape(n, 3, self.num_heads, -1).unbind(1)
        cos, sin = rope
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        return self.proj(segment_attention(q, k, v, bounds).reshape(n, -1))


class VisionBlock(nn.Module):
    """Pre-norm ViT block: ``x + attn(norm1(x))``, then ``x + mlp(norm2(x))``, the attention over each of ``bounds``'
    segments with the 2-D rotary ``rope``. The tower gives its norms (``norm``: width -> module) and MLP; the module
    names are its checkpoints'."""

    def __init__(self, config: Any, norm: Callable[[int], nn.Module], mlp: nn.Module) -> None:
        super().__init__()
        self.norm1 = norm(config.hidden_size)
        self.norm2 = norm(config.hidden_size)
        self.attn = VisionAttention(config.hidden_size, config.num_heads)
        self.mlp = mlp

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], bounds: Sequence[int]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), rope, bounds)
        return x + self.mlp(self.norm2(x))


def rotary_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos(a), sin(a))``, each ``[N, head_dim]`` fp32, of the patches at ``positions`` (``[N, 2]``: row, column
    in the frame); the angles ``a`` of the module docstring."""
    half = head_dim // 2
    inv_freq = 1.0 / (theta ** (torch.arange(0, half, 2, dtype=torch.float, device=positions.device) / half))
    angles = (positions[..., None].float() * inv_freq).flatten(1)  # [h * inv_freq, w * inv_freq]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` over ``x``'s ``[N, heads, head_dim]``, in fp32, back in ``x``'s dtype."""
    x32 = x.float()
    x1, x2 = x32.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x32 * cos[:, None] + rotated * sin[:, None]).to(x.dtype)


def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: Sequence[int]) -> torch.Tensor:
    """``[N, heads, head_dim]`` attention output of ``q, k, v`` (each ``[N, heads, head_dim]``), every token
    attending to the tokens of its own segment ``[bounds[i], bounds[i+1])`` only (non-causal, scale
    ``1 / sqrt(head_dim)``). Segments of equal length are gathered into one batched SDPA call (windows mostly share
    a length), so the number of kernel calls is the number of distinct lengths, not of segments."""
    if bounds[0] != 0 or bounds[-1] != q.shape[0]:
        raise ValueError(f"segment bounds must run from 0 to {q.shape[0]} tokens, got {bounds[0]}..{bounds[-1]}")
    starts_by_length: dict[int, list[int]] = defaultdict(list)
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end > start:
            starts_by_length[end - start].append(start)
    if len(starts_by_length) == 1 and len(next(iter(starts_by_length.values()))) == 1:
        # one segment: no gather
        return F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)).transpose(0, 1)
    out = q.new_empty(q.shape)
    for length, starts in starts_by_length.items():
        index = torch.tensor(starts, device=q.device)[:, None] + torch.arange(length, device=q.device)
        batched = [t[index].transpose(1, 2) for t in (q, k, v)]  # [segments, heads, length, head_dim]
        out[index] = F.scaled_dot_product_attention(*batched).transpose(1, 2)
    return out


def merge_block_positions(grid_thw: Sequence[Sequence[int]], merge: int, device=None) -> torch.Tensor:
    """``[N, 2]`` (row, column) of every patch in the processor's merge-block-major order, frame after frame (the
    same positions in every frame of a video)."""
    positions = []
    for t, h, w in grid_thw:
        if h % merge or w % merge:
            raise ValueError(f"a {h} x {w} patch grid is not a multiple of spatial_merge_size {merge}")
        rows = torch.arange(h, device=device)[:, None].expand(h, w)
        cols = torch.arange(w, device=device)[None, :].expand(h, w)
        block = (h // merge, merge, w // merge, merge)
        rows, cols = (p.reshape(block).transpose(1, 2).flatten() for p in (rows, cols))
        positions.append(torch.stack([rows, cols], dim=-1).repeat(t, 1))
    return torch.cat(positions)


def frame_bounds(grid_thw: Sequence[Sequence[int]]) -> list[int]:
    """Cumulative patch counts of the frames (each frame of each image one attention segment): ``cu_seqlens``."""
    bounds = [0]
    for t, h, w in grid_thw:
        for _ in range(t):
            bounds.append(bounds[-1] + h * w)
    return bounds


def grid_list(grid_thw: torch.Tensor) -> list[tuple[int, int, int]]:
    """``grid_thw`` as Python ints (every index computation of the towers is host-side, from these)."""
    if grid_thw.dim() != 2 or grid_thw.shape[1] != 3:
        raise ValueError(f"grid_thw must be [n_images, 3], got {tuple(grid_thw.shape)}")
    return [(int(t), int(h), int(w)) for t, h, w in grid_thw.tolist()]


class VisionTower(nn.Module):
    """Base of the towers: the checkpoint-name rule and loading.

    Name rule: a parameter's checkpoint name is ``hf_prefix + `` its name in this module (the towers keep the
    checkpoint's module layout, so the table is the identity under the prefix), e.g. ``blocks.0.attn.qkv.weight``
    is ``visual.blocks.0.attn.qkv.weight`` in a Qwen2.5-VL checkpoint."""

    hf_prefix: str

    def __init__(self, config: Any, hf_prefix: str, model: str) -> None:
        """The fields both towers read from ``vision_config``: the merge size, the head width and the axial 2-D
        rotary's base (``ValueError`` naming ``model`` for another rotary type)."""
        super().__init__()
        self.hf_prefix = hf_prefix
        self.merge = config.spatial_merge_size
        self.head_dim = config.hidden_size // config.num_heads
        rope = getattr(config, "rope_parameters", None) or {}
        if rope.get("rope_type", "axial") != "axial":
            raise ValueError(f"{model} vision rotary must be axial, got {rope['rope_type']!r}")
        self.rope_theta = float(rope.get("rope_theta", 10000.0))

    def embed_patches(self, pixel_values: torch.Tensor, grid: list[tuple[int, int, int]]) -> torch.Tensor:
        """The patch embeddings (``self.patch_embed``) of ``pixel_values``; ``ValueError`` when their number is not
        the grids' ``sum(t * h * w)``."""
        x = self.patch_embed(pixel_values)
        if x.shape[0] != sum(t * h * w for t, h, w in grid):
            raise ValueError(f"{x.shape[0]} patches for grid_thw {grid}")
        return x

    def hf_names(self) -> dict[str, str]:
        """This module's parameter name -> the checkpoint's tensor name, for every parameter."""
        return {name: self.hf_prefix + name for name, _ in self.named_parameters()}

    def load_hf(self, read: Callable[[str], torch.Tensor]) -> None:
        """Copies every parameter from ``read(checkpoint name)`` (cast to the parameter's dtype and device);
        ``ValueError`` naming the tensor when its shape is not the parameter's."""
        params = dict(self.named_parameters())
        for name, hf_name in self.hf_names().items():
            param, tensor = params[name], read(hf_name)
            if tuple(tensor.shape) != tuple(param.shape):
                raise ValueError(f"checkpoint tensor {hf_name} has shape {tuple(tensor.shape)}, but the vision "
                                 f"tower's {name} is {tuple(param.shape)}")
            with torch.no_grad():
                param.copy_(tensor.to(device=param.device, dtype=param.dtype))

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> VisionOutput:  # pragma: no cover
        raise NotImplementedError
