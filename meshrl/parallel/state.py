"""Process groups for tensor, pipeline (optionally virtual/interleaved), context, expert and data parallelism.

``initialize(ParallelConfig(...))`` is the one entry point: it starts ``torch.distributed`` if needed
(gloo on CPU, NCCL on GPU) with an explicit timeout, applies the megatron CPU compatibility layer when
CUDA is absent, builds megatron's model-parallel groups and seeds the model-parallel RNG tracker.

The timeout matters more than anything else here: with torch's default (30 min) a rank that died
leaves every other rank blocked in its next collective for half an hour. meshrl defaults to 5 minutes,
and every group megatron creates inherits it.

Data parallelism is whatever is left: ``world_size / (TP * PP * CP)``. Experts (MoE) have a layout of their own
over the same ranks, megatron's: ``expert_parallel`` (EP) ranks hold disjoint sets of experts, each expert split
over ``expert_tensor_parallel`` (ETP; None: TP) ranks, and what is left of ``world_size / (ETP * EP * PP)``
replicates them (expert data parallelism). EP groups are cut from the attention's data-parallel ranks (and TP
ranks when ETP < TP), so the ranks of one EP group run different micro-batches and exchange tokens all-to-all.
megatron builds those groups on gloo as on NCCL.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from meshrl.parallel import cpu_compat


@dataclass(frozen=True)
class ParallelConfig:
    """Layout of one model replica set. ``virtual_pipeline`` is the number of chunks per PP stage."""

    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    virtual_pipeline: int | None = None
    context_parallel: int = 1
    expert_parallel: int = 1
    expert_tensor_parallel: int | None = None
    timeout_s: float = 300.0
    seed: int = 1234

    def __post_init__(self) -> None:
        for name in ("tensor_parallel", "pipeline_parallel", "context_parallel", "expert_parallel"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.virtual_pipeline is not None:
            if self.virtual_pipeline < 2:
                raise ValueError("virtual_pipeline must be None or >= 2 (chunks per pipeline stage)")
            if self.pipeline_parallel < 2:
                raise ValueError("virtual_pipeline needs pipeline_parallel >= 2")
        if self.expert_tensor_parallel is not None and self.expert_tensor_parallel < 1:
            raise ValueError(f"expert_tensor_parallel must be None or >= 1, got {self.expert_tensor_parallel}")
        if self.timeout_s <= 0:
            raise ValueError("timeout_s must be positive")

    @classmethod
    def from_layout(cls, layout, **options) -> ParallelConfig:
        """The config of a run plan's ``ParallelLayout`` (``meshrl.config.run_plan``: a role's TP, PP, VPP, CP, EP and
        expert TP), with ``options`` (timeout, seed)."""
        return cls(tensor_parallel=layout.tensor, pipeline_parallel=layout.pipeline,
                   virtual_pipeline=layout.virtual_pipeline, context_parallel=layout.context,
                   expert_parallel=layout.expert, expert_tensor_parallel=layout.expert_tensor, **options)

    @property
    def expert_tensor_parallel_size(self) -> int:
        """ETP as megatron resolves it: the TP size unless set."""
        return self.tensor_parallel if self.expert_tensor_parallel is None else self.expert_tensor_parallel

    @property
    def model_parallel_size(self) -> int:
        return self.tensor_parallel * self.pipeline_parallel * self.context_parallel

    def data_parallel_size(self, world_size: int) -> int:
        if world_size % self.model_parallel_size:
            raise ValueError(
                f"world size {world_size} is not divisible by TP*PP*CP = {self.tensor_parallel}*"
                f"{self.pipeline_parallel}*{self.context_parallel} = {self.model_parallel_size}")
        experts = self.expert_tensor_parallel_size * self.expert_parallel * self.pipeline_parallel
        if world_size % experts:
            raise ValueError(f"world size {world_size} is not divisible by expert TP*EP*PP = "
                             f"{self.expert_tensor_parallel_size}*{self.expert_parallel}*{self.pipeline_parallel} = "
                             f"{experts}")
        return world_size // self.model_parallel_size


_current: ParallelConfig | None = None
_owns_process_group = False


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _init_process_group(timeout: timedelta) -> None:
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend=backend, timeout=timeout)
    else:
        # A lone process (tests, the conversion CLI, a notebook): a private one-rank group.
        dist.init_process_group(backend=backend, init_method=f"tcp://127.0.0.1:{_free_port()}",
                                rank=0, world_size=1, timeout=timeout)


def initialize(config: ParallelConfig = ParallelConfig()) -> ParallelConfig:
    """Set up distributed state for ``config``; returns it. Idempotent for the same config.

    Uses an existing default process group if there is one (e.g. created by Ray workers), otherwise
    starts one from the torchrun environment (``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT``)
    or, without it, a single-rank group. Raises if a different layout is already initialised.
    """
    global _current, _owns_process_group
    from megatron.core import parallel_state, tensor_parallel

    if _current is not None:
        if _current != config:
            raise RuntimeError(f"parallel state already initialised as {_current}; call destroy() first")
        return _current
    timeout = timedelta(seconds=config.timeout_s)
    if not dist.is_initialized():
        _init_process_group(timeout)
        _owns_process_group = True
    config.data_parallel_size(dist.get_world_size())
    cpu_compat.apply()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=config.tensor_parallel,
        pipeline_model_parallel_size=config.pipeline_parallel,
        virtual_pipeline_model_parallel_size=config.virtual_pipeline,
        context_parallel_size=config.context_parallel,
        expert_model_parallel_size=config.expert_parallel,
        expert_tensor_parallel_size=config.expert_tensor_parallel,
        distributed_timeout_minutes=config.timeout_s / 60.0,
    )
    tensor_parallel.model_parallel_cuda_manual_seed(config.seed)
    _current = config
    return config


def current() -> ParallelConfig:
    """The layout passed to ``initialize``; raises if it has not run."""
    if _current is None:
        raise RuntimeError("meshrl.parallel.state.initialize() has not been called")
    return _current


def destroy() -> None:
    """Tear down megatron's groups, and the default process group if ``initialize`` started it."""
    global _current, _owns_process_group
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if _owns_process_group and dist.is_initialized():
        dist.destroy_process_group()
    _current, _owns_process_group = None, False


def tp_rank() -> int:
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_rank()


def pp_rank() -> int:
    from megatron.core import parallel_state

    return parallel_state.get_pipeline_model_parallel_rank()


def dp_rank() -> int:
    from megatron.core import parallel_state

    return parallel_state.get_data_parallel_rank()


def dp_size() -> int:
    from megatron.core import parallel_state

    return parallel_state.get_data_parallel_world_size()


def dp_group() -> dist.ProcessGroup:
    from megatron.core import parallel_state

    return parallel_state.get_data_parallel_group()


def is_pipeline_last_stage() -> bool:
    from megatron.core import parallel_state

    return parallel_state.is_pipeline_last_stage(ignore_virtual=True)
