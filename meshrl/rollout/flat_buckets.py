"""Tensors packed into one flat byte buffer with their layout: how a bucket of weights crosses a process boundary
(vLLM's engine-core process, a CUDA IPC handle) as a single buffer, and is viewed back as named tensors there."""

from __future__ import annotations

from typing import Sequence

import torch

# (hf_name, dtype name, shape, byte offset, byte length) of each tensor inside a flat bucket.
TensorLayout = list[tuple[str, str, list[int], int, int]]


def flatten_bucket(bucket: Sequence[tuple[str, torch.Tensor]]) -> tuple[TensorLayout, torch.Tensor]:
    """Pack a bucket into one contiguous uint8 buffer on the bucket's device, and its layout."""
    layout: TensorLayout = []
    offset = 0
    for name, tensor in bucket:
        nbytes = tensor.numel() * tensor.element_size()
        layout.append((name, str(tensor.dtype).removeprefix("torch."), list(tensor.shape), offset, nbytes))
        offset += nbytes
    flat = torch.empty(offset, dtype=torch.uint8, device=bucket[0][1].device)
    for (_, _, _, start, nbytes), (_, tensor) in zip(layout, bucket):
        flat[start:start + nbytes].copy_(tensor.contiguous().view(-1).view(torch.uint8))
    return layout, flat


def unflatten_bucket(layout: TensorLayout, flat: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """Views into ``flat``, one per tensor of ``layout``."""
    return [(name, flat[start:start + nbytes].view(getattr(torch, dtype)).view(shape))
            for name, dtype, shape, start, nbytes in layout]
