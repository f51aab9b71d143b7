"""Start (or join) the Ray cluster the worker groups run on.

On one machine: loopback only, no dashboard, temp files in the project cache, a small object store,
and logical CPUs = one per worker process plus room for the driver. With ``RAY_ADDRESS`` set (a
cluster started by ``launch/``), join it instead; in a process that already runs Ray (a notebook, a test
running several trainings), use that.

verl's ``ray_kwargs.ray_init`` applies where it maps onto this start (``ray_init_kwargs``):
``num_cpus`` sizes a Ray meshrl starts, ``runtime_env.env_vars`` and ``runtime_env.py_executable``
reach every worker (also in a Ray meshrl did not start: each worker's actor options carry them). Anything
else is refused with a ``ConfigError`` that names the key and says why.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from meshrl.config.loader import ConfigError
from meshrl.config.run_plan import build_run_plan
from meshrl.config.validate import world_size
from meshrl.runtime import configure_environment, prune_ray_sessions
from meshrl.workers.dispatch import groups_per_rank, worker_runtime_env

_DRIVER_CPUS = 2  # logical CPUs left for the driver's own Ray tasks


def ray_init_kwargs(cfg: DictConfig) -> dict[str, Any]:
    """The keyword arguments ``start_ray`` passes to ``ray.init`` for ``cfg`` (module docstring).

    Raises:
        ConfigError: a ``ray_kwargs.ray_init`` key that cannot map: a runtime_env field other than
            ``RUNTIME_ENV_FIELDS`` (``worker_runtime_env``), ``num_cpus`` below the run's worker processes, or
            ``num_cpus`` while joining a running cluster (``RAY_ADDRESS``) or a Ray this process already runs,
            whose start set its CPUs.
    """
    configure_environment()
    ray_init = cfg.ray_kwargs.ray_init
    prefix = "ray_kwargs.ray_init"
    env = worker_runtime_env(cfg)
    runtime = {"runtime_env": env} if env else {}

    if _ray_running_here():
        if ray_init.num_cpus is not None:
            raise ConfigError(f"{prefix}.num_cpus sizes a Ray that meshrl starts, but this process already runs Ray "
                              "(its caller started it, with its own CPUs); drop the key, or size that ray.init.",
                              [f"{prefix}.num_cpus"])
        return {}  # nothing to start
    if os.environ.get("RAY_ADDRESS"):
        if ray_init.num_cpus is not None:
            raise ConfigError(f"{prefix}.num_cpus sizes a Ray that meshrl starts, but RAY_ADDRESS joins a running "
                              "cluster, whose CPUs its `ray start --num-cpus` sets; drop the key or unset RAY_ADDRESS.",
                              [f"{prefix}.num_cpus"])
        return {"address": os.environ["RAY_ADDRESS"], "log_to_driver": True, **runtime}
    workers = world_size(cfg) * groups_per_rank(build_run_plan(cfg))  # one logical CPU each (meshrl.workers.group)
    num_cpus = workers + _DRIVER_CPUS if ray_init.num_cpus is None else ray_init.num_cpus
    if num_cpus < workers:
        raise ConfigError(f"{prefix}.num_cpus={num_cpus}: this run places {workers} worker processes of one logical "
                          f"CPU each; set at least {workers} or drop the key.", [f"{prefix}.num_cpus"])
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
