"""Loss aggregation (`loss_agg_mode`) against normalisers of the *whole* mini-batch.

A mini-batch (one optimizer step) is split into micro-batches on each data-parallel rank. If each
micro-batch were averaged by its own token or sequence count, and the micro-batch losses then averaged
equally, the result would depend on the split: that is the dynamic-batch-size bug of verl's legacy
Megatron actor (verl issues #4021, #4710). Here every mode is a sum of per-token or per-sequence terms
divided by a constant of the mini-batch (`GlobalNorm`, or by nothing), so the per-micro-batch losses
simply add up:

    Σ_{micro-batches k, ranks r} aggregate_loss(L_kr, m_kr, mode, norm) = aggregate_loss(L, m, mode, norm)

for any split, and so do their gradients (accumulate micro-batch gradients by summing, and SUM-reduce
them across DP ranks, i.e. multiply by dp_size if the DP wrapper averages).

    token-mean               Σ_{i,t} L·m / N_tokens
    token-sum                Σ_{i,t} L·m        (verl's ×dp_size on each rank only undoes DDP's mean of gradients)
    seq-mean-token-sum       Σ_i Σ_t L·m / N_seqs
    seq-mean-token-mean      Σ_i (Σ_t L·m / Σ_t m) / N_seqs
    seq-mean-token-sum-norm  Σ_i Σ_t L·m / (N_seqs · L_max)        (Dr.GRPO, arXiv 2503.20783)

N_seqs counts responses with at least one valid token.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Literal, get_args

from torch import Tensor

from meshrl.algorithms.masked import masked_sum
from meshrl.algorithms.validation import check_has_valid_token, check_same_shape, response_mask_as_bool

LossAggMode = Literal[
    "token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"
]
LOSS_AGG_MODES: tuple[str, ...] = get_args(LossAggMode)


@dataclass(frozen=True)
class GlobalNorm:
    """Normalisers of one mini-batch, computed once over all its micro-batches and DP ranks."""

    num_tokens: int  # valid tokens
    num_seqs: int  # responses with >= 1 valid token
    max_len: int  # L_max of seq-mean-token-sum-norm

    @classmethod
    def from_mask(cls, response_mask: Tensor, max_len: int | None = None) -> GlobalNorm:
        """Normalisers of the mini-batch whose full response mask (B, T) is `response_mask`.

        `max_len` defaults to the mask's width T; pass the configured maximum response length to keep
        seq-mean-token-sum-norm's divisor constant across steps (as Dr.GRPO does).

        In the parallel setting each rank computes this over the union of its micro-batches and the
        counts are all-reduced across DP ranks: SUM for num_tokens and num_seqs, MAX for max_len.
        """
        mask = response_mask_as_bool(response_mask)
        check_has_valid_token(mask)
        width = mask.shape[-1] if max_len is None else max_len
        if width <= 0:
            raise ValueError(f"max_len must be > 0, got {width}")
        return cls(num_tokens=int(mask.sum()), num_seqs=int(mask.any(-1).sum()), max_len=int(width))


def aggregate_loss(token_loss: Tensor, response_mask: Tensor, loss_agg_mode: str, norm: GlobalNorm) -> Tensor:
    """This micro-batch's share (a scalar) of the mini-batch loss under `loss_agg_mode`; see the module doc.

    Only valid tokens count: whatever the loss holds at masked tokens (even NaN) changes neither the
    value nor the gradient.
    """
    mask = response_mask_as_bool(response_mask)
    check_same_shape("token_loss", token_loss, "response_mask", response_mask)
    if loss_agg_mode == "token-mean":
        return masked_sum(token_loss, mask) / norm.num_tokens
    if loss_agg_mode == "token-sum":
        return masked_sum(token_loss, mask)
    if loss_agg_mode == "seq-mean-token-sum":
        return masked_sum(token_loss, mask) / norm.num_seqs
    if loss_agg_mode == "seq-mean-token-mean":
        per_seq = masked_sum(token_loss, mask, dim=-1) / mask.sum(-1).clamp(min=1)
        return per_seq.sum() / norm.num_seqs
    if loss_agg_mode == "seq-mean-token-sum-norm":
        return masked_sum(token_loss, mask) / (norm.num_seqs * norm.max_len)
    close = difflib.get_close_matches(loss_agg_mode, LOSS_AGG_MODES, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    raise ValueError(f"unknown loss_agg_mode {loss_agg_mode!r}.{hint} Available: {', '.join(LOSS_AGG_MODES)}")
