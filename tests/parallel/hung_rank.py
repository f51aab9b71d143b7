"""Rank 1 hangs; rank 0's next collective must fail after the configured timeout, not after 30 min.

    RANK=r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=p python tests/parallel/hung_rank.py TIMEOUT_S

Rank 0 prints one JSON line: whether the collective raised, and after how many seconds. Rank 1 sleeps
until it is killed (test_parallel_multiproc.py kills it).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from meshrl.parallel import state  # noqa: E402

if __name__ == "__main__":
    timeout_s = float(sys.argv[1])
    state.initialize(state.ParallelConfig(tensor_parallel=2, timeout_s=timeout_s))
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    dist.all_reduce(torch.ones(1), group=group)  # both ranks alive and connected
    if dist.get_rank() == 1:
        time.sleep(3600)
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1), group=group)
        raised = False
    except RuntimeError:
        raised = True
    print(json.dumps({"raised": raised, "seconds": time.monotonic() - start}), flush=True)
