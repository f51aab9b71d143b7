"""Worker processes kept between the runs of one Python process: a notebook, a sweep, a test session.

A run's worker group is a set of Ray actors in a placement group; starting one costs a process and the imports of
torch, Megatron and vLLM, which on a 2-core CPU machine are most of a small run's start (an actor's process and
imports ~6 s, most of the ~6 s of its engine's start is vLLM importing too). Inside ``keep_workers()``, a run that
ends normally hands its groups here instead of killing them: every rank releases what the run built
(``RankWorker.release``: engine, models, optimizer, process groups) and waits in its placement group. The next run
of the process that asks for a group of the same shape takes it and binds it to its own config (``rebind``); any
other shape starts new actors as before.

Contract:
- A group is kept only after a run that returned normally and a release every rank reports as complete; a run
  that failed or was interrupted kills its groups as without a pool, as does a rank whose release raises or that
  holds what it cannot reset (``RankWorker.release`` says which).
- The shape (``PoolKey``): the worker class, the ranks, each rank's CPUs and GPUs, the environment variables the
  actors were started with, the Python executable, and whether the run routes the workers' output to its logs
  folder. A kept group serves the next run of that shape only; ``rebind`` points its output at the new run's logs.
- At most ``max_idle`` idle processes (ranks) are kept, the oldest groups killed first; a group of the class a run
  asks for in another shape is killed at once (its placement group would hold the CPUs the new shape needs).
- Leaving ``keep_workers()`` kills every idle group. Without it nothing is kept: the command-line run, and every
  run by default.
"""

from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from meshrl.workers.group import WorkerGroup


@dataclass(frozen=True)
class PoolKey:
    """The shape of a worker group (module docstring): what must match for a kept group to serve a run."""

    worker_class: str
    world_size: int
    num_cpus: float
    num_gpus: float
    env_vars: tuple[tuple[str, str], ...]
    py_executable: str | None
    routed_output: bool


class WorkerPool:
    """Idle worker groups by shape (module docstring); thread-safe (a run starts its groups on threads)."""

    def __init__(self, max_idle: int) -> None:
        if max_idle < 1:
            raise ValueError(f"keep_workers(max_idle={max_idle}): keep at least one process")
        self.max_idle = max_idle
        self._idle: OrderedDict[int, tuple[PoolKey, WorkerGroup]] = OrderedDict()  # oldest first
        self._lock = threading.Lock()
        self.taken = 0  # groups served from the pool (what a caller can check, as the tests do)

    def take(self, key: PoolKey) -> WorkerGroup | None:
        """A kept group of ``key``'s shape (the most recently kept), or None; kept groups of the same class in
        another shape are killed."""
        with self._lock:
            match = next((i for i, (k, _) in reversed(self._idle.items()) if k == key), None)
            group = self._idle.pop(match)[1] if match is not None else None
            stale = [i for i, (k, _) in self._idle.items() if k.worker_class == key.worker_class]
            doomed = [self._idle.pop(i)[1] for i in stale]
            self.taken += group is not None
        for old in doomed:
            old.shutdown()
        return group

    def give(self, key: PoolKey, group: WorkerGroup) -> None:
        """Keep ``group`` (released by its ranks) for a later run of ``key``'s shape; the oldest kept groups are
        killed while more than ``max_idle`` processes would wait."""
        with self._lock:
            self._idle[id(group)] = (key, group)
            doomed = []
            while self._idle and sum(k.world_size for k, _ in self._idle.values()) > self.max_idle:
                doomed.append(self._idle.popitem(last=False)[1][1])
        for old in doomed:
            old.shutdown()

    def idle_processes(self) -> int:
        with self._lock:
            return sum(k.world_size for k, _ in self._idle.values())

    def close(self) -> None:
        """Kill every idle group."""
        with self._lock:
            groups = [group for _, group in self._idle.values()]
            self._idle.clear()
        for group in groups:
            group.shutdown()


_active: WorkerPool | None = None


def active_pool() -> WorkerPool | None:
    """The pool of the innermost ``keep_workers()`` of this process, or None."""
    return _active


@contextlib.contextmanager
def keep_workers(max_idle: int = 4) -> Iterator[WorkerPool]:
    """Keep the worker groups of the runs inside (``meshrl.trainer.main.run`` in a Python process that started Ray
    itself) for the later runs of the same shape; at most ``max_idle`` idle worker processes (each holds the
    imported libraries: ~1 GiB of host memory on CPU). Every idle group is killed on leaving.

    Example (a notebook)::

        import ray
        from meshrl.trainer.main import run
        from meshrl.workers.pool import keep_workers

        ray.init()
        with keep_workers():
            for lr in (1e-6, 3e-6):
                run(load_config([...] + [f"actor_rollout_ref.actor.optim.lr={lr}"]))
    """
    global _active
    outer, pool = _active, WorkerPool(max_idle)
    _active = pool
    try:
        yield pool
    finally:
        _active = outer
        pool.close()
