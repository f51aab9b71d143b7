"""This process's host memory: what is resident, its peak, and how freed tensors go back to the system.

Resident memory (Linux ``/proc/self/status``): ``rss_bytes()`` now, ``peak_rss_bytes()`` the high-water mark
since the process started or since ``reset_peak_rss()`` (``VmHWM``; resetting writes "5" to
``/proc/self/clear_refs``). Where ``/proc`` lacks them these raise ``OSError``.

**Freed tensors back to the system** (``limit_heap_growth``). torch allocates CPU tensors with glibc's
``malloc``. glibc serves a request of at least the *mmap threshold* with its own ``mmap``, which ``free`` returns
to the system at once; smaller ones come from the heap, which shrinks only from its top. The threshold starts at
128 KiB but is *dynamic*: freeing an mmapped block raises it to that block's size (up to 32 MiB on 64-bit). After
the first freed activation, a training process therefore serves every tensor up to 32 MiB from the heap, and the
heap keeps the high-water mark of the update's activations resident for the rest of the run: the next rollout,
the weight sync, the next update all start from it. Setting the threshold with ``mallopt`` fixes it (glibc then
never moves it), so those tensors are mmapped and their pages leave with them.

The price is page faults: an mmapped tensor's pages are zeroed by the kernel on first touch, every time. To make
them fewer, worker processes start with glibc's ``glibc.malloc.hugetlb=1`` tunable (``allocator_environment``:
``madvise`` of transparent huge pages on what malloc maps, where the kernel's THP mode is ``madvise`` or
``always``), so a 2 MiB page faults in once instead of 512 4 KiB pages. A tunable is read when a process starts,
so it is passed in the environment of the processes meshrl starts; a ``glibc.malloc.hugetlb`` the user sets in
``GLIBC_TUNABLES`` wins.

Measured on vs_trl's meshrl side (``python -m bench.vs_trl --dtype fp32 --sides meshrl --steps 3``, SmolLM2-135M,
2 cores; one run each, a noisy machine, figures in ``bench/README.md``): the whole run's peak RSS 7.6 GiB with the
fixed threshold, 9.9-10.0 GiB with glibc's dynamic one, 11.15 GiB before meshrl set either (and before the CPU
engine's level-2 sleep). The fixed threshold's update then took a quarter to a third longer than the dynamic one's;
most of its page faults were the packed attention's per-slot slices, whose backward allocated a zero tensor of the
whole packed size per slot (38 GB per update). Cut with one ``split`` instead, the update under the fixed threshold
is 3% slower than under the dynamic one for 3.2 GiB less at its peak (``python -m bench.allocator``: 44.2 vs 43.0 s,
1.74M vs 0.09M faults, +6.43 vs +9.60 GiB; 54.5 s and 4.23M faults before the change).

``MESHRL_MALLOC_MMAP_THRESHOLD`` (bytes, or ``dynamic`` for glibc's own behaviour) overrides the default
(``DEFAULT_MMAP_THRESHOLD``); anything else is refused. Not glibc (musl, macOS): nothing to set, a no-op.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
from typing import Callable, Mapping, ParamSpec, TypeVar

P = ParamSpec("P")
R = TypeVar("R")

ENV_MMAP_THRESHOLD = "MESHRL_MALLOC_MMAP_THRESHOLD"
DEFAULT_MMAP_THRESHOLD = 1 << 20
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number (malloc.h)
_MAX_MMAP_THRESHOLD = 32 << 20  # glibc's HEAP_MAX/2 on 64-bit: mallopt refuses more
TUNABLES = "GLIBC_TUNABLES"
HUGE_PAGES_TUNABLE = "glibc.malloc.hugetlb"


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise OSError(f"/proc/self/status has no {field} line")


def rss_bytes() -> int:
    """This process's resident memory now (``VmRSS``)."""
    return _status_bytes("VmRSS")


def peak_rss_bytes() -> int:
    """This process's peak resident memory since it started or since ``reset_peak_rss()`` (``VmHWM``)."""
    return _status_bytes("VmHWM")


def reset_peak_rss() -> None:
    """Start a new peak: ``VmHWM`` becomes the current ``VmRSS``."""
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")


def mmap_threshold_setting() -> int | None:
    """The threshold ``limit_heap_growth`` sets: ``MESHRL_MALLOC_MMAP_THRESHOLD`` or the default; None: ``dynamic``.

    Raises:
        ValueError: the variable is neither ``dynamic`` nor a byte count in [4096, 32 MiB].
    """
    raw = os.environ.get(ENV_MMAP_THRESHOLD, "").strip()
    if not raw:
        return DEFAULT_MMAP_THRESHOLD
    if raw.lower() == "dynamic":
        return None
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if not 4096 <= value <= _MAX_MMAP_THRESHOLD:
        raise ValueError(f"{ENV_MMAP_THRESHOLD}={raw!r}: give a byte count from 4096 to {_MAX_MMAP_THRESHOLD} "
                         "(glibc's limit), or 'dynamic' to keep glibc's own threshold")
    return value


def limit_heap_growth() -> int | None:
    """Fix glibc's mmap threshold for this process (module docstring); the threshold set, or None (``dynamic``, or
    not glibc). Call it before the process allocates its models: blocks already in the heap stay there.

    Raises:
        ValueError: a bad ``MESHRL_MALLOC_MMAP_THRESHOLD`` (``mmap_threshold_setting``).
        OSError: glibc refused the value.
    """
    threshold = mmap_threshold_setting()
    if threshold is None or not set_mmap_threshold(threshold):
        return None
    return threshold


def set_mmap_threshold(threshold: int) -> bool:
    """Fix glibc's mmap threshold at ``threshold`` bytes for this process; False where this is not glibc.

    Raises:
        OSError: glibc refused the value.
    """
    libc = _glibc()
    if libc is None:
        return False
    if libc.mallopt(_M_MMAP_THRESHOLD, threshold) != 1:
        raise OSError(f"glibc's mallopt(M_MMAP_THRESHOLD, {threshold}) failed")
    return True


def allocator_environment(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The environment a worker process starts with for its allocator: ``GLIBC_TUNABLES`` with
    ``glibc.malloc.hugetlb=1`` added to what ``environ`` has (module docstring), or as it is where it names
    ``glibc.malloc.hugetlb`` already (the user's choice)."""
    tunables = [t for t in environ.get(TUNABLES, "").split(":") if t]
    if not any(t.split("=", 1)[0] == HUGE_PAGES_TUNABLE for t in tunables):
        tunables.append(f"{HUGE_PAGES_TUNABLE}=1")
    return {TUNABLES: ":".join(tunables)}


def trim_heap() -> bool:
    """Return the heap's free pages to the system (glibc's ``malloc_trim(0)``: its top, and whole free pages inside
    it); whether glibc released any. Not glibc: False."""
    libc = _glibc()
    return bool(libc.malloc_trim(0)) if libc is not None else False


def trims_heap(phase: Callable[P, R]) -> Callable[P, R]:
    """Decorator for a worker's phase (a rollout, a log-prob pass, an update, a sync): ``trim_heap()`` when it returns,
    so the tensors below the mmap threshold that it freed are not resident in the next phase. (A phase that raises
    is not trimmed: its frame, and so its tensors, live on in the traceback.)"""
    @functools.wraps(phase)
    def run(*args: P.args, **kwargs: P.kwargs) -> R:
        result = phase(*args, **kwargs)
        trim_heap()
        return result

    return run


@functools.cache  # find_library runs ldconfig: once per process, not once per phase
def _glibc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    return libc if libc is not None and hasattr(libc, "gnu_get_libc_version") else None
