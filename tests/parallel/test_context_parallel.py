"""Context parallelism's split of packed slots (``meshrl.parallel.context_parallel``), single process: the chunks each
rank holds are the ones megatron's THD rotary gives frequencies for, every position is held once, and each chunk's
keys are its slot's keys up to its last position. The attention and gradients run at CP2 and CP2 x TP2 against HF in
``tests/parallel/test_parallel_multiproc.py``."""

from __future__ import annotations

import pytest
import torch

from meshrl.parallel import context_parallel
from meshrl.parallel.packing import pad_multiple_for


def _slots(lengths: list[int], multiple: int) -> torch.Tensor:
    padded = [-(-n // multiple) * multiple for n in lengths]
    return torch.tensor([0, *torch.tensor(padded).cumsum(0).tolist()], dtype=torch.int32)


@pytest.mark.parametrize("size,tp", [(2, 1), (2, 2), (4, 1), (3, 2)])
def test_each_rank_holds_the_chunks_megatrons_rotary_gives_positions_to(size: int, tp: int) -> None:
    from megatron.core.models.common.embeddings.rope_utils import _get_thd_freqs_on_this_cp_rank

    cu = _slots([5, 17, 1, 32, 9], pad_multiple_for(tp, size))
    total = int(cu[-1])
    held = torch.zeros(total, dtype=torch.long)
    for rank in range(size):
        part = context_parallel.shard(cu, rank, size)
        assert len(part.positions) * size == total
        held[part.positions] += 1
        assert torch.equal(part.local[part.positions], torch.arange(len(part.positions)))
        # megatron's THD rotary (CASE 2) takes a slot's local tokens and the frequencies of positions 0.. of the slot:
        # with frequencies = positions, it names the slot positions of this rank's tokens
        lengths = ((cu[1:] - cu[:-1]) // size).tolist()
        offset = 0
        for start, length in zip(cu[:-1].tolist(), lengths):
            mine = part.positions[offset:offset + length] - start
            freqs = _get_thd_freqs_on_this_cp_rank(rank, size, torch.zeros(length), torch.arange(total))
            assert torch.equal(mine, freqs), (rank, start)
            offset += length
    assert torch.equal(held, torch.ones(total, dtype=torch.long))


def test_a_slot_that_does_not_split_into_2cp_chunks_is_refused() -> None:
    with pytest.raises(ValueError, match="2\\*CP = 4 chunks"):
        context_parallel.shard(torch.tensor([0, 6], dtype=torch.int32), 0, 2)


@pytest.mark.parametrize("size", [2, 3])
def test_each_chunk_sees_its_slots_keys_up_to_its_own_last_position(size: int) -> None:
    cu = _slots([7, 20], 2 * size)
    total = int(cu[-1])
    keys = torch.arange(total, dtype=torch.float32)[:, None]  # a key is its row position
    shards = [context_parallel.shard(cu, rank, size) for rank in range(size)]
    gathered = torch.stack([keys[part.positions] for part in shards])  # what gather_over_context gives every rank
    local_cu = (cu // size).tolist()
    for rank, part in enumerate(shards):
        for slot, (start, end) in enumerate(zip(local_cu[:-1], local_cu[1:])):
            half = (end - start) // 2
            pieces = (gathered[:, start:start + half], gathered[:, start + half:end])
            for which, first, seen in context_parallel.chunk_keys(*pieces, rank, size):
                local_start = start + which * half
                queries = part.positions[local_start:local_start + half] - int(cu[slot])
                assert torch.equal(queries, torch.arange(first, first + half))
                assert torch.equal(seen[:, 0], torch.arange(int(cu[slot]), int(cu[slot]) + first + half).float())


def test_the_token_budget_is_per_context_parallel_group_as_in_verl() -> None:
    from meshrl.config.loader import default_config
    from meshrl.config.micro_batching import micro_batching

    cfg = default_config()
    cfg.actor_rollout_ref.actor.use_dynamic_bsz = True
    cfg.actor_rollout_ref.actor.ppo_max_token_len_per_gpu = 1000
    cfg.actor_rollout_ref.actor.megatron.context_parallel_size = 4
    assert micro_batching(cfg, "actor_update", 1).max_token_len == 4000
    assert micro_batching(cfg, "ref_log_prob", 1).max_token_len == 4000
    cfg.critic.ppo_max_token_len_per_gpu = 1000
    assert micro_batching(cfg, "critic_update", 1).max_token_len == 1000  # the critic's own layout: CP 1
