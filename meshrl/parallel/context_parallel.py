"""Context parallelism (``megatron.context_parallel_size`` = CP): every packed sequence split over the CP ranks.

Layout (megatron's causal load balancing, Transformer Engine's ``thd_get_partitioned_indices``): a micro-batch is
packed (``forward.pack_thd``) with slots of a multiple of 2·CP tokens (``packing.pad_multiple_for``); a slot of L
tokens is cut into 2·CP chunks of c = L / (2·CP), and CP rank r holds chunks r and 2·CP-1-r, so that every rank has
as many early (cheap) as late (expensive) causal queries. The rank's packed row is its two chunks of every slot, slot
after slot (T / CP tokens), run with the micro-batch's global ``PackedSeqParams`` (TE's convention; megatron's THD
rotary divides the slots by CP and gives each chunk its own positions' frequencies).

Attention (``layers.sdpa_core_attention_class`` without TE; megatron's own CP attention is TE's): keys and values are
all-gathered over the CP group (:func:`gather_over_context`: its backward sums each rank's key and value gradients
over the ranks whose queries used them), and each chunk's queries attend causally to the slot's keys up to their
own position (:func:`chunk_keys`).

Outputs: each rank computes the outputs of the selected positions it holds (a token is predicted where its predictor
sits, which may be the other rank's chunk), scatters them to ``[B, S]`` and sums them over the CP group
(:func:`sum_over_context`, identity backward), so every CP rank holds every output and computes the same loss; the
gradient each rank accumulates is that of its own positions, and megatron's DDP sums gradients over the data- and
context-parallel ranks without averaging (``calculate_per_token_loss``): the sum is the loss's gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ContextShard:
    """This rank's share of a packed row: ``positions`` (``(T/CP,)``) the row positions it holds, in its row's
    order; ``local`` (``(T,)``) each row position's index in this rank's row, -1 where another rank holds it."""

    positions: torch.Tensor
    local: torch.Tensor


def chunk_bounds(slot_start: int, slot_length: int, rank: int, size: int) -> list[tuple[int, int]]:
    """The two ``[start, end)`` row spans of a slot that CP rank ``rank`` of ``size`` holds (chunks ``rank`` and
    ``2·size-1-rank`` of the slot's 2·size chunks)."""
    if slot_length % (2 * size):
        raise ValueError(f"a slot of {slot_length} tokens does not split into 2*CP = {2 * size} chunks "
                         "(pack with packing.pad_multiple_for(tp, cp))")
    chunk = slot_length // (2 * size)
    return [(slot_start + index * chunk, slot_start + (index + 1) * chunk) for index in (rank, 2 * size - 1 - rank)]


def shard(cu_seqlens_padded: torch.Tensor, rank: int, size: int) -> ContextShard:
    """The :class:`ContextShard` of CP rank ``rank`` for a packed row of slots ``cu_seqlens_padded``."""
    bounds = cu_seqlens_padded.tolist()
    spans = [span for start, end in zip(bounds[:-1], bounds[1:])
             for span in chunk_bounds(start, end - start, rank, size)]
    device = cu_seqlens_padded.device
    positions = torch.cat([torch.arange(start, end, device=device) for start, end in spans] or
                          [torch.zeros(0, dtype=torch.long, device=device)])
    local = torch.full((bounds[-1],), -1, dtype=torch.long, device=positions.device)
    local[positions] = torch.arange(len(positions), device=positions.device)
    return ContextShard(positions=positions, local=local)


def gather_over_context(local: torch.Tensor, group) -> torch.Tensor:
    """``[t, ...]`` of every rank of the CP ``group`` -> ``[CP, t, ...]``: megatron's sequence-parallel all-gather on
    the CP group, whose backward gives each rank its rows' gradient summed over the ranks (each used every rank's keys
    and values)."""
    from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

    return gather_from_sequence_parallel_region(local, tensor_parallel_output_grad=True, group=group).view(
        group.size(), *local.shape)


def sum_over_context(local: torch.Tensor, group) -> torch.Tensor:
    """Outputs each rank computed for its own positions (0 elsewhere), summed over the CP ``group``: megatron's
    all-reduce whose backward is the identity (every rank computes the same loss from the sum)."""
    from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region

    return reduce_from_tensor_model_parallel_region(local, group=group)


def chunk_keys(firsts: torch.Tensor, seconds: torch.Tensor, rank: int,
               size: int) -> list[tuple[int, int, torch.Tensor]]:
    """For one slot, given ``[CP, c, ...]`` keys and values of every CP rank's first and second local chunk of it
    (pieces of :func:`gather_over_context`'s result; c is half the slot's local length): per local chunk of this
    rank, ``(which, first_position, keys)``: the chunk (0: this rank's first, 1: its second), its first query's
    position in the slot, and the slot's keys at positions ``0 .. first_position + c - 1`` (all its causal queries
    may see)."""
    half = firsts.shape[1]
    # chunk j of the slot: rank j's first local chunk for j < CP, rank 2·CP-1-j's second otherwise
    chunks = [firsts[j] if j < size else seconds[2 * size - 1 - j] for j in range(2 * size)]
    return [(which, index * half, torch.cat(chunks[:index + 1]))
            for which, index in ((0, rank), (1, 2 * size - 1 - rank))]
