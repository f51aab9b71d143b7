"""Packing without padding: slots padded to a multiple, restarting positions, exact round trips."""

from __future__ import annotations

import pytest
import torch

from meshrl.parallel.packing import pack_padded, pack_sequences, pad_multiple_for, unpack_sequences, unpack_to_padded


def test_pack_sequences_layout() -> None:
    seqs = [torch.tensor([11, 12, 13]), torch.tensor([21]), torch.tensor([31, 32, 33, 34, 35])]
    packed = pack_sequences(seqs, pad_multiple=4, pad_value=-1)
    assert packed.input_ids.tolist() == [[11, 12, 13, -1, 21, -1, -1, -1, 31, 32, 33, 34, 35, -1, -1, -1]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7]]
    assert packed.cu_seqlens_padded.tolist() == [0, 4, 8, 16] and packed.cu_seqlens_padded.dtype == torch.int32
    assert packed.cu_seqlens.tolist() == [0, 3, 4, 9] and packed.max_seqlen == 8
    assert [s.tolist() for s in unpack_sequences(packed.input_ids, packed)] == [s.tolist() for s in seqs]


@pytest.mark.parametrize("multiple", [1, 2, 8])
def test_padded_round_trip_with_left_and_right_padding(multiple: int) -> None:
    gen = torch.Generator().manual_seed(0)
    batch, seq, vocab = 5, 12, 7
    input_ids = torch.randint(1, 100, (batch, seq), generator=gen)
    mask = torch.zeros(batch, seq, dtype=torch.long)
    # RL layout: left-padded prompt then right-padded response; one row is full, one nearly empty.
    for row, (start, end) in enumerate([(3, 10), (0, 12), (5, 6), (2, 12), (0, 4)]):
        mask[row, start:end] = 1
    packed = pack_padded(input_ids, mask, pad_multiple=multiple)
    assert packed.num_tokens % multiple == 0
    assert (torch.diff(packed.cu_seqlens_padded) % multiple == 0).all()
    assert packed.seq_lens.tolist() == mask.sum(1).tolist()
    assert torch.equal(packed.input_ids[0][packed.packed_index], input_ids[mask.bool()])
    # Per-token outputs with a trailing dimension (e.g. logits) scatter back to the padded layout.
    logits = torch.randn(1, packed.num_tokens, vocab, generator=gen)
    restored = unpack_to_padded(logits, packed, fill_value=0.0)
    assert restored.shape == (batch, seq, vocab)
    assert torch.equal(restored[mask.bool()], logits[0][packed.packed_index])
    assert (restored[~mask.bool()] == 0).all()
    assert torch.equal(unpack_to_padded(packed.input_ids, packed, fill_value=0), input_ids * mask)
    per_seq = unpack_sequences(packed.input_ids[0], packed)  # a (T,) tensor works as well as (1, T)
    assert [s.tolist() for s in per_seq] == [input_ids[r][mask[r].bool()].tolist() for r in range(batch)]


def test_positions_restart_in_every_slot() -> None:
    packed = pack_sequences([torch.arange(5), torch.arange(3)], pad_multiple=2)
    pos = packed.position_ids[0]
    starts = packed.cu_seqlens_padded[:-1].long()
    assert (pos[starts] == 0).all() and pos.tolist() == [0, 1, 2, 3, 4, 5, 0, 1, 2, 3]


def test_pad_multiple_rule_and_errors() -> None:
    assert pad_multiple_for(4) == 4 and pad_multiple_for(2, 2) == 8 and pad_multiple_for() == 1
    with pytest.raises(ValueError):
        pad_multiple_for(0)
    with pytest.raises(ValueError, match="same \\(B, S\\) shape"):
        pack_padded(torch.zeros(2, 3), torch.ones(2, 4))
    with pytest.raises(ValueError, match="1-D"):
        pack_sequences([torch.zeros(2, 2)])
    packed = pack_sequences([torch.arange(3)])
    with pytest.raises(ValueError, match="expected 3 packed positions"):
        unpack_sequences(torch.zeros(5), packed)
    with pytest.raises(ValueError, match="made by pack_padded"):
        unpack_to_padded(packed.input_ids, packed)
