"""Cheap input checks run on every step: each raises ValueError naming the argument and the problem.

They cost at most one pass over a tensor (plus one host sync to raise), never a per-sample loop.
"""

from __future__ import annotations

import torch
from torch import Tensor


def response_mask_as_bool(response_mask: Tensor) -> Tensor:
    """Check that `response_mask` is a non-empty (B, T) mask and return it as bool."""
    if response_mask.dim() != 2:
        raise ValueError(f"response_mask must be 2-D (batch, tokens), got shape {tuple(response_mask.shape)}")
    if response_mask.shape[0] == 0:
        raise ValueError("response_mask is an empty batch (0 responses)")
    return response_mask if response_mask.dtype == torch.bool else response_mask != 0


def check_same_shape(name: str, tensor: Tensor, reference_name: str, reference: Tensor) -> None:
    if tensor.shape != reference.shape:
        raise ValueError(
            f"{name} has shape {tuple(tensor.shape)} but {reference_name} has shape "
            f"{tuple(reference.shape)}; they must match"
        )


def check_per_response(name: str, tensor: Tensor, batch_size: int) -> None:
    """`tensor` must hold one value per response: shape (B,)."""
    if tensor.shape != (batch_size,):
        raise ValueError(f"{name} must have shape ({batch_size},) (one value per response), got {tuple(tensor.shape)}")


def check_finite(name: str, tensor: Tensor, positions: str = "all") -> None:
    """Reject NaN/inf in `tensor`. To check only valid tokens, pass the tensor with masked positions
    zeroed and say so in `positions` (it is only used in the message).
    """
    # One reduction (a NaN or inf anywhere makes the sum non-finite); locate the culprit only on failure.
    # Half-precision sums accumulate in fp32 so that a large but finite tensor does not overflow fp16.
    total = tensor.sum(dtype=torch.float32) if tensor.element_size() < 4 else tensor.sum()
    if bool(torch.isfinite(total)):
        return
    bad = ~torch.isfinite(tensor)
    if not bool(bad.any()):
        raise ValueError(f"{name} is too large: its sum overflows to {float(total)}")
    first = tuple(int(i) for i in torch.nonzero(bad)[0])
    raise ValueError(
        f"{name} has {int(bad.sum())} non-finite value(s) (NaN or inf) among {positions} positions; "
        f"first at index {first}"
    )


def check_has_valid_token(response_mask: Tensor) -> None:
    if not bool(response_mask.any()):
        raise ValueError("response_mask has no valid token: nothing to estimate or aggregate")
