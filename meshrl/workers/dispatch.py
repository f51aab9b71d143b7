"""Driver-side handle of a group of rank workers: start them, split batches across them, collect results.

Data-parallel dispatch (``by="dp"``): the batch is split into ``dp_size`` shards — balanced by token
workload with equal sizes when ``trainer.balance_batch`` — every rank gets its replica's shard (the
TP/PP ranks of one replica share one object-store copy), and the results of the collecting rank of
each replica are concatenated and put back into the batch's original row order.
Rollout dispatch (``by="replica"``): the same over inference replicas (``rollout.tensor_model_parallel_size``
consecutive ranks form one).

Ray is imported where it is used, not with this module: the worker classes beside the handles that
subclass ``DispatchGroup`` then import without Ray, for in-process use on machines that lack it
(``tests/workers/worker_checks.py``, ``bench/gpu.py``).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from meshrl.config.run_plan import RunPlan
from meshrl.config.validate import world_size
from meshrl.data.dynamic_batching import balance_batch
from meshrl.process_memory import allocator_environment
from meshrl.protocol import Batch
from meshrl.workers.pool import PoolKey, active_pool
from meshrl.workers.sequences import sequence_lengths


# runtime_env fields meshrl passes to Ray. The others (pip, conda, uv, working_dir, py_modules,
# container, ...) would give the workers another environment than the driver's, which meshrl's workers
# do not support: they import meshrl and its engines from the driver's virtualenv.
RUNTIME_ENV_FIELDS = ("env_vars", "py_executable")


def runtime_env_problems(cfg: DictConfig) -> list[str]:
    """What of verl's ``ray_kwargs.ray_init.runtime_env`` the workers cannot take: a field other than
    ``RUNTIME_ENV_FIELDS``, or ``env_vars`` that is not a mapping."""
    prefix = "ray_kwargs.ray_init.runtime_env"
    runtime_env = OmegaConf.to_container(cfg.ray_kwargs.ray_init.runtime_env, resolve=True)
    problems = [f"{prefix}.{key}: meshrl's Ray workers run in the driver's Python environment and take only "
                f"{', '.join(RUNTIME_ENV_FIELDS)} from runtime_env; install what the run needs into meshrl's "
                "virtualenv and drop the key." for key in sorted(set(runtime_env) - set(RUNTIME_ENV_FIELDS))]
    env_vars = runtime_env.get("env_vars") or {}
    if not isinstance(env_vars, dict):
        problems.append(f"{prefix}.env_vars: must map names to values, got {env_vars!r}")
    return problems


def worker_runtime_env(cfg: DictConfig) -> dict[str, Any]:
    """The Ray ``runtime_env`` every worker of the run gets from verl's ``ray_kwargs.ray_init.runtime_env`` (which
    ``runtime_env_problems`` has passed): its ``env_vars`` (values as text) and ``py_executable``; empty when it
    sets neither."""
    runtime_env = OmegaConf.to_container(cfg.ray_kwargs.ray_init.runtime_env, resolve=True)
    env: dict[str, Any] = {}
    env_vars = runtime_env.get("env_vars") or {}
    if env_vars:
        # Overrides parse values as YAML: `X=true` arrives as a bool, and is meant as the text "true".
        env["env_vars"] = {str(name): str(value).lower() if isinstance(value, bool) else str(value)
                           for name, value in env_vars.items()}
    if runtime_env.get("py_executable") is not None:
        env["py_executable"] = str(runtime_env["py_executable"])
    return env


def groups_per_rank(plan: RunPlan) -> int:
    """Worker processes per training rank: the policy's, plus the critic's and the reward model's when the run
    has them."""
    return 1 + plan.use_critic + plan.use_reward_model


def use_cuda(cfg: DictConfig) -> bool:
    if cfg.trainer.device == "cpu":
        return False
    import ray

    available = torch.cuda.is_available() or bool(ray.cluster_resources().get("GPU"))
    if cfg.trainer.device == "cuda" and not available:
        raise RuntimeError("trainer.device=cuda but no GPU is visible; use trainer.device=cpu or auto")
    return available


class DispatchGroup:
    """Start ``world_size(cfg)`` workers of ``worker_cls``, each given its role's config section
    (``worker_cls.SECTION``) and the run plan, and set them up (``setup(address, **setup_kwargs)``)."""

    def __init__(self, worker_cls: type, cfg: DictConfig, plan: RunPlan, model_dir,
                 setup_kwargs: dict[str, Any] | None = None) -> None:
        import ray

        from meshrl.workers.group import WorkerGroup

        self.cfg = cfg
        self.plan = plan
        world = world_size(cfg)
        cuda = use_cuda(cfg)
        # On CPU the machine's cores are shared out between the ranks (Ray would pin each to 1 thread).
        threads = max(1, (os.cpu_count() or 1) // world) if not cuda else 4
        # The critic and reward-model groups share each device with the policy group (colocated, a share each).
        groups_per_device = groups_per_rank(plan)
        # The run's runtime_env in the actors' own options: it then applies in a Ray this run did not start too.
        run_env = worker_runtime_env(cfg)
        env_vars = {"OMP_NUM_THREADS": str(threads), "MESHRL_THREADS": str(threads), **allocator_environment(),
                    **{k: v for k, v in os.environ.items() if k.startswith(("MESHRL_", "VLLM_", "TORCHDYNAMO"))},
                    **run_env.get("env_vars", {})}
        num_gpus = 1 / groups_per_device if cuda else 0
        init_kwargs = {"section": OmegaConf.to_container(cfg[worker_cls.SECTION], resolve=True),
                       "model_dir": str(model_dir), "plan": plan}
        self._pool_key = PoolKey(f"{worker_cls.__module__}.{worker_cls.__qualname__}", world, 1, num_gpus,
                                 tuple(sorted(env_vars.items())), run_env.get("py_executable"),
                                 not plan.workers.verbose)
        pool = active_pool()
        kept = pool.take(self._pool_key) if pool is not None else None
        if kept is not None:  # a group an earlier run of this process released (meshrl.workers.pool)
            self.group = kept
            kept.timeout_s = cfg.trainer.worker_timeout_s
        else:
            self.group = WorkerGroup(
                worker_cls, world, name=worker_cls.SECTION, num_cpus_per_worker=1, num_gpus_per_worker=num_gpus,
                timeout_s=cfg.trainer.worker_timeout_s, env_vars=env_vars,
                py_executable=run_env.get("py_executable"), init_kwargs=init_kwargs,
                make_room=pool.close if pool is not None else None)
        self.kept = kept is not None
        try:
            if self.kept:
                self.group.call("rebind", **init_kwargs)
            address = ray.get(self.group.workers[0].address.remote(), timeout=cfg.trainer.worker_timeout_s)
            self.layouts: list[dict[str, Any]] = self.group.call("setup", address, **(setup_kwargs or {}))
        except BaseException:
            self.group.shutdown()
            raise
        # rank 0's own start-up phases, when its role reports them (seconds by phase: meshrl.trainer.startup)
        self.startup: dict[str, float] = self.layouts[0].get("startup", {})
        self.dp_size = self.layouts[0]["dp_size"]
        self.num_replicas = self.layouts[0].get("num_replicas", self.dp_size)

    def dispatch(self, method: str, batch: Batch, *, by: str = "dp", **kwargs: Any) -> Batch:
        """Run ``method(shard, **kwargs)`` on every rank; the collected shards as one batch in row order."""
        parts, args = self.scatter(batch, by)
        return self.gathered(parts, self.group.call_per_rank(method, args, **kwargs), by)

    def scatter(self, batch: Batch, by: str) -> tuple[list[np.ndarray], list[tuple]]:
        """``batch`` split for ``dispatch``: the shards' row indices (one per replica, or per DP rank balanced by
        workload) and each rank's argument tuple (its shard, in Ray's object store)."""
        import ray

        parts = self.split(batch, self.num_replicas if by == "replica" else self.dp_size, balance=by == "dp")
        refs = [ray.put(batch.take(p)) for p in parts]
        coord = "replica" if by == "replica" else "dp_rank"
        return parts, [(refs[lay[coord]],) for lay in self.layouts]

    def gathered(self, parts: list[np.ndarray], results: list[Any], by: str) -> Batch:
        """The ranks' ``results`` for ``scatter``'s shards ``parts``, as one batch in row order."""
        coord, collect = ("replica", "replica_leader") if by == "replica" else ("dp_rank", "collect")
        return self.in_row_order(parts, results, coord=coord, collect=collect)

    def in_row_order(self, parts: list[np.ndarray], results: list[Any], *, coord: str, collect: str) -> Batch:
        """The collecting ranks' results for the shards ``parts`` (row indices of a batch of B rows, one
        shard per ``coord`` value) as one batch in the original row order; a result of k·|shard| rows
        (generation: n rows per prompt) keeps each input row's k rows together."""
        collected = sorted((lay[coord], out) for lay, out in zip(self.layouts, results) if lay[collect])
        merged = Batch.concat([out for _, out in collected])
        order = np.concatenate(parts)
        rows_per_input = len(merged) // len(order)
        expanded = (order[:, None] * rows_per_input + np.arange(rows_per_input)).reshape(-1)
        return merged.reorder(np.argsort(expanded))

    def split(self, batch: Batch, pieces: int, balance: bool) -> list[np.ndarray]:
        """Row indices of each shard: workload-balanced equal-size parts, or consecutive chunks."""
        if len(batch) < pieces:
            raise ValueError(f"{len(batch)} rows cannot be split over {pieces} ranks; raise data.train_batch_size")
        if balance and self.cfg.trainer.balance_batch and "response_mask" in batch and pieces > 1:
            return [np.asarray(p, dtype=np.int64) for p in balance_batch(sequence_lengths(batch), pieces)]
        return np.array_split(np.arange(len(batch)), pieces)

    def per_dp_rank(self, shards_by_dp: list[Any]) -> list[tuple]:
        """Argument tuples for ``call_per_rank``: each rank gets its replica's entry."""
        return [(shards_by_dp[lay["dp_rank"]],) for lay in self.layouts]

    def shutdown(self, keep: bool = False) -> None:
        """Kill the workers; with ``keep`` (a run that ended normally) inside ``meshrl.workers.pool.keep_workers``,
        release them into the pool instead when every rank can be (``RankWorker.release``)."""
        from meshrl.workers.group import WorkerError

        pool = active_pool()
        if keep and pool is not None:
            try:
                released = all(self.group.call("release"))
            except WorkerError:  # the group killed its workers
                released = False
            if released:
                pool.give(self._pool_key, self.group)
                return
        self.group.shutdown()
