"""``Batch``: the one container for a batch of sequences that every layer passes around.

A batch holds B samples as
- ``tensors``: name → ``torch.Tensor`` whose first dimension is B (token ids, masks, log-probs, ...),
- ``non_tensors``: name → ``numpy.ndarray`` whose first dimension is B (per-sample metadata: the
  prompt's data source, ground truth, group uid, ...; object arrays for strings and dicts),
- ``meta``: batch-level information that is never split (step number, temperature, metrics, ...).

Row operations (``take``, ``split``, ``chunk``, ``concat``, ``reorder``, ``repeat_interleave``) act on
tensors and metadata together, so a sample's metadata can never drift from its tensors.

Why not tensordict: its per-sample non-tensor data is a Python object per element (``NonTensorStack``)
that indexes and pickles slowly, while metadata here is a numpy array indexed in one call; and a
Ray transfer must not pickle a whole storage for a slice view (``__getstate__`` compacts views).
The container is small enough that owning it costs less than adapting to another's semantics.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import numpy as np
import torch

IndexLike = Sequence[int] | np.ndarray | torch.Tensor | slice


def _as_index(idx: IndexLike) -> np.ndarray | slice:
    if isinstance(idx, slice):
        return idx
    if isinstance(idx, torch.Tensor):
        return idx.cpu().numpy()
    return np.asarray(idx, dtype=np.int64)


@dataclass
class Batch:
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    non_tensors: dict[str, np.ndarray] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.non_tensors = {k: _to_array(v) for k, v in self.non_tensors.items()}
        sizes = {k: len(v) for k, v in {**self.tensors, **self.non_tensors}.items()}
        if len(set(sizes.values())) > 1:
            raise ValueError(f"Batch fields disagree on the batch size: {sizes}")

    # --- shape and access -------------------------------------------------------------------
    def __len__(self) -> int:
        for value in self.tensors.values():
            return value.shape[0]
        for value in self.non_tensors.values():
            return len(value)
        return 0

    def __getitem__(self, key: str) -> torch.Tensor | np.ndarray:
        if key in self.tensors:
            return self.tensors[key]
        if key in self.non_tensors:
            return self.non_tensors[key]
        raise KeyError(f"Batch has no field '{key}'; it has {sorted(self.keys())}")

    def __contains__(self, key: str) -> bool:
        return key in self.tensors or key in self.non_tensors

    def keys(self) -> list[str]:
        return [*self.tensors, *self.non_tensors]

    def set(self, key: str, value: torch.Tensor | np.ndarray | Sequence) -> None:
        """Add or replace a field; its first dimension must equal the batch size."""
        if self.keys() and len(value) != len(self):
            raise ValueError(f"field '{key}' has {len(value)} rows, the batch has {len(self)}")
        if isinstance(value, torch.Tensor):
            self.non_tensors.pop(key, None)
            self.tensors[key] = value
        else:
            self.tensors.pop(key, None)
            self.non_tensors[key] = _to_array(value)

    def select(self, keys: Iterable[str]) -> "Batch":
        """A batch with only ``keys`` (same rows; tensors shared, not copied)."""
        keys = list(keys)
        missing = [k for k in keys if k not in self]
        if missing:
            raise KeyError(f"Batch has no field(s) {missing}; it has {sorted(self.keys())}")
        return Batch({k: v for k, v in self.tensors.items() if k in keys},
                     {k: v for k, v in self.non_tensors.items() if k in keys}, dict(self.meta))

    def union(self, other: "Batch") -> "Batch":
        """Fields of both (same rows); a field present in both must be identical."""
        if len(self) and len(other) and len(self) != len(other):
            raise ValueError(f"cannot union batches of {len(self)} and {len(other)} rows")
        for key in set(self.tensors) & set(other.tensors):
            if not torch.equal(self.tensors[key], other.tensors[key]):
                raise ValueError(f"union: field '{key}' differs between the batches")
        return Batch({**self.tensors, **other.tensors}, {**self.non_tensors, **other.non_tensors},
                     {**self.meta, **other.meta})

    # --- row operations ---------------------------------------------------------------------
    def take(self, idx: IndexLike) -> "Batch":
        """Rows ``idx`` (in that order)."""
        index = _as_index(idx)
        t_index = index if isinstance(index, slice) else torch.from_numpy(index)
        return Batch({k: v[t_index] for k, v in self.tensors.items()},
                     {k: v[index] for k, v in self.non_tensors.items()}, dict(self.meta))

    def reorder(self, perm: IndexLike) -> "Batch":
        """Rows permuted by ``perm`` (a permutation of ``range(len(self))``)."""
        index = _as_index(perm)
        if isinstance(index, slice) or sorted(index.tolist()) != list(range(len(self))):
            raise ValueError("reorder needs a permutation of all rows; use take() for a subset")
        return self.take(index)

    def split(self, sizes: int | Sequence[int]) -> list["Batch"]:
        """Consecutive pieces: of ``sizes`` rows each (int), or of the given row counts (list)."""
        n = len(self)
        if isinstance(sizes, int):
            if sizes <= 0:
                raise ValueError(f"split size must be > 0, got {sizes}")
            sizes = [sizes] * (n // sizes) + ([n % sizes] if n % sizes else [])
        if sum(sizes) != n:
            raise ValueError(f"split sizes {list(sizes)} sum to {sum(sizes)}, the batch has {n} rows")
        bounds = np.cumsum([0, *sizes])
        return [self.take(slice(int(a), int(b))) for a, b in zip(bounds[:-1], bounds[1:])]

    def chunk(self, k: int) -> list["Batch"]:
        """``k`` consecutive pieces of equal size (the batch size must divide evenly)."""
        if k <= 0 or len(self) % k:
            raise ValueError(f"cannot chunk {len(self)} rows into {k} equal pieces")
        return self.split(len(self) // k)

    def repeat_interleave(self, n: int) -> "Batch":
        """Each row repeated ``n`` times in place: rows a, b → a, a, b, b (for ``rollout.n``)."""
        index = np.repeat(np.arange(len(self)), n)
        return self.take(index)

    @staticmethod
    def concat(batches: Sequence["Batch"]) -> "Batch":
        """Rows of all batches in order; all must have the same fields. ``meta`` is taken from the first."""
        if not batches:
            raise ValueError("concat needs at least one batch")
        keys = set(batches[0].keys())
        for i, b in enumerate(batches[1:], 1):
            if set(b.keys()) != keys:
                raise ValueError(f"concat: batch {i} has fields {sorted(b.keys())}, batch 0 has {sorted(keys)}")
        tensors = {k: torch.cat([b.tensors[k] for b in batches]) for k in batches[0].tensors}
        non_tensors = {k: np.concatenate([b.non_tensors[k] for b in batches]) for k in batches[0].non_tensors}
        return Batch(tensors, non_tensors, dict(batches[0].meta))

    def to(self, device: torch.device | str) -> "Batch":
        return Batch({k: v.to(device) for k, v in self.tensors.items()}, dict(self.non_tensors), dict(self.meta))

    # --- transport ----------------------------------------------------------------------------
    def __getstate__(self) -> dict:
        # A slice view pickles its whole storage: compact views so a Ray transfer of one
        # micro-batch does not ship the full batch.
        tensors = {k: v.clone() if v.untyped_storage().nbytes() > v.nbytes else v
                   for k, v in self.tensors.items()}
        return {"tensors": tensors, "non_tensors": self.non_tensors, "meta": self.meta}

    def __setstate__(self, state: dict) -> None:
        self.tensors = state["tensors"]
        self.non_tensors = state["non_tensors"]
        self.meta = state["meta"]

    def plain(self) -> dict:
        """The batch in types ``torch.load(weights_only=True)`` reads (tensors, lists, dicts, strings, numbers):
        a checkpoint's form of it (``from_plain``). A numeric column travels as a tensor (its dtype kept), an
        object column as a list."""
        columns = {k: torch.from_numpy(v) if v.dtype != object else list(v) for k, v in self.non_tensors.items()}
        return {"tensors": {k: v.clone() if v.untyped_storage().nbytes() > v.nbytes else v
                            for k, v in self.tensors.items()}, "non_tensors": columns, "meta": dict(self.meta)}

    @staticmethod
    def from_plain(state: dict) -> "Batch":
        columns = {k: v.numpy() if isinstance(v, torch.Tensor) else v for k, v in state["non_tensors"].items()}
        return Batch(dict(state["tensors"]), columns, dict(state["meta"]))


def _to_array(value: np.ndarray | Sequence) -> np.ndarray:
    if isinstance(value, np.ndarray):
        return value
    values = list(value)
    if all(isinstance(v, (bool, int, float, np.number, np.bool_)) for v in values):
        return np.asarray(values)
    # Filled element by element: np.array would turn equal-length lists (token ids) into a 2-D array.
    out = np.empty(len(values), dtype=object)
    for i, v in enumerate(values):
        out[i] = v
    return out
