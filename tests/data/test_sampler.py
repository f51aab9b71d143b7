"""PromptSampler: seeded epochs, exact resume (epoch, offset), validation order; the max_samples subset."""

from __future__ import annotations

import json

import numpy as np
import pytest

from meshrl.data.sampler import PromptSampler, epoch_permutation, max_samples_subset, validation_batches


def _take(sampler: PromptSampler, steps: int) -> list[list[int]]:
    return [sampler.next_batch() for _ in range(steps)]


def test_epochs_are_seeded_permutations() -> None:
    sampler = PromptSampler(103, 10, seed=7)
    assert sampler.steps_per_epoch == 10
    epoch0, epoch1 = _take(sampler, 10), _take(sampler, 10)
    for epoch, number in ((epoch0, 0), (epoch1, 1)):
        flat = [i for batch in epoch for i in batch]
        assert len(flat) == len(set(flat)) == 100  # 3 left over per epoch (drop_last)
        assert flat == epoch_permutation(103, 7, number)[:100].tolist()
    assert epoch0 != epoch1 and sampler.epoch == 1
    assert _take(PromptSampler(103, 10, seed=7), 10) == epoch0
    assert _take(PromptSampler(103, 10, seed=8), 10) != epoch0


def test_no_shuffle_and_short_last_batch() -> None:
    sampler = PromptSampler(7, 3, shuffle=False, drop_last=False)
    assert sampler.steps_per_epoch == 3
    assert _take(sampler, 4) == [[0, 1, 2], [3, 4, 5], [6], [0, 1, 2]]


@pytest.mark.parametrize("drop_last", [True, False])
@pytest.mark.parametrize("stop_at", [0, 1, 9, 10, 11, 23])
def test_resume_replays_exactly_the_uninterrupted_order(drop_last: bool, stop_at: int) -> None:
    uninterrupted = _take(PromptSampler(47, 5, seed=3, drop_last=drop_last), 30)
    first = PromptSampler(47, 5, seed=3, drop_last=drop_last)
    before = _take(first, stop_at)
    state = json.loads(json.dumps(first.state_dict()))  # checkpoints store it as plain data
    resumed = PromptSampler(47, 5, seed=3, drop_last=drop_last)
    _take(resumed, 3)  # a fresh process may have consumed batches before loading: must not matter
    resumed.load_state_dict(state)
    assert before + _take(resumed, 30 - stop_at) == uninterrupted


def test_resume_refuses_changed_settings() -> None:
    state = PromptSampler(47, 5, seed=3).state_dict()
    with pytest.raises(ValueError,
                       match=r"data.train_batch_size: checkpoint 5, now 6.*data.seed: checkpoint 3, now 4"):
        PromptSampler(47, 6, seed=4).load_state_dict(state)
    with pytest.raises(ValueError, match=r"prompts in data.train_files \(after filtering and "
                                         r"data.train_max_samples\): checkpoint 47, now 48"):
        PromptSampler(48, 5, seed=3).load_state_dict(state)


def test_bad_sizes() -> None:
    with pytest.raises(ValueError, match="train_batch_size=1024 is larger than the 500 prompts"):
        PromptSampler(500, 1024)
    with pytest.raises(ValueError, match="empty"):
        PromptSampler(0, 1)
    assert _take(PromptSampler(3, 8, drop_last=False, shuffle=False), 2) == [[0, 1, 2], [0, 1, 2]]


def test_validation_batches() -> None:
    assert list(validation_batches(7, 3)) == [[0, 1, 2], [3, 4, 5], [6]]
    assert list(validation_batches(4)) == [[0, 1, 2, 3]]
    with pytest.raises(ValueError):
        list(validation_batches(4, -1))


def test_max_samples_subset_is_verls_choice() -> None:
    assert max_samples_subset(10, -1, shuffle=True, seed=0).tolist() == list(range(10))
    assert max_samples_subset(10, 10, shuffle=True, seed=0).tolist() == list(range(10))
    assert max_samples_subset(10, 3, shuffle=False, seed=0).tolist() == [0, 1, 2]
    drawn = max_samples_subset(10, 3, shuffle=True, seed=5)
    assert drawn.tolist() == np.random.default_rng(5).choice(10, size=3, replace=False).tolist()
    assert len(set(drawn.tolist())) == 3
