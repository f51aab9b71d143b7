"""Start (or join) the Ray cluster the worker groups run on.

On one machine: loopback only, no dashboard, temp files in the project cache, a small object store,
and logical CPUs = one per worker process plus room for the driver. With ``RAY_ADDRESS`` set (a
cluster started by ``launch/``), join it instead.
"""

from __future__ import annotations

import os

from omegaconf import DictConfig

from meshrl.config.validate import world_size
from meshrl.workers.dispatch import groups_per_rank
from meshrl.runtime import configure_environment


def start_ray(cfg: DictConfig) -> None:
    configure_environment()
    import ray

    if ray.is_initialized():
        return
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=True)
        return
    ray.init(
        num_cpus=world_size(cfg) * groups_per_rank(cfg) + 2,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        _temp_dir=os.environ["RAY_TMPDIR"],
        object_store_memory=512 * 1024**2,
        log_to_driver=True,
    )
