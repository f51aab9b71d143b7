r"""Dynamic batch size: micro-batches formed by a token budget, balanced with Karmarkar–Karp (and, for
``use_dynamic_bsz=False``, :func:`plan_fixed_micro_batches`: a fixed number of sequences each).

``use_dynamic_bsz`` / ``ppo_max_token_len_per_gpu`` (and ``log_prob_max_token_len_per_gpu`` for
forward-only passes: same function, another budget). For a rank's batch of sequence lengths
:math:`L_1..L_n` and budget :math:`B`:

1. Sequences with :math:`L_i > B` cannot fit anywhere; each becomes a micro-batch of its own and is
   reported (``num_oversized``). The budget is a strict cap for every other micro-batch.
2. The rest are split into :math:`k` parts, starting from
   :math:`k = \max(k_{min}, \lceil \sum L / B \rceil, \#\{L_i > B/2\})` and increasing :math:`k`
   while some part exceeds :math:`B`.
3. :math:`k` is agreed across data-parallel ranks (all-reduce MAX, :func:`agree_num_micro_batches`)
   so that every rank runs the same number of micro-batches (a pipeline schedule and the gradient
   all-reduce need that); a rank asked for more parts than it needed re-partitions, and if that
   violates the budget it splits its heaviest parts instead, which cannot.
4. Parts are balanced by the Karmarkar–Karp largest differencing method on a workload estimate
   (:func:`workload`): ``tokens`` (:math:`w = L`, what memory scales with) or ``attention``
   (:math:`w = L + L^2 / (6h)`: a decoder layer costs :math:`24 h^2 L` FLOPs in its matmuls plus
   :math:`4 h L^2` in attention; divided by :math:`24 h^2`). The budget is always on tokens.
5. Micro-batches are ordered light ones at both ends, heaviest in the middle, which shortens the
   fill and drain bubbles of a pipeline schedule; the plan keeps the permutation and its inverse to
   put per-sequence outputs back in the original order.

Karmarkar–Karp (k-way): every item starts as a k-tuple of subsets (the item and k-1 empty ones); the
two tuples with the largest spread (max − min subset sum) are repeatedly merged by joining the
heaviest subset of one with the lightest of the other, and so on, until one tuple is left. The
``equal_size`` variant (for :func:`balance_batch`) starts from the items sorted by weight in groups
of k, one per subset, so every subset ends with n/k items. O(n·k·log n) with the k-vectors in NumPy.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

Workload = Literal["tokens", "attention"]


def workload(lengths: Sequence[int] | np.ndarray, estimate: Workload = "tokens", hidden_size: int = 4096) -> np.ndarray:
    """Per-sequence cost estimate used for balancing (see the module docstring for the formulas)."""
    lens = np.asarray(lengths, dtype=np.float64)
    if estimate == "tokens":
        return lens
    if estimate == "attention":
        return lens + lens * lens / (6.0 * hidden_size)
    raise ValueError(f"workload estimate must be 'tokens' or 'attention', got {estimate!r}")


def karmarkar_karp(weights: Sequence[float] | np.ndarray, k: int, *, equal_size: bool = False) -> list[list[int]]:
    """Partition ``range(len(weights))`` into ``k`` index lists with near-equal weight sums.

    With ``equal_size`` every part gets exactly ``n / k`` items (``n`` must be a multiple of ``k``).
    Parts are returned heaviest first, indices ascending within a part; parts may be empty when ``n < k``.
    """
    w = np.asarray(weights, dtype=np.float64)
    n = len(w)
    if k <= 0:
        raise ValueError(f"number of parts must be >= 1, got {k}")
    if equal_size and n % k:
        raise ValueError(f"equal-size partition of {n} items into {k} parts is impossible ({n} % {k} != 0)")
    if n == 0:
        return [[] for _ in range(k)]
    # Tree of merged subsets: node ids < n are items, n + j is internal node j with two children.
    left = np.empty(n, dtype=np.int64)
    right = np.empty(n, dtype=np.int64)
    num_internal = 0
    counter = itertools.count()
    heap: list[tuple[float, int, np.ndarray, np.ndarray]] = []  # (-spread, tie, sums desc, nodes)

    def push(sums: np.ndarray, nodes: np.ndarray) -> None:
        heapq.heappush(heap, (-(sums[0] - sums[-1]), next(counter), sums, nodes))

    order = np.argsort(-w, kind="stable")
    singles: list[int] = []  # items not yet in the heap, heaviest last (single-item tuples, spread = w)
    if equal_size:
        for group in order[::-1].reshape(-1, k):  # ascending weight groups of k
            desc = group[::-1]
            push(w[desc].copy(), desc.astype(np.int64))
    else:
        singles = order[::-1].tolist()

    def pop() -> tuple[np.ndarray, np.ndarray]:
        # Single-item tuples are materialised lazily: n k-vectors up front would cost O(n k) memory.
        if singles and (not heap or w[singles[-1]] >= -heap[0][0]):
            item = singles.pop()
            sums = np.zeros(k)
            sums[0] = w[item]
            nodes = np.full(k, -1, dtype=np.int64)
            nodes[0] = item
            return sums, nodes
        _, _, sums, nodes = heapq.heappop(heap)
        return sums, nodes

    while len(heap) + len(singles) > 1:
        sums_a, nodes_a = pop()
        sums_b, nodes_b = pop()
        sums = sums_a + sums_b[::-1]
        nodes_b = nodes_b[::-1]
        both = (nodes_a >= 0) & (nodes_b >= 0)
        nodes = np.where(nodes_a >= 0, nodes_a, nodes_b)
        m = int(both.sum())
        if m:
            left[num_internal : num_internal + m] = nodes_a[both]
            right[num_internal : num_internal + m] = nodes_b[both]
            nodes[both] = n + num_internal + np.arange(m)
            num_internal += m
        desc = np.argsort(-sums, kind="stable")
        push(sums[desc], nodes[desc])
    _, nodes = pop()

    parts: list[list[int]] = []
    for root in nodes.tolist():
        members: list[int] = []
        stack = [root] if root >= 0 else []
        while stack:
            node = stack.pop()
            if node < n:
                members.append(node)
            else:
                stack += (int(left[node - n]), int(right[node - n]))
        parts.append(sorted(members))
    return parts


def agree_num_micro_batches(k: int, group: Any = None) -> int:
    """The largest ``k`` over the ranks of ``group`` (a ``torch.distributed`` process group).

    ``group=None`` means a single process: ``k`` is returned unchanged. Pass the data-parallel group
    (not the world group when tensor/pipeline parallelism is on).
    """
    if group is None:
        return k
    import torch
    import torch.distributed as dist

    from meshrl.collectives import collective_device

    value = torch.tensor([k], dtype=torch.int64, device=collective_device(group))
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return int(value.item())


def _part_tokens(parts: list[list[int]], lengths: np.ndarray) -> np.ndarray:
    return np.array([int(lengths[p].sum()) for p in parts], dtype=np.int64)


def _feasible_partition(lengths: np.ndarray, weights: np.ndarray, budget: int, k: int) -> list[list[int]] | None:
    parts = karmarkar_karp(weights, k)
    return parts if (_part_tokens(parts, lengths) <= budget).all() else None


def _min_feasible(lengths: np.ndarray, weights: np.ndarray, budget: int, k_min: int) -> list[list[int]]:
    """A budget-respecting KK partition with the smallest k found by a forward search from ``k_min``."""
    n = len(lengths)
    k_lo = max(k_min, math.ceil(lengths.sum() / budget), int((2 * lengths > budget).sum()))
    k, step, failures = min(k_lo, n), 1, 0
    while True:
        parts = _feasible_partition(lengths, weights, budget, k)
        if parts is not None:
            return parts
        # k = n is always feasible (every length <= budget here); after a few misses, gallop.
        failures += 1
        if failures > 4:
            step *= 2
        k = min(n, k + step)


def _split_to(parts: list[list[int]], weights: np.ndarray, target: int) -> list[list[int]]:
    """Reach ``target`` parts by halving (2-way KK) the heaviest splittable part; budgets only shrink."""
    parts = list(parts)
    while len(parts) < target:
        splittable = [i for i, p in enumerate(parts) if len(p) > 1]
        if not splittable:
            parts.append([])
            continue
        heaviest = max(splittable, key=lambda i: weights[parts[i]].sum())
        items = np.asarray(parts.pop(heaviest))
        parts += [items[half].tolist() for half in karmarkar_karp(weights[items], 2)]
    return parts


def order_for_pipeline(parts: list[list[int]], weights: np.ndarray) -> list[list[int]]:
    """Lightest parts at both ends, heaviest in the middle (sorted ascending, dealt front/back alternately)."""
    ranked = sorted(parts, key=lambda p: (float(weights[p].sum()), p))
    front = ranked[0::2]
    back = ranked[1::2]
    return front + back[::-1]


@dataclass(frozen=True)
class MicroBatchPlan:
    """Micro-batches (index lists into the rank's batch, in execution order) and their bookkeeping.

    ``permutation`` concatenates the micro-batches: ``batch[permutation]`` is execution order, and
    ``outputs_in_execution_order[inverse_permutation]`` is back in the original order.
    ``max_token_len`` is the token budget, None for micro-batches formed by count.
    """

    micro_batches: list[list[int]]
    lengths: np.ndarray
    max_token_len: int | None
    oversized: list[int]
    # the tokens each micro-batch computes where fewer than its rows' lengths (prompts shared by rows); None: those
    computed_tokens: np.ndarray | None = None
    permutation: np.ndarray = field(init=False)
    inverse_permutation: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        perm = np.fromiter(itertools.chain.from_iterable(self.micro_batches), dtype=np.int64, count=len(self.lengths))
        inverse = np.empty_like(perm)
        inverse[perm] = np.arange(len(perm))
        object.__setattr__(self, "permutation", perm)
        object.__setattr__(self, "inverse_permutation", inverse)

    @property
    def num_micro_batches(self) -> int:
        return len(self.micro_batches)

    @property
    def tokens_per_micro_batch(self) -> np.ndarray:
        if self.computed_tokens is not None:
            return np.asarray(self.computed_tokens, dtype=np.int64)
        return _part_tokens(self.micro_batches, self.lengths)

    @property
    def samples_per_micro_batch(self) -> np.ndarray:
        return np.array([len(p) for p in self.micro_batches], dtype=np.int64)

    def describe(self, i: int) -> str:
        """One micro-batch as the trainer logs it, e.g. ``Dynamic Batch: 85 samples (23847 tokens)``."""
        kind = "Dynamic Batch" if self.max_token_len is not None else "Micro Batch"
        return f"{kind}: {len(self.micro_batches[i])} samples ({int(self.tokens_per_micro_batch[i])} tokens)"

    def metrics(self, prefix: str = "dynamic_batch/") -> dict[str, float]:
        """Counts, per-micro-batch samples and tokens, budget utilisation (tokens / budget; token-budget
        plans only) and the padding ratio a padded layout would have (each micro-batch padded to its
        longest sequence: ``1 - Σ tokens / Σ samples·max_len``; packing without padding avoids it)."""
        tokens = self.tokens_per_micro_batch
        samples = self.samples_per_micro_batch
        longest = np.array([int(self.lengths[p].max()) if p else 0 for p in self.micro_batches], dtype=np.int64)
        padded = int((samples * longest).sum())
        out = {prefix + "num_micro_batches": float(len(tokens)), prefix + "num_oversized": float(len(self.oversized))}
        stats = {"samples": samples, "tokens": tokens}
        for name, values in stats.items():
            out[f"{prefix}{name}_min"] = float(values.min()) if len(values) else 0.0
            out[f"{prefix}{name}_mean"] = float(values.mean()) if len(values) else 0.0
            out[f"{prefix}{name}_max"] = float(values.max()) if len(values) else 0.0
        if self.max_token_len is not None:
            util = tokens / self.max_token_len
            out[prefix + "budget_utilisation_min"] = float(util.min()) if len(util) else 0.0
            out[prefix + "budget_utilisation_median"] = float(np.median(util)) if len(util) else 0.0
        out[prefix + "padding_ratio"] = float(1.0 - tokens.sum() / padded) if padded else 0.0
        return out


def _checked_lengths(lengths: Sequence[int] | np.ndarray, min_num: int, multiple_of: int) -> np.ndarray:
    lens = np.asarray(lengths, dtype=np.int64)
    if lens.ndim != 1 or (lens < 0).any():
        raise ValueError("lengths must be a 1-D sequence of non-negative token counts")
    if min_num < 1 or multiple_of < 1:
        raise ValueError("min_num_micro_batches and num_micro_batches_multiple_of must be >= 1")
    return lens


def _agreed_count(local_k: int, min_num: int, multiple_of: int, group: Any) -> int:
    """max(local_k, min_num) agreed over ``group`` (the largest), rounded up to a multiple of ``multiple_of``."""
    k = agree_num_micro_batches(max(local_k, min_num), group)
    return math.ceil(k / multiple_of) * multiple_of


def plan_micro_batches(
    lengths: Sequence[int] | np.ndarray,
    max_token_len: int,
    *,
    min_num_micro_batches: int = 1,
    num_micro_batches_multiple_of: int = 1,
    group: Any = None,
    estimate: Workload = "tokens",
    hidden_size: int = 4096,
) -> MicroBatchPlan:
    """Split one rank's batch into micro-batches of at most ``max_token_len`` tokens (module docstring).

    Args:
        lengths: token count of each sequence (prompt + response, i.e. the attention-mask sums).
        max_token_len: the budget per micro-batch (``ppo_max_token_len_per_gpu`` for training,
            ``log_prob_max_token_len_per_gpu`` for forward-only passes).
        min_num_micro_batches: lower bound on the count (e.g. the pipeline depth).
        num_micro_batches_multiple_of: round the agreed count up to a multiple of this (the
            interleaved pipeline schedule needs a multiple of the pipeline size).
        group: data-parallel process group to agree the count over; None for a single process.
        estimate, hidden_size: workload estimate balanced across micro-batches (see :func:`workload`).
    """
    lens = _checked_lengths(lengths, min_num_micro_batches, num_micro_batches_multiple_of)
    if max_token_len <= 0:
        raise ValueError(f"max_token_len must be > 0, got {max_token_len}")
    weights = workload(lens, estimate, hidden_size)
    oversized = np.flatnonzero(lens > max_token_len)
    rest = np.flatnonzero(lens <= max_token_len)
    rest_min = max(0, min_num_micro_batches - len(oversized))
    local_parts = _min_feasible(lens[rest], weights[rest], max_token_len, max(rest_min, 1)) if len(rest) else []
    local_k = len(local_parts) + len(oversized)
    k = _agreed_count(local_k, min_num_micro_batches, num_micro_batches_multiple_of, group)
    target = k - len(oversized)
    if target > len(local_parts) and len(rest):
        parts = _feasible_partition(lens[rest], weights[rest], max_token_len, target)
        local_parts = parts if parts is not None else _split_to(local_parts, weights[rest], target)
    micro = [rest[p].tolist() for p in local_parts] + [[int(i)] for i in oversized]
    micro += [[] for _ in range(k - len(micro))]
    return MicroBatchPlan(order_for_pipeline(micro, weights), lens, max_token_len, oversized.tolist())


def plan_fixed_micro_batches(
    lengths: Sequence[int] | np.ndarray,
    micro_batch_size: int,
    *,
    min_num_micro_batches: int = 1,
    num_micro_batches_multiple_of: int = 1,
    group: Any = None,
) -> MicroBatchPlan:
    """Micro-batches of at most ``micro_batch_size`` sequences (``use_dynamic_bsz=False``), in row order.

    The count is k = max(⌈n / micro_batch_size⌉, ``min_num_micro_batches``) for the rank's n sequences,
    agreed over ``group`` (the largest, as :func:`plan_micro_batches` does) and rounded up to a multiple
    of ``num_micro_batches_multiple_of``; the rows are dealt into k consecutive runs whose sizes differ
    by at most one (so none exceeds ``micro_batch_size``). Runs beyond a rank's rows are empty.
    """
    lens = _checked_lengths(lengths, min_num_micro_batches, num_micro_batches_multiple_of)
    if micro_batch_size <= 0:
        raise ValueError(f"micro_batch_size must be > 0, got {micro_batch_size}")
    k = _agreed_count(math.ceil(len(lens) / micro_batch_size), min_num_micro_batches, num_micro_batches_multiple_of,
                      group)
    runs = [run.tolist() for run in np.array_split(np.arange(len(lens)), k)]
    return MicroBatchPlan(runs, lens, None, [])


def refine_by_swaps(weights: np.ndarray, parts: list[list[int]], max_swaps: int | None = None) -> list[list[int]]:
    """Lower the heaviest part's weight by one-for-one item swaps (part sizes are unchanged).

    Each round takes the heaviest part H and, trying the other parts from the lightest up, the
    first part L with items ``a`` in H, ``b`` in L such that swapping them brings both sums below
    ``sum(H)``; it picks the ``b`` closest to ``w_a - (sum(H) - sum(L)) / 2`` for every ``a``
    (a sorted search) and keeps the best. It stops when no part admits such a swap, or after
    ``max_swaps`` rounds (default ``4·len(weights)``). Equal-size Karmarkar–Karp can be far off
    on heavy-tailed lengths with few items per part (the top group of k items is merged into
    parts whose other items are not the lightest); this repairs it cheaply.
    """
    parts = [list(p) for p in parts]
    sums = np.array([weights[p].sum() for p in parts], dtype=np.float64)
    for _ in range(4 * len(weights) if max_swaps is None else max_swaps):
        h = int(sums.argmax())
        heavy = np.asarray(parts[h], dtype=np.int64)
        swapped = False
        for light in np.argsort(sums, kind="stable"):
            gap = sums[h] - sums[light]
            if light == h or gap <= 0:
                break
            if not parts[light]:
                continue
            cand = np.asarray(parts[light], dtype=np.int64)
            cand_w = weights[cand]
            order = np.argsort(cand_w, kind="stable")
            wanted = weights[heavy] - gap / 2  # the b that would equalise the two sums, per a
            pos = np.searchsorted(cand_w[order], wanted)
            best_gain, best = 0.0, None
            for step in (pos - 1, pos):  # the two neighbours of the ideal b
                b = order[np.clip(step, 0, len(order) - 1)]
                delta = weights[heavy] - cand_w[b]  # weight moved from H to L
                new_max = np.maximum(sums[h] - delta, sums[light] + delta)
                j = int(new_max.argmin())
                if sums[h] - new_max[j] > best_gain + 1e-9:
                    best_gain, best = sums[h] - new_max[j], (j, int(b[j]), float(delta[j]))
            if best is not None:
                a_pos, b_pos, delta = best
                parts[h][a_pos], parts[light][b_pos] = parts[light][b_pos], parts[h][a_pos]
                sums[h] -= delta
                sums[light] += delta
                swapped = True
                break
        if not swapped:
            break
    return [sorted(p) for p in parts]


def balance_batch(
    lengths: Sequence[int] | np.ndarray, world_size: int, *, estimate: Workload = "tokens", hidden_size: int = 4096
) -> list[list[int]]:
    """Equal-count split of a batch over ``world_size`` data-parallel ranks balancing the workload
    (``trainer.balance_batch``): equal-size Karmarkar–Karp, then :func:`refine_by_swaps`.
    Returns each rank's indices, ascending.

    Raises:
        ValueError: the batch size is not a multiple of ``world_size``.
    """
    lens = np.asarray(lengths, dtype=np.int64)
    if world_size < 1 or len(lens) % world_size:
        raise ValueError(
            f"cannot balance {len(lens)} sequences over {world_size} data-parallel ranks with equal counts; "
            f"make train_batch_size * rollout.n a multiple of the data-parallel size"
        )
    weights = workload(lens, estimate, hidden_size)
    return refine_by_swaps(weights, karmarkar_karp(weights, world_size, equal_size=True))


def imbalance(weights: Sequence[float] | np.ndarray, parts: list[list[int]]) -> float:
    """Heaviest part's weight over the mean part weight (1.0 = perfect balance)."""
    w = np.asarray(weights, dtype=np.float64)
    sums = np.array([w[p].sum() for p in parts])
    return float(sums.max() / sums.mean()) if sums.mean() > 0 else 1.0
