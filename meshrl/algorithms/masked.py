"""Reductions over the valid tokens of a (B, T) tensor, and the time recurrences of returns.

Masking uses `torch.where`, never multiplication, so that NaN/inf left in padded positions cannot leak
into a result (0 * NaN = NaN).
"""

from __future__ import annotations

import torch
from torch import Tensor


def masked_sum(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Σ_t values·m (over `dim`, or over everything)."""
    kept = torch.where(mask, values, 0.0)
    return kept.sum() if dim is None else kept.sum(dim)


def masked_mean(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Σ values·m / Σ m; an empty row gives 0."""
    count = mask.sum() if dim is None else mask.sum(dim)
    return masked_sum(values, mask, dim) / count.clamp(min=1)


def masked_whiten(values: Tensor, mask: Tensor, eps: float = 1e-8) -> Tensor:
    """(x − μ)/sqrt(σ² + eps) over the valid tokens of the whole batch; σ² unbiased (N−1); 0 where masked."""
    count = mask.sum()
    mean = masked_sum(values, mask) / count
    centred = torch.where(mask, values - mean, 0.0)
    var = centred.square().sum() / (count - 1).clamp(min=1)
    return centred * torch.rsqrt(var + eps)


def reverse_linear_scan(inputs: Tensor, decay: Tensor) -> Tensor:
    """y_t = x_t + d_t · y_{t+1}, with y_T = 0, along the last dimension of (B, T) tensors.

    Returns, GAE and their masked variants are all this recurrence with a different decay. It is
    sequential in t, so the loop runs over time steps with each step vectorised over the batch
    (one fused op per step, on contiguous (T, B) rows).
    """
    x = inputs.t().contiguous()
    d = decay.to(inputs.dtype).t().contiguous()
    out = torch.empty_like(x)
    running = torch.zeros_like(x[0])
    for t in range(x.shape[0] - 1, -1, -1):
        running = torch.addcmul(x[t], d[t], running, out=out[t])
    return out.t().contiguous()
