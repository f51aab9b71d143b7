"""Start (or join) the Ray cluster the worker groups run on.

On one machine: loopback only, no dashboard, temp files in the project cache, a small object store,
and logical CPUs = one per worker process plus room for the driver. With ``RAY_ADDRESS`` set (a
cluster started by ``launch/``), join it instead; in a process that already runs Ray (a notebook, a test
running several trainings), use that.

verl's ``ray_kwargs.ray_init`` applies where it maps onto this start (``ray_init_kwargs``):
``num_cpus`` sizes a Ray meshrl starts, ``runtime_env.env_vars`` and ``runtime_env.py_executable``
reach every worker (also in a Ray meshrl did not start: each worker's actor options carry them). Anything
else is refused before the run starts (the ``launch`` stage's rule ``ray_settings``, ``meshrl.config.refusals``),
naming the key and saying why.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from meshrl.config.refusals import Checked, refusal
from meshrl.config.run_plan import build_run_plan
from meshrl.config.validate import world_size
from meshrl.runtime import configure_environment, prune_ray_sessions
from meshrl.workers.dispatch import groups_per_rank, runtime_env_problems, worker_runtime_env

_DRIVER_CPUS = 2  # logical CPUs left for the driver's own Ray tasks


@refusal("launch", "ray_kwargs.ray_init")
def ray_settings(c: Checked) -> list[str]:
    """verl's ``ray_kwargs.ray_init`` where it cannot map onto this start (module docstring): a runtime_env field
    other than ``RUNTIME_ENV_FIELDS`` (``dispatch.runtime_env_problems``), ``num_cpus`` below the run's worker
    processes, or ``num_cpus`` while joining a running cluster (``RAY_ADDRESS``) or a Ray this process already runs,
    whose start set its CPUs."""
    problems, key = runtime_env_problems(c.cfg), "ray_kwargs.ray_init.num_cpus"
    num_cpus = c.cfg.ray_kwargs.ray_init.num_cpus
    if num_cpus is None:
        return problems
    if _ray_running_here():
        problems.append(f"{key}: sizes a Ray that meshrl starts, but this process already runs Ray (its caller "
                        "started it, with its own CPUs); drop the key, or size that ray.init.")
    elif os.environ.get("RAY_ADDRESS"):
        problems.append(f"{key}: sizes a Ray that meshrl starts, but RAY_ADDRESS joins a running cluster, whose CPUs "
                        "its `ray start --num-cpus` sets; drop the key or unset RAY_ADDRESS.")
    elif num_cpus < (workers := _worker_processes(c.cfg, c.plan)):
        problems.append(f"{key}={num_cpus}: this run places {workers} worker processes of one logical CPU each; set "
                        f"at least {workers} or drop the key.")
    return problems


def _worker_processes(cfg: DictConfig, plan) -> int:
    return world_size(cfg) * groups_per_rank(plan)  # one logical CPU each (meshrl.workers.group)


def ray_init_kwargs(cfg: DictConfig) -> dict[str, Any]:
    """The keyword arguments ``start_ray`` passes to ``ray.init`` for ``cfg`` (module docstring), whose
    ``ray_kwargs.ray_init`` the ``ray_settings`` rule has passed."""
    configure_environment()
    env = worker_runtime_env(cfg)
    runtime = {"runtime_env": env} if env else {}
    if _ray_running_here():
        return {}  # nothing to start
    if os.environ.get("RAY_ADDRESS"):
        return {"address": os.environ["RAY_ADDRESS"], "log_to_driver": True, **runtime}
    num_cpus = cfg.ray_kwargs.ray_init.num_cpus
    num_cpus = _worker_processes(cfg, build_run_plan(cfg)) + _DRIVER_CPUS if num_cpus is None else num_cpus
    return {
        "num_cpus": num_cpus,
        "include_dashboard": False,
        "_node_ip_address": "127.0.0.1",
        "_temp_dir": os.environ["RAY_TMPDIR"],
        "object_store_memory": 512 * 1024**2,
        # A worker's console lines (meshrl's warnings, errors) reach the driver this way; the rest of its output
        # is in the run's logs folder (meshrl.logs), unless trainer.verbose.
        "log_to_driver": True,
        **runtime,
    }


def _ray_running_here() -> bool:
    """Whether this process already runs Ray (a notebook's, or a test's shared session): never imports Ray."""
    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()


def start_ray(cfg: DictConfig) -> None:
    """Start Ray for ``cfg`` (or join ``RAY_ADDRESS``) unless this process already runs it. The workers get the
    run's ``runtime_env`` from their own actor options (``meshrl.workers.dispatch``) either way."""
    kwargs = ray_init_kwargs(cfg)
    import ray

    if ray.is_initialized():
        return
    if "_temp_dir" in kwargs:  # a Ray this run starts: its session folder joins the ones kept there
        prune_ray_sessions(Path(kwargs["_temp_dir"]))
    ray.init(**kwargs)
