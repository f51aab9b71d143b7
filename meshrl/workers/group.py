"""``WorkerGroup``: N Ray actors of one worker class, placed together and driven as one.

Contract:
- The actors live in one placement group (one bundle per rank). A group that cannot be placed fails
  after ``timeout_s`` with a message naming the resources asked for, instead of pending forever.
- ``call(method, ...)`` runs ``method`` on every rank and returns the per-rank results in rank order.
  Results are gathered with ``ray.wait`` one at a time: the first rank that raises or dies fails the
  call at once, naming the rank — surviving ranks may be blocked in a collective and would otherwise
  hold the driver until the process-group timeout. ``shutdown()`` kills every actor of the group.
- ``call_per_rank(method, args_per_rank)`` sends rank i its own arguments (e.g. its data shard);
  large arguments should be ``ray.put`` once and passed as object refs, so TP ranks that need the
  same shard share one copy.
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy


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
        init_kwargs: dict[str, Any] | None = None,
    ) -> None:
        self.name = name
        self.world_size = world_size
        self.timeout_s = timeout_s
        bundle = {"CPU": num_cpus_per_worker}
        if num_gpus_per_worker:
            bundle["GPU"] = num_gpus_per_worker
        self._pg = placement_group([dict(bundle) for _ in range(world_size)], strategy="PACK")
        try:
            ray.get(self._pg.ready(), timeout=timeout_s)
        except GetTimeoutError:
            remove_placement_group(self._pg)
            raise WorkerError(
                f"{name}: could not place {world_size} workers of {bundle} within {timeout_s:.0f} s; the cluster "
                f"has {ray.cluster_resources()}. Lower trainer.n_gpus_per_node / trainer.nnodes or add resources."
            ) from None
        remote_cls = ray.remote(worker_cls)
        self.workers = [
            remote_cls.options(
                num_cpus=num_cpus_per_worker,
                num_gpus=num_gpus_per_worker,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self._pg, placement_group_bundle_index=rank),
                runtime_env={"env_vars": dict(env_vars or {})},
                name=f"{name}-{rank}-{id(self):x}",
                max_concurrency=1,
            ).remote(rank=rank, world_size=world_size, **(init_kwargs or {}))
            for rank in range(world_size)
        ]

    def call(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """``method(*args, **kwargs)`` on every rank; results in rank order (fails fast, see module doc)."""
        return self.gather([getattr(w, method).remote(*args, **kwargs) for w in self.workers], method)

    def call_per_rank(self, method: str, args_per_rank: Sequence[tuple], **kwargs: Any) -> list[Any]:
        """Rank i runs ``method(*args_per_rank[i], **kwargs)``."""
        if len(args_per_rank) != self.world_size:
            raise ValueError(f"{self.name}.{method}: {len(args_per_rank)} argument sets for {self.world_size} ranks")
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
                raise WorkerError(f"{self.name}.{method}: ranks {stuck} did not answer within "
                                  f"{self.timeout_s:.0f} s (trainer.worker_timeout_s)")
            ref = done[0]
            rank = rank_of[ref]
            try:
                results[rank] = ray.get(ref)
            except RayActorError as exc:
                raise WorkerError(f"{self.name} rank {rank} died during {method}: {_first_line(exc)}") from exc
            except RayTaskError as exc:
                cause = exc.cause if getattr(exc, "cause", None) is not None else exc
                raise WorkerError(f"{self.name} rank {rank} failed in {method}: "
                                  f"{type(cause).__name__}: {cause}") from cause
        return results

    def shutdown(self) -> None:
        for worker in self.workers:
            ray.kill(worker, no_restart=True)
        remove_placement_group(self._pg)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
