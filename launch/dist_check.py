"""torch.distributed health check of a (multi-node) torchrun launch, through meshrl's parallel layer.

    launch/torchrun_multi_node.sh --nnodes 2 --nproc-per-node 8 --rdzv-endpoint HEAD:29400 \
        launch/dist_check.py --tp 8 --pp 2 [--model DIR_OR_KNOWN_ID] [--out result.json]

On every rank: (1) an all-reduce over the world sums the ranks; (2) ``meshrl.parallel.state``
builds the TP x PP (x DP) groups the trainer uses, and all-reduces over the tensor-parallel and
data-parallel groups give the expected sums; (3) for each ``--model`` (a local HF folder or an id that
``meshrl plan`` knows — no weights are read) it builds this rank's policy shard with
``model_builder.build_model`` and compares its parameter count with ``meshrl plan``'s
``stage_parameters``. Every layout in ``--layouts`` (default: the one given by --tp/--pp) is checked
in turn. Rank 0 prints every rank's results as one JSON line (also written to ``--out``); the exit
status is 0 when every check passed on every rank.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # a checkout that is not pip-installed

from meshrl.parallel import state  # noqa: E402


def parse_layouts(text: str) -> list[tuple[int, int]]:
    """``"2x1,1x2"`` -> [(TP 2, PP 1), (TP 1, PP 2)]."""
    out = []
    for item in text.split(","):
        tp, _, pp = item.partition("x")
        out.append((int(tp), int(pp or 1)))
    return out


def check_layout(tp: int, pp: int, models: list[str], timeout_s: float) -> dict:
    """Checks (2) and (3) for one layout on this rank; returns {name: measured} plus ``ok``."""
    from megatron.core import parallel_state

    state.initialize(state.ParallelConfig(tensor_parallel=tp, pipeline_parallel=pp, timeout_s=timeout_s))
    try:
        result: dict = {"tp_rank": state.tp_rank(), "pp_rank": state.pp_rank(), "dp_rank": state.dp_rank()}
        ones = torch.ones(1)
        dist.all_reduce(ones, group=parallel_state.get_tensor_model_parallel_group())
        result["tp_group_size_ok"] = int(ones.item()) == tp
        ones = torch.ones(1)
        dist.all_reduce(ones, group=state.dp_group())
        result["dp_group_size_ok"] = int(ones.item()) == dist.get_world_size() // (tp * pp)
        for model in models:
            from meshrl.parallel.model_builder import build_model, model_spec, unwrap
            from meshrl.memory_plan import load_hf_config, stage_parameters

            hf_config = load_hf_config(model)
            chunks = build_model(hf_config, perform_initialization=False)
            built = sum(p.numel() for chunk in chunks for p in unwrap(chunk).parameters())
            planned = stage_parameters(model_spec(hf_config), tp=tp, pp=pp, stage=state.pp_rank())
            result[model] = {"built": built, "planned": planned}
            result[f"{model} parameters_ok"] = built == planned
            del chunks
        result["ok"] = all(v for k, v in result.items() if k.endswith("_ok"))
        return result
    finally:
        state.destroy()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--layouts", default=None, help="several TPxPP layouts to check in turn, e.g. 2x1,1x2")
    parser.add_argument("--model", action="append", default=[],
                        help="HF folder or known id: also compare shard parameter counts (repeatable)")
    parser.add_argument("--timeout", type=float, default=120.0, help="collective timeout, seconds")
    parser.add_argument("--out", default=None, help="rank 0 writes the merged JSON result here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, timeout=timedelta(seconds=args.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda") if backend == "nccl" else torch.device("cpu")
    total = torch.tensor([float(rank)], device=device)
    dist.all_reduce(total)
    mine = {"host": socket.gethostname(), "local_rank": int(os.environ.get("LOCAL_RANK", "0")),
            "world_sum_ok": int(total.item()) == world * (world - 1) // 2, "layouts": {}}
    layouts = parse_layouts(args.layouts) if args.layouts else [(args.tp, args.pp)]
    for tp, pp in layouts:
        mine["layouts"][f"tp{tp}pp{pp}"] = check_layout(tp, pp, args.model, args.timeout)
    gathered: list = [None] * world
    dist.all_gather_object(gathered, mine)
    ok = all(r["world_sum_ok"] and all(lay["ok"] for lay in r["layouts"].values()) for r in gathered)
    if rank == 0:
        merged = {"backend": backend, "world": world, "ok": ok, "ranks": gathered}
        print(json.dumps(merged))
        if args.out:
            Path(args.out).write_text(json.dumps(merged, indent=1))
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
