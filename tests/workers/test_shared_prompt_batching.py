"""Micro-batches for the shared-prompt layout: a token budget keeps each prompt's rows together, as many per run as
the prompt and their responses fit, and caps the tokens the micro-batches compute (the prompt counted once)."""

from __future__ import annotations

import torch

from meshrl.config.micro_batching import MicroBatching
from meshrl.protocol import Batch
from meshrl.workers.sequences import prompt_groups, split_micro_batches


def rl_batch(prompts: list[list[int]], response_lengths: list[int]) -> Batch:
    width = max(response_lengths)
    mask = (torch.arange(width) < torch.tensor(response_lengths)[:, None]).float()
    return Batch(tensors={"responses": torch.randint(5, 100, (len(prompts), width)), "response_mask": mask},
                 non_tensors={"prompt_ids": prompts})


def test_a_prompts_rows_stay_together_in_runs_that_fit_the_budget() -> None:
    a, b = [1, 2, 3, 4, 5, 6], [7, 8]
    # rows interleaved as a shuffled mini-batch would hold them
    batch = rl_batch([a, b, a, a, b, a], [4, 3, 5, 2, 6, 4])
    runs, tokens = prompt_groups(batch, max_token_len=16)
    # a: 6 + 4 + 5 = 15 fits, + 2 does not; then 6 + 2 + 4; b: 2 + 3 + 6
    assert runs == [[0, 2], [3, 5], [1, 4]] and tokens.tolist() == [15, 12, 11]
    plan, rows, micros = split_micro_batches(batch, MicroBatching(max_token_len=16), None, pad_id=0,
                                             shared_prompts=True)
    assert sorted(sorted(p) for p in plan.micro_batches) == [[0, 2], [1, 4], [3, 5]]
    assert sorted(plan.tokens_per_micro_batch.tolist()) == [11, 12, 15]  # what each computes, within the budget
    unshared, _, _ = split_micro_batches(batch, MicroBatching(max_token_len=16), None, pad_id=0)
    assert max(unshared.tokens_per_micro_batch) <= 16 and unshared.num_micro_batches > plan.num_micro_batches
    assert all(len({tuple(p) for p in part["prompt_ids"]}) == 1 for part in rows)  # one prompt per micro-batch here
