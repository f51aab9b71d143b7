"""``WorkerGroup``: N Ray actors of one worker class, placed together and driven as one.

Contract:
- The actors live in one placement group (one bundle per rank). A group that cannot be placed fails
  after ``timeout_s`` with a message naming the resources asked for, instead of pending forever.
- ``call(method, ...)`` runs ``method`` on every rank and returns the per-rank results in rank order.
  Results are gathered with ``ray.wait`` one at a time. The first rank that raises or dies, or ranks
  that do not answer within ``timeout_s``, fail the call with a ``WorkerError`` naming the rank; a
  rank that died is named rather than the peers whose collectives failed because of it (those
  errors are given ``DEATH_REPORT_GRACE_S`` to arrive). Before raising, every actor of the group is
  killed: the surviving ranks may be blocked in a collective with the failed one and would otherwise
  keep their processes and memory until the process-group timeout. The group is then stopped: later
  calls raise a ``WorkerError`` naming that first failure.
- ``call_per_rank(method, args_per_rank)`` sends rank i its own arguments (e.g. its data shard);
  large arguments should be ``ray.put`` once and passed as object refs, so TP ranks that need the
  same shard share one copy.
- ``shutdown()`` kills every actor of the group and releases its placement group.
- ``make_room``: called once when the group is not placed within ``PLACEMENT_GRACE_S`` (the worker pool's idle
  groups then go), before the rest of ``timeout_s``.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy


# A rank that dies makes its peers' collectives fail at once ("Connection closed by peer"), and those
# errors can reach the driver before Ray reports the death itself: after a rank raises, the others get
# this long to report, so that the message names the rank that died rather than a peer that saw it go.
DEATH_REPORT_GRACE_S = 2.0
# A group that cannot be placed within this long while ``make_room`` is given calls it (free placement normally
# takes well under 0.1 s), then waits the rest of its timeout.
PLACEMENT_GRACE_S = 2.0


class WorkerError(RuntimeError):
    """A worker raised or died; the message names the group and rank."""


class WorkerGroup:
    def __init__(
        self,
        worker_cls: type,
        world_size: int,
        *,
        name: str,
        num_cpus_per_worker: float = 1,
        num_gpus_per_worker: float = 0,
        timeout_s: float = 600.0,
        env_vars: dict[str, str] | None = None,
        py_executable: str | None = None,
        init_kwargs: dict[str, Any] | None = None,
        make_room: Callable[[], None] | None = None,
    ) -> None:
        self.name = name
        self.world_size = world_size
        self.timeout_s = timeout_s
        self._failure: str | None = None
        bundle = {"CPU": num_cpus_per_worker}
        if num_gpus_per_worker:
            bundle["GPU"] = num_gpus_per_worker
        self._pg = placement_group([dict(bundle) for _ in range(world_size)], strategy="PACK")
        waited = 0.0
        if make_room is not None:  # idle kept workers may hold the resources (meshrl.workers.pool)
            try:
                ray.get(self._pg.ready(), timeout=min(PLACEMENT_GRACE_S, timeout_s))
            except GetTimeoutError:
                make_room()
                waited = PLACEMENT_GRACE_S
        try:
            ray.get(self._pg.ready(), timeout=max(0.0, timeout_s - waited))
        except GetTimeoutError:
            remove_placement_group(self._pg)
            raise WorkerError(
                f"{name}: could not place {world_size} workers of {bundle} within {timeout_s:.0f} s; the cluster "
                f"has {ray.cluster_resources()}. Lower trainer.n_gpus_per_node / trainer.nnodes or add resources."
            ) from None
        # Ray merges an actor's env_vars with the job's (its other fields replace the job's).
        runtime_env: dict[str, Any] = {"env_vars": dict(env_vars or {})}
        if py_executable is not None:
            runtime_env["py_executable"] = py_executable
        remote_cls = ray.remote(worker_cls)
        self.workers = [
            remote_cls.options(
                num_cpus=num_cpus_per_worker,
                num_gpus=num_gpus_per_worker,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self._pg, placement_group_bundle_index=rank),
                runtime_env=runtime_env,
                name=f"{name}-{rank}-{id(self):x}",
                max_concurrency=1,
            ).remote(rank=rank, world_size=world_size, **(init_kwargs or {}))
            for rank in range(world_size)
        ]

    def call(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """``method(*args, **kwargs)`` on every rank; results in rank order (fails fast, see module doc)."""
        self._check_running()
        return self.gather([getattr(w, method).remote(*args, **kwargs) for w in self.workers], method)

    def call_per_rank(self, method: str, args_per_rank: Sequence[tuple], **kwargs: Any) -> list[Any]:
        """Rank i runs ``method(*args_per_rank[i], **kwargs)``."""
        if len(args_per_rank) != self.world_size:
            raise ValueError(f"{self.name}.{method}: {len(args_per_rank)} argument sets for {self.world_size} ranks")
        self._check_running()
        refs = [getattr(w, method).remote(*a, **kwargs) for w, a in zip(self.workers, args_per_rank)]
        return self.gather(refs, method)

    def gather(self, refs: list[ray.ObjectRef], method: str) -> list[Any]:
        rank_of = {ref: rank for rank, ref in enumerate(refs)}
        results: list[Any] = [None] * len(refs)
        pending = list(refs)
        deadline = time.monotonic() + self.timeout_s
        while pending:
            done, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not done:
                stuck = sorted(rank_of[r] for r in pending)
                raise self._stop(f"{self.name}.{method}: ranks {stuck} did not answer within "
                                 f"{self.timeout_s:.0f} s (trainer.worker_timeout_s)")
            ref = done[0]
            try:
                results[rank_of[ref]] = ray.get(ref)
            except (RayActorError, RayTaskError) as exc:
                failed = {rank_of[ref]: exc}
                if isinstance(exc, RayTaskError) and pending:
                    reported, _ = ray.wait(pending, num_returns=len(pending), timeout=DEATH_REPORT_GRACE_S)
                    failed.update(_failures(reported, rank_of))
                first = self._first_failure(failed)
                raise self._stop(self._describe(first, failed, method)) from _cause(failed[first])
        return results

    @staticmethod
    def _first_failure(failed: dict[int, Exception]) -> int:
        """The rank that died (the lowest, if several), else the first to raise."""
        died = [rank for rank, exc in failed.items() if isinstance(exc, RayActorError)]
        return min(died) if died else next(iter(failed))

    def _describe(self, first: int, failed: dict[int, Exception], method: str) -> str:
        exc = failed[first]
        if isinstance(exc, RayActorError):
            message = f"{self.name} rank {first} died during {method}: {_first_line(exc)}"
        else:
            cause = _cause(exc)
            message = f"{self.name} rank {first} failed in {method}: {type(cause).__name__}: {cause}"
        others = sorted(rank for rank in failed if rank != first)
        return message + (f" (then ranks {others} failed too)" if others else "")

    def _stop(self, message: str) -> WorkerError:
        """Kill every actor (see the module doc) and remember ``message``; returns the error to raise."""
        self._kill_workers()
        self._failure = message
        return WorkerError(message)

    def _check_running(self) -> None:
        if self._failure is not None:
            raise WorkerError(f"{self.name} was stopped after an earlier failure: {self._failure}")

    def _kill_workers(self) -> None:
        for worker in self.workers:
            ray.kill(worker, no_restart=True)

    def shutdown(self) -> None:
        self._kill_workers()
        remove_placement_group(self._pg)


def _failures(refs: list[ray.ObjectRef], rank_of: dict[ray.ObjectRef, int]) -> dict[int, Exception]:
    """The ranks among the finished ``refs`` that died or raised, with their errors."""
    failed = {}
    for ref in refs:
        try:
            ray.get(ref)
        except (RayActorError, RayTaskError) as exc:
            failed[rank_of[ref]] = exc
    return failed


def _cause(exc: Exception) -> BaseException:
    """The worker's own exception inside a ``RayTaskError``; ``exc`` itself otherwise."""
    cause = getattr(exc, "cause", None) if isinstance(exc, RayTaskError) else None
    return cause if cause is not None else exc


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
