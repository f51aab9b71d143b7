"""Sequence packing without padding (``use_remove_padding``): THD layout and its inverse.

The real tokens of every sequence are laid end to end in one row. Sequence ``i`` occupies a slot of
``padded_len_i = ceil(len_i / m) * m`` tokens starting at ``cu_seqlens_padded[i]``: its ``len_i``
tokens, then ``padded_len_i - len_i`` pad tokens. ``m`` (``pad_multiple``) is the tensor-parallel
size, or ``2 * TP * CP`` with context parallelism (sequence parallelism splits every sequence into TP
equal chunks, and context parallelism into 2·CP load-balanced chunks per TP shard), see
:func:`pad_multiple_for`. Position ids restart at 0 in every slot, which is how Hugging Face models
detect packed rows; ``cu_seqlens`` (real lengths) and ``cu_seqlens_padded`` (slots) are what
varlen attention kernels and Megatron's ``PackedSeqParams`` take.

Unpacking uses the two index vectors kept at packing time, so it is a single gather (and scatter,
for the padded ``(B, S)`` layout) whatever the padding pattern of the input was.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


def pad_multiple_for(tp_size: int = 1, cp_size: int = 1) -> int:
    """Slot size multiple: TP without context parallelism, 2·TP·CP with it."""
    if tp_size < 1 or cp_size < 1:
        raise ValueError(f"tp_size and cp_size must be >= 1, got {tp_size}, {cp_size}")
    return tp_size if cp_size == 1 else 2 * tp_size * cp_size


@dataclass(frozen=True)
class PackedSequences:
    """A packed row and the bookkeeping to undo it.

    Attributes:
        input_ids: ``(1, T)`` packed tokens (pad slots hold ``pad_value``).
        position_ids: ``(1, T)`` position within each slot.
        cu_seqlens: ``(n+1,)`` int32 cumulative real lengths.
        cu_seqlens_padded: ``(n+1,)`` int32 slot offsets in the packed row (``T = cu_seqlens_padded[-1]``).
        seq_lens: ``(n,)`` int64 real lengths.
        max_seqlen: longest slot.
        packed_index: ``(N,)`` position in the packed row of each real token.
        source_index: ``(N,)`` where that token came from (flat index into the ``(B, S)`` input, or into
            the concatenation of the input sequences).
        padded_shape: ``(B, S)`` of a padded input, None for a list input.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    cu_seqlens_padded: torch.Tensor
    seq_lens: torch.Tensor
    max_seqlen: int
    packed_index: torch.Tensor
    source_index: torch.Tensor
    padded_shape: tuple[int, int] | None

    @property
    def num_tokens(self) -> int:
        """Length ``T`` of the packed row, pad slots included."""
        return int(self.input_ids.shape[1])


def _pack(
    tokens: torch.Tensor,
    row: torch.Tensor,
    rank: torch.Tensor,
    seq_lens: torch.Tensor,
    pad_multiple: int,
    pad_value: int,
    source_index: torch.Tensor,
    padded_shape: tuple[int, int] | None,
) -> PackedSequences:
    """Place real token ``j`` (sequence ``row[j]``, ``rank[j]``-th in it) into its slot."""
    if pad_multiple < 1:
        raise ValueError(f"pad_multiple must be >= 1, got {pad_multiple}")
    device = tokens.device
    padded = (seq_lens + pad_multiple - 1) // pad_multiple * pad_multiple
    zero = torch.zeros(1, dtype=torch.int64, device=device)
    cu_padded = torch.cat([zero, padded.cumsum(0)])
    cu_real = torch.cat([zero, seq_lens.cumsum(0)])
    total = int(cu_padded[-1])
    packed_index = cu_padded[row] + rank
    input_ids = torch.full((total,), pad_value, dtype=tokens.dtype, device=device)
    input_ids[packed_index] = tokens
    position_ids = torch.arange(total, device=device) - torch.repeat_interleave(cu_padded[:-1], padded)
    return PackedSequences(
        input_ids=input_ids.unsqueeze(0),
        position_ids=position_ids.unsqueeze(0),
        cu_seqlens=cu_real.to(torch.int32),
        cu_seqlens_padded=cu_padded.to(torch.int32),
        seq_lens=seq_lens,
        max_seqlen=int(padded.max()) if len(padded) else 0,
        packed_index=packed_index,
        source_index=source_index,
        padded_shape=padded_shape,
    )


def pack_sequences(sequences: Sequence[torch.Tensor], *, pad_multiple: int = 1, pad_value: int = 0) -> PackedSequences:
    """Pack 1-D token tensors (all on one device, one dtype) into one row."""
    if any(s.dim() != 1 for s in sequences):
        raise ValueError("pack_sequences takes 1-D token tensors; use pack_padded for a (B, S) batch")
    if not sequences:
        raise ValueError("nothing to pack")
    seq_lens = torch.tensor([len(s) for s in sequences], dtype=torch.int64, device=sequences[0].device)
    tokens = torch.cat(list(sequences))
    row = torch.repeat_interleave(torch.arange(len(sequences), device=tokens.device), seq_lens)
    starts = torch.cat([seq_lens.new_zeros(1), seq_lens.cumsum(0)[:-1]])
    rank = torch.arange(len(tokens), device=tokens.device) - starts[row]
    source_index = torch.arange(len(tokens), device=tokens.device)
    return _pack(tokens, row, rank, seq_lens, pad_multiple, pad_value, source_index, None)


def pack_padded(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, *, pad_multiple: int = 1, pad_value: int = 0
) -> PackedSequences:
    """Pack the tokens where ``attention_mask`` is 1 of a ``(B, S)`` batch (any padding side), row by row."""
    if input_ids.dim() != 2 or input_ids.shape != attention_mask.shape:
        raise ValueError(
            f"pack_padded needs input_ids and attention_mask of the same (B, S) shape, got "
            f"{tuple(input_ids.shape)} and {tuple(attention_mask.shape)}"
        )
    batch, seq = input_ids.shape
    mask = attention_mask.bool()
    source_index = mask.flatten().nonzero().squeeze(1)
    row = source_index // seq
    rank = (mask.cumsum(1) - 1).flatten()[source_index]
    tokens = input_ids.flatten()[source_index]
    return _pack(tokens, row, rank, mask.sum(1), pad_multiple, pad_value, source_index, (batch, seq))


def _real_tokens(values: torch.Tensor, packed: PackedSequences) -> torch.Tensor:
    """Per-real-token rows of a ``(1, T, ...)`` or ``(T, ...)`` tensor computed on the packed row."""
    flat = values[0] if values.dim() >= 2 and values.shape[0] == 1 and values.shape[1] == packed.num_tokens else values
    if flat.shape[0] != packed.num_tokens:
        raise ValueError(f"expected {packed.num_tokens} packed positions, got a tensor of shape {tuple(values.shape)}")
    return flat[packed.packed_index]


def unpack_sequences(values: torch.Tensor, packed: PackedSequences) -> list[torch.Tensor]:
    """Split a tensor computed on the packed row back into per-sequence tensors (real tokens only)."""
    return list(torch.split(_real_tokens(values, packed), packed.seq_lens.tolist()))


def unpack_to_padded(values: torch.Tensor, packed: PackedSequences, fill_value: float = 0.0) -> torch.Tensor:
    """Scatter a tensor computed on the packed row back into the ``(B, S, ...)`` layout of :func:`pack_padded`'s
    input; positions that were padding get ``fill_value``."""
    if packed.padded_shape is None:
        raise ValueError("unpack_to_padded needs a PackedSequences made by pack_padded; use unpack_sequences")
    real = _real_tokens(values, packed)
    batch, seq = packed.padded_shape
    out = torch.full((batch * seq, *real.shape[1:]), fill_value, dtype=real.dtype, device=real.device)
    out[packed.source_index] = real
    return out.view(batch, seq, *real.shape[1:])
