"""torch.distributed helpers shared by every layer that runs a collective (data, parallel, workers)."""

from __future__ import annotations

import torch
import torch.distributed as dist


def collective_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """Where a tensor given to a collective on ``group`` must live: NCCL reduces only CUDA tensors
    (on this process's current device), gloo CPU ones."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
