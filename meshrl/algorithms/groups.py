"""Statistics of prompt groups, vectorised with index_add / scatter_reduce over the group id `uid`.

`uid` is an integer tensor (B,) holding, for each response, the index in [0, G) of the prompt it was
sampled from. Every index in [0, G) must own at least one response (renumber a filtered batch with
`torch.unique(uid, return_inverse=True)[1]`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


def num_groups(uid: Tensor, batch_size: int) -> int:
    """Validate `uid` against a batch of `batch_size` responses and return G = max(uid) + 1."""
    if uid.dim() != 1 or uid.shape[0] != batch_size:
        raise ValueError(f"uid must have shape ({batch_size},) (one group index per response), got {tuple(uid.shape)}")
    if uid.dtype.is_floating_point or uid.dtype.is_complex or uid.dtype == torch.bool:
        raise ValueError(f"uid must be an integer tensor of group indices, got dtype {uid.dtype}")
    low, high = torch.aminmax(uid)
    if int(low) < 0:
        raise ValueError(f"uid must hold group indices >= 0, got {int(low)}")
    return int(high) + 1


def group_sum(values: Tensor, uid: Tensor, groups: int) -> Tensor:
    """Σ_{j in g} values_j for each group g: shape (G,)."""
    return values.new_zeros(groups).index_add_(0, uid.long(), values)


def group_amax(values: Tensor, uid: Tensor, groups: int) -> Tensor:
    return values.new_zeros(groups).scatter_reduce_(0, uid.long(), values, "amax", include_self=False)


def group_amin(values: Tensor, uid: Tensor, groups: int) -> Tensor:
    return values.new_zeros(groups).scatter_reduce_(0, uid.long(), values, "amin", include_self=False)


@dataclass(frozen=True)
class GroupStats:
    """Statistics of each response's group, gathered back per response: every tensor is (B,)."""

    size: Tensor  # n_g, in the scores' dtype
    mean: Tensor  # mean_g; 0 for a group of one
    std: Tensor  # unbiased (n−1) std_g; 1 for a group of one


def group_stats(scores: Tensor, uid: Tensor) -> GroupStats:
    """mean_g and unbiased std_g of `scores` (B,) within each group; a group of one gets mean 0, std 1."""
    index = uid.long()
    groups = num_groups(uid, scores.shape[0])
    size = group_sum(torch.ones_like(scores), index, groups)
    if bool((size == 0).any()):
        empty = torch.nonzero(size == 0).flatten()[:5].tolist()
        raise ValueError(
            f"uid leaves group(s) {empty} of [0, {groups}) empty; group ids must be contiguous "
            "(renumber with torch.unique(uid, return_inverse=True)[1])"
        )
    mean = (group_sum(scores, index, groups) / size)[index]
    # Two passes (mean, then squared deviations) keep the variance accurate for large scores.
    var = group_sum((scores - mean).square(), index, groups) / (size - 1).clamp(min=1)
    size = size[index]
    single = size == 1
    return GroupStats(
        size=size,
        mean=torch.where(single, 0.0, mean),
        std=torch.where(single, 1.0, var.sqrt()[index]),
    )
