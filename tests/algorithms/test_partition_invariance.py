"""The mini-batch loss and its gradient do not depend on the split into micro-batches and DP ranks.

Each "rank" holds a shard of a random permutation of the mini-batch and cuts it into micro-batches,
each re-padded to its own width (as dynamic batch size does). The normalisers are assembled the way
ranks all-reduce them (SUM of counts, MAX of widths); the micro-batch losses and gradients are summed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from meshrl.algorithms import (
    LOSS_AGG_MODES,
    GlobalNorm,
    TokenLoss,
    aggregate_loss,
    cispo,
    dppo_kl,
    dppo_tv,
    dro,
    geo_mean,
    gspo,
    kl_penalty,
    policy_gradient,
    sapo,
    value_loss,
    vanilla,
)


@dataclass
class Batch:
    mask: torch.Tensor
    old: torch.Tensor  # old log-probs, or old values for the value loss
    target: torch.Tensor  # advantages, returns or reference log-probs

    def select(self, rows: torch.Tensor) -> Batch:
        mask = self.mask[rows]
        width = int(mask.any(0).nonzero().max()) + 1 if mask.any() else 1  # re-pad to this micro-batch
        return Batch(mask[:, :width], self.old[rows, :width], self.target[rows, :width])


LossFn = Callable[[torch.Tensor, Batch], TokenLoss]
# Not clip_cov / kl_cov: they pick their tokens by statistics of each micro-batch, as verl (documented there).
LOSSES: dict[str, LossFn] = {
    "vanilla": lambda x, b: vanilla(x, b.old, b.target, b.mask, clip_ratio_high=0.28),
    "gspo": lambda x, b: gspo(x, b.old, b.target, b.mask),
    "gpg": lambda x, b: policy_gradient(x, b.old, b.target, b.mask),
    "cispo": lambda x, b: cispo(x, b.old, b.target, b.mask),
    "dppo_tv": lambda x, b: dppo_tv(x, b.old, b.target, b.mask, clip_ratio_c=2.0),
    "dppo_kl": lambda x, b: dppo_kl(x, b.old, b.target, b.mask, clip_ratio_c=2.0),
    "sapo": lambda x, b: sapo(x, b.old, b.target, b.mask),
    "geo_mean": lambda x, b: geo_mean(x, b.old, b.target, b.mask),
    "dro": lambda x, b: dro(x, b.old, b.target, b.mask, dro_beta=0.1),
    "value": lambda x, b: value_loss(x, b.old, b.target, b.mask),
    "kl_k3": lambda x, b: TokenLoss(loss=kl_penalty(x, b.old, "k3")),
}


def random_problem(seed: int, batch: int, width: int, loss_name: str) -> tuple[torch.Tensor, Batch]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, width + 1, (batch,), generator=generator)
    lengths[0] = max(int(lengths[0]), 1)  # at least one valid token in the mini-batch
    mask = torch.arange(width) < lengths.unsqueeze(-1)
    current = -torch.rand(batch, width, generator=generator) * 3
    # Spread so that every clip (PPO's 0.2, GSPO's 4e-4, the value clip's 0.5) is hit on some tokens.
    spread = 1e-3 if loss_name == "gspo" else 0.5
    old = current + spread * torch.randn(batch, width, generator=generator)
    target = torch.randn(batch, width, generator=generator)
    return current, Batch(mask, old, target)


def total_loss(x: torch.Tensor, batch: Batch, loss_fn: LossFn, mode: str, norm: GlobalNorm) -> torch.Tensor:
    out = loss_fn(x, batch)
    return aggregate_loss(out.loss, batch.mask, out.agg_mode or mode, norm)


@settings(max_examples=140, deadline=None, derandomize=True)  # ~2.5 per (loss, mode)
@given(
    seed=st.integers(0, 2**31 - 1),
    batch=st.integers(1, 12),
    width=st.integers(1, 9),
    loss_name=st.sampled_from(sorted(LOSSES)),
    mode=st.sampled_from(LOSS_AGG_MODES),
    ranks=st.integers(1, 3),
    data=st.data(),
)
def test_loss_and_gradient_are_invariant_to_micro_batch_and_rank_splits(
    seed: int, batch: int, width: int, loss_name: str, mode: str, ranks: int, data: st.DataObject
) -> None:
    loss_fn = LOSSES[loss_name]
    current, full = random_problem(seed, batch, width, loss_name)

    x_full = current.clone().requires_grad_(True)
    reference = total_loss(x_full, full, loss_fn, mode, GlobalNorm.from_mask(full.mask))
    (reference_grad,) = torch.autograd.grad(reference, x_full)

    order = torch.randperm(batch, generator=torch.Generator().manual_seed(seed + 1))
    shards = torch.tensor_split(order, ranks)
    micro_batches = []
    for shard in shards:
        cuts = data.draw(st.lists(st.integers(1, len(shard) - 1), max_size=3, unique=True)) if len(shard) > 1 else []
        micro_batches.append([rows for rows in torch.tensor_split(shard, sorted(cuts)) if len(rows)])

    # What each rank contributes to the all-reduce: SUM of its counts, MAX of its widths.
    local = [full.mask[shard] for shard in shards if len(shard)]
    norm = GlobalNorm(
        num_tokens=sum(int(m.sum()) for m in local),
        num_seqs=sum(int(m.any(-1).sum()) for m in local),
        max_len=max(m.shape[-1] for m in local),
    )
    assert norm == GlobalNorm.from_mask(full.mask)

    x_split = current.clone().requires_grad_(True)
    summed = torch.zeros(())
    for rank_micro_batches in micro_batches:
        for rows in rank_micro_batches:
            part = full.select(rows)
            summed = summed + total_loss(x_split[rows, : part.mask.shape[-1]], part, loss_fn, mode, norm)
    (split_grad,) = torch.autograd.grad(summed, x_split)

    torch.testing.assert_close(summed, reference, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(split_grad, reference_grad, rtol=1e-5, atol=1e-6)


def test_per_micro_batch_normalisation_would_be_caught() -> None:
    """The legacy bug (normalise per micro-batch, average micro-batches equally) depends on the split."""
    current, full = random_problem(seed=3, batch=6, width=8, loss_name="vanilla")
    full.mask[:3, 1:] = False  # three 1-token responses and three longer ones
    full.mask[3:] = True
    x = current.clone().requires_grad_(True)
    reference = total_loss(x, full, LOSSES["vanilla"], "token-mean", GlobalNorm.from_mask(full.mask))
    parts = [full.select(torch.arange(0, 3)), full.select(torch.arange(3, 6))]
    starts = (0, 3)
    legacy = sum(
        total_loss(x[s : s + 3, : p.mask.shape[-1]], p, LOSSES["vanilla"], "token-mean", GlobalNorm.from_mask(p.mask))
        for s, p in zip(starts, parts)
    ) / len(parts)
    assert not torch.allclose(legacy, reference, rtol=1e-3)
