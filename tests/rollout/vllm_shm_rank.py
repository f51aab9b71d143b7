"""One rank of a 2-rank gloo world that starts one inference-TP-2 vLLM engine, for tests/rollout/test_vllm_shm.py.

    python tests/rollout/vllm_shm_rank.py --rank R --out DIR --end {shutdown,kill,kill-while-starting}

The test starts both ranks as plain processes (no multiprocessing parent, whose semaphores a kill would leave
in /dev/shm). Each rank starts the engine, records the engine's segment-name prefix, the names under /dev/shm
that carry it once the engine has started, and its greedy tokens, then ends as ``--end`` says: ``shutdown``
(the engine's shutdown, then a normal exit) or ``kill`` (SIGKILL of itself, as a killed worker). The record
is written to DIR/rank{R}.json before the end. ``kill-while-starting``: SIGKILL of itself at the moment the
engine would release its segment names (the construction is over, its names still exist), after writing
the names it sees then.
The two ranks meet through a file store in DIR.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

PROMPTS = [[1, 9690, 198, 2683, 359], list(range(300, 320))]


def cpu_shm_communicator() -> bool:
    """Whether this vLLM build has the CPU backend's shared-memory TP communicator (the ``cpushm_<rank>``
    segments): its AVX-512 kernels do, the AVX2 ones (CPUs without AVX-512) do not, and vLLM then talks
    through torch.distributed. Meaningful once the engine has imported its kernels."""
    return hasattr(torch.ops._C, "init_shm_manager")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--end", choices=("shutdown", "kill", "kill-while-starting"), required=True)
    args = parser.parse_args()
    from meshrl.runtime import configure_environment

    configure_environment()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{Path(args.out).resolve()}/store", rank=args.rank,
                            world_size=2, timeout=timedelta(seconds=240))
    from meshrl.models.tiny import TinySpec, tiny_model_dir
    from meshrl.rollout import EngineConfig, SamplingConfig, create_engine
    from meshrl.rollout.vllm_shm import EngineSegments, segments

    out = Path(args.out) / f"rank{args.rank}.json"
    if args.end == "kill-while-starting":
        def die(segments_of_engine: EngineSegments, started: bool) -> None:
            tag = segments_of_engine.tag
            out.write_text(json.dumps({"pid": os.getpid(), "tag": tag, "started": started, "names": segments(tag),
                                       "cpu_shm": cpu_shm_communicator()}))
            os.kill(os.getpid(), signal.SIGKILL)

        EngineSegments.release = die

    engine = create_engine(tiny_model_dir(TinySpec()), EngineConfig(
        tensor_model_parallel_size=2, kv_cache_memory_bytes=64 << 20, max_model_len=128, max_num_seqs=4))
    record = {"pid": os.getpid(), "tag": engine.shm_tag, "after_start": segments(engine.shm_tag)}
    greedy = SamplingConfig(temperature=0, max_response_length=6, ignore_eos=True)
    record["tokens"] = [c.token_ids for c in engine.generate(PROMPTS, greedy)]
    dist.barrier()
    if args.end == "kill":
        out.write_text(json.dumps(record))
        os.kill(os.getpid(), signal.SIGKILL)
    engine.shutdown()
    record["after_shutdown"] = segments(engine.shm_tag)
    dist.destroy_process_group()
    out.write_text(json.dumps(record))


if __name__ == "__main__":
    main()
