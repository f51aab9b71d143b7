"""The memory an update used, as step metrics (verl's ``perf/`` names where verl logs them).

``update_memory(metrics)`` wraps one update and adds, each the maximum over the group's ranks:

- ``perf/max_memory_allocated_gb`` / ``perf/max_memory_reserved_gb`` (CUDA ranks): the caching allocator's peaks
  during the update (its peak statistics are reset when the update starts), as verl's actor logs them;
- ``perf/cpu_memory_used_gb``: the machine's used memory when the update ends (``psutil.virtual_memory().used``),
  as verl's;
- ``perf/max_rss_gb`` (meshrl's, every device): the rank process's peak resident memory during the update
  (``meshrl.process_memory``: ``VmHWM``, reset when the update starts). On CPU this is the update's memory: model,
  optimizer state, activations and the colocated engine, all in host memory. Absent where ``/proc`` cannot reset it.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

GIB = 1024**3


@contextlib.contextmanager
def update_memory(metrics: dict[str, float]) -> Iterator[None]:
    """Measure the enclosed update; its figures are added to ``metrics`` (a collective: every rank must enter)."""
    import psutil
    import torch
    import torch.distributed as dist

    from meshrl import process_memory
    from meshrl.collectives import collective_device

    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    try:
        process_memory.reset_peak_rss()
        rss = True
    except OSError:
        rss = False
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    yield
    peaks = torch.tensor([process_memory.peak_rss_bytes() if rss else -1,
                          torch.cuda.max_memory_allocated() if cuda else -1,
                          torch.cuda.max_memory_reserved() if cuda else -1],
                         dtype=torch.float64, device=collective_device())
    dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
    names = ("perf/max_rss_gb", "perf/max_memory_allocated_gb", "perf/max_memory_reserved_gb")
    metrics.update({name: value / GIB for name, value in zip(names, peaks.tolist()) if value >= 0})
    metrics["perf/cpu_memory_used_gb"] = psutil.virtual_memory().used / GIB
