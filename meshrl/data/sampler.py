"""Which prompts each training step sees: seeded shuffling, exact resume, plain validation order, and
the row subset of ``data.train_max_samples`` / ``data.val_max_samples``.

Epoch ``e`` visits the prompts in the order ``permutation(seed, e)``, a pure function of the seed and
the epoch number (NumPy's PCG64 seeded with ``[seed, e]``). The sampler's whole state is therefore
``(epoch, offset)``: restoring it continues with exactly the prompts an uninterrupted run would have
seen, with no RNG state to save or to drift. Step ``t`` of an epoch takes positions
``[t*B, (t+1)*B)`` of that order; with ``drop_last`` (the default, as verl's train dataloader) the
``n mod B`` prompts left at the end of an epoch are skipped, otherwise they form a short last batch.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np


# The sampler's settings a resume must find unchanged, with what sets each (the messages name it).
SETTING_KEYS = {
    "num_samples": "prompts in data.train_files (after filtering and data.train_max_samples)",
    "batch_size": "data.train_batch_size",
    "seed": "data.seed",
    "shuffle": "data.shuffle",
    "drop_last": "drop_last",
}


def epoch_permutation(num_samples: int, seed: int, epoch: int) -> np.ndarray:
    """The visiting order of epoch ``epoch``: a permutation of ``range(num_samples)``."""
    return np.random.default_rng([seed, epoch]).permutation(num_samples)


class PromptSampler:
    """Yields ``batch_size`` dataset indices per training step, epoch after epoch, without end.

    Args:
        num_samples: dataset size (after filtering).
        batch_size: prompts per step (``data.train_batch_size``).
        shuffle: reshuffle every epoch (``data.shuffle``); False visits ``0..n-1`` in order.
        seed: shuffling seed (``data.seed``).
        drop_last: skip the incomplete batch at the end of each epoch.
    """

    def __init__(
        self, num_samples: int, batch_size: int, *, shuffle: bool = True, seed: int = 0, drop_last: bool = True
    ) -> None:
        if num_samples <= 0:
            raise ValueError("the training dataset is empty")
        if batch_size <= 0:
            raise ValueError(f"data.train_batch_size must be > 0, got {batch_size}")
        if num_samples < batch_size and drop_last:
            raise ValueError(
                f"data.train_batch_size={batch_size} is larger than the {num_samples} prompts available "
                f"(after filtering): no full batch exists. Lower train_batch_size or add data."
            )
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0
        self.offset = 0  # position in the current epoch's order
        self._order = self._make_order(0)

    @property
    def steps_per_epoch(self) -> int:
        """Batches yielded per epoch."""
        full, rest = divmod(self.num_samples, self.batch_size)
        return full + (1 if rest and not self.drop_last else 0)

    def _make_order(self, epoch: int) -> np.ndarray:
        return epoch_permutation(self.num_samples, self.seed, epoch) if self.shuffle else np.arange(self.num_samples)

    def _epoch_end(self) -> int:
        return self.num_samples if not self.drop_last else self.steps_per_epoch * self.batch_size

    def next_batch(self) -> list[int]:
        """Indices of the next step's prompts; moves to the next epoch when this one is exhausted."""
        if self.offset >= self._epoch_end():
            self.epoch += 1
            self.offset = 0
            self._order = self._make_order(self.epoch)
        batch = self._order[self.offset : min(self.offset + self.batch_size, self._epoch_end())]
        self.offset += len(batch)
        return batch.tolist()

    def __iter__(self) -> Iterator[list[int]]:
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict[str, Any]:
        """Position and the settings it is only meaningful under."""
        return {
            "epoch": self.epoch,
            "offset": self.offset,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_samples": self.num_samples,
            "batch_size": self.batch_size,
            "drop_last": self.drop_last,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at ``state``'s position.

        Raises:
            ValueError: the settings differ (a different dataset size, batch size, seed, shuffle or
                drop_last would replay different prompts; the message names what changed).
        """
        changed = [
            f"{SETTING_KEYS[key]}: checkpoint {state.get(key)!r}, now {getattr(self, key)!r}"
            for key in SETTING_KEYS
            if state.get(key) != getattr(self, key)
        ]
        if changed:
            raise ValueError(
                "the prompts changed since the checkpoint, so resuming would not continue its data order ("
                + "; ".join(changed)
                + "). Restore them, or train the new prompts as a new run (trainer.resume_mode=disable, or "
                "another trainer.default_local_dir)."
            )
        self.epoch = int(state["epoch"])
        self.offset = int(state["offset"])
        self._order = self._make_order(self.epoch)


def max_samples_subset(total: int, max_samples: int, *, shuffle: bool, seed: int | None) -> np.ndarray:
    """The rows ``data.train_max_samples`` / ``data.val_max_samples`` keep of ``total``, chosen as verl does.

    ``max_samples <= 0`` or ``>= total``: all rows in order. Otherwise ``shuffle`` draws ``max_samples``
    distinct rows with ``np.random.default_rng(seed).choice`` (in the drawn order), and without shuffling
    the first ``max_samples`` rows are kept.
    """
    if max_samples <= 0 or max_samples >= total:
        return np.arange(total)
    if shuffle:
        return np.random.default_rng(seed).choice(total, size=max_samples, replace=False)
    return np.arange(max_samples)


def validation_batches(num_samples: int, batch_size: int | None = None) -> Iterator[list[int]]:
    """Indices ``0..n-1`` in order, ``batch_size`` at a time (the last batch may be short; None = one batch)."""
    size = batch_size or num_samples
    if size <= 0:
        raise ValueError(f"validation batch size must be > 0, got {batch_size}")
    for start in range(0, num_samples, size):
        yield list(range(start, min(start + size, num_samples)))
