"""What every training rank (a Ray actor) does the same way: join the process group, set up the
Megatron parallel state, and report where it sits in the layout so the driver can dispatch data.

Two-phase start: the constructor only stores arguments (Ray builds actors concurrently); rank 0's
``address()`` names the rendezvous; ``setup(address)`` then forms the ``torch.distributed`` group
(gloo on CPU, NCCL on GPU, with verl's ``actor_rollout_ref.nccl_timeout`` as the collective timeout, so a
dead peer fails a step in bounded time) and builds the rank's models. The driver's wait for each call is
``trainer.worker_timeout_s``: a hung step fails after the smaller of the two.

A rank running as a Ray actor first sends its process's output to the run's logs folder (``meshrl.logs``),
unless ``trainer.verbose``.
"""

from __future__ import annotations

import gc
import os
import socket
import sys
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any

from omegaconf import OmegaConf

from meshrl.config.run_plan import RunPlan
from meshrl.logs import logs_dir, route_worker_output, worker_log_name
from meshrl.process_memory import limit_heap_growth, trim_heap
from meshrl.runtime import configure_environment


@dataclass(frozen=True)
class RankLayout:
    """Where a rank sits: training data-parallel coordinates, and whether its outputs are collected."""

    rank: int
    dp_rank: int
    dp_size: int
    collect: bool  # TP and CP rank 0 of the last pipeline stage: its results represent the replica
    # the rank that writes the replica's files (HF export, adapters): DP and CP rank 0 (CP ranks hold the same weights
    # and, megatron's dp_rank excluding CP, the same DP rank)
    writer: bool


class RankWorker:
    """A training rank of one role. It reads its role's config section (``SECTION`` of the config: its model,
    parallel layout, optimizer... keys) and the run plan (``meshrl.config.run_plan``: the decisions the driver
    made once, and the run-wide ``WorkerSettings``); never the whole config."""

    SECTION: str  # the role's top-level config section

    def __init__(self, rank: int, world_size: int, section: dict, model_dir: str, plan: RunPlan) -> None:
        configure_environment()
        limit_heap_growth()  # before any model is allocated: freed activations go back to the system
        self.rank = rank
        self.world_size = world_size
        self.rebind(section, model_dir, plan)

    def rebind(self, section: dict, model_dir: str, plan: RunPlan) -> None:
        """Take a run's arguments: at the start, and in a process kept from an earlier run (``release``, then
        ``meshrl.workers.pool``) before that run's ``setup``."""
        if not plan.workers.verbose and _in_ray_actor():
            # Before the rank imports its libraries (in setup): their output goes to the run's logs folder.
            route_worker_output(logs_dir(plan.workers.run_dir), worker_log_name(type(self).__name__, self.rank))
        self.section = OmegaConf.create(section)  # plain containers travel to Ray actors
        self.model_dir = model_dir
        self.plan = plan  # the run's decisions (roles, widths, micro-batching), made once by the driver

    def release(self) -> bool:
        """Drop everything the run built, for a later run of the same shape in this process (``meshrl.workers.pool``):
        the role's own parts (``_release_role``), every attribute but the rank's place, Megatron's parallel state
        and the process group; the freed memory goes back to the system. False (nothing dropped) when the role
        holds what it cannot reset: the pool then kills the process."""
        if not self._release_role():
            return False
        for name in [n for n in vars(self) if n not in ("rank", "world_size")]:
            delattr(self, name)
        import torch
        import torch.distributed as dist

        from meshrl.parallel import state

        state.destroy()
        if dist.is_initialized():
            dist.destroy_process_group()
        gc.collect()
        trim_heap()
        if torch.cuda.is_available():  # the next run's engine sizes its cache on the device's free memory
            torch.cuda.empty_cache()
        return True

    def _release_role(self) -> bool:
        """Stop what the role started beside its models (an engine, threads); False if it cannot."""
        return True

    def address(self) -> tuple[str, int]:
        """This node's address and a free port, for the rendezvous (called on rank 0)."""
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        if self.world_size == 1 or _single_node():
            return "127.0.0.1", port
        import ray

        # Ray's node address is the one other nodes reach (a hostname lookup may give 127.0.1.1).
        return ray.util.get_node_ip_address(), port

    def _init_distributed(self, address: tuple[str, int], layout, seed: int, threads: int) -> RankLayout:
        """The process group and megatron's groups of the role's ``layout`` (its ``RunPlan`` layout), seeded."""
        import torch
        import torch.distributed as dist

        from meshrl.parallel import state

        torch.set_num_threads(threads)
        cuda = torch.cuda.is_available() and self.plan.workers.device != "cpu"
        if cuda:
            torch.cuda.set_device(0)  # Ray exposes one GPU per worker as device 0
        os.environ.update(MASTER_ADDR=address[0], MASTER_PORT=str(address[1]), RANK=str(self.rank),
                          WORLD_SIZE=str(self.world_size), LOCAL_RANK="0")
        # verl times out its policy workers at this key; meshrl applies it to the critic workers as well
        timeout = timedelta(seconds=self.plan.workers.collective_timeout_s)
        dist.init_process_group("nccl" if cuda else "gloo", rank=self.rank, world_size=self.world_size,
                                timeout=timeout)
        state.initialize(state.ParallelConfig.from_layout(layout, timeout_s=self.plan.workers.collective_timeout_s,
                                                          seed=seed))
        from megatron.core import parallel_state

        first_cp = parallel_state.get_context_parallel_rank() == 0
        self.layout = RankLayout(
            rank=self.rank, dp_rank=state.dp_rank(), dp_size=state.dp_size(),
            collect=(parallel_state.get_tensor_model_parallel_rank() == 0 and state.is_pipeline_last_stage()
                     and first_cp),
            writer=state.dp_rank() == 0 and first_cp,
        )
        return self.layout

    def layout_dict(self) -> dict[str, Any]:
        return asdict(self.layout)


def _in_ray_actor() -> bool:
    """Whether this process is a Ray actor's: a rank built in-process (tests, benchmarks) keeps its caller's output."""
    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None


def _single_node() -> bool:
    return not os.environ.get("RAY_ADDRESS")
