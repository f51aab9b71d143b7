"""Megatron sequence parallelism (``megatron.sequence_parallel``): memory of an actor update, SP on vs off.

SmolLM2-135M-Instruct (fp32, its real weights) at TP3 — its 9 attention / 3 KV heads split over 3 ranks, not 2 —
on gloo, one forward + backward of one packed micro-batch of ``--prompt`` + ``--response`` tokens (default 256 +
1792 = 2048) with the workers' request (response-only outputs, fused output layer, entropy). Each setting runs in
its own torchrun launch, so each rank's memory is its own. Per rank:

- ``saved_activation_bytes``: the bytes of every tensor autograd saves for the backward during the pass (distinct
  storages, counted by a ``saved_tensors_hooks`` pack hook): what sequence parallelism divides;
- ``update_peak_bytes``: the process's peak RSS during the pass (``VmHWM``, reset before it) minus its RSS just
  before it (model and gradient buffer: the same in both settings);
- ``planned_activation_bytes``: ``meshrl plan``'s activations for the layout (``meshrl.memory_plan``'s formula, fp32).

Writes bench/results/sequence_parallel.json. Time is recorded with the load average but is not the point (three
ranks on two cores).

    python -m bench.sequence_parallel [--prompt 256] [--response 1792]        (from the repo root)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import torch

from bench.machine import load_average, timed, write_result

TP = 3
SETTINGS = {"sp_off": False, "sp_on": True}


def measure_update(chunks: list, micro: dict) -> dict:
    """One forward + backward of ``micro`` with the workers' request (response-only outputs, fused output layer,
    entropy): ``saved_activation_bytes`` (distinct storages autograd saves, the model's weights aside),
    ``update_peak_bytes`` (peak RSS during the pass above the RSS before it), ``rss_before_bytes``, ``seconds``."""
    from meshrl import process_memory
    from meshrl.parallel import schedule
    from meshrl.parallel.forward import OutputRequest
    from meshrl.workers.sequences import response_part

    request = OutputRequest(entropy=True, remove_padding=True, fused_chunk_size=512)

    def loss_fn(outputs, mb):
        mask = mb["response_mask"]
        log_probs, entropy = response_part(outputs["log_probs"], mb), response_part(outputs["entropy"], mb)
        return -((log_probs * mb["advantages"] + 0.01 * entropy) * mask).sum() / mb["n_tokens"], {}

    weights = {p.untyped_storage().data_ptr() for chunk in chunks for p in chunk.parameters()}
    storages: dict[int, int] = {}

    def pack(tensor):  # activations only: the weights autograd also keeps are the model's, in both settings
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in weights:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    process_memory.reset_peak_rss()
    before = process_memory.rss_bytes()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        seconds = timed(lambda: schedule.forward_backward(chunks, [micro], loss_fn, request))
    return {"saved_activation_bytes": sum(storages.values()),
            "update_peak_bytes": process_memory.peak_rss_bytes() - before, "rss_before_bytes": before,
            "seconds": seconds}


def rank_main(args: argparse.Namespace) -> None:
    """One rank of a launch: build, one forward + backward with its saved tensors counted, write its figures."""
    import torch.distributed as dist
    from transformers import AutoConfig

    from bench.packing import rl_micro_batch
    from meshrl.memory_plan.activations import activation_bytes_per_token
    from meshrl.models.embedded import smollm2_hf_dir
    from meshrl.parallel import hf_conversion, model_builder, state

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=1800))
    state.initialize(state.ParallelConfig(tensor_parallel=TP, timeout_s=1800))
    model_dir = smollm2_hf_dir()
    hf_config = AutoConfig.from_pretrained(model_dir)
    chunks = model_builder.build_model(hf_config, sequence_parallel=args.sequence_parallel)
    hf_conversion.load_hf_weights(chunks, model_dir)
    micro = rl_micro_batch(1, prompt=(args.prompt, args.prompt), response=(args.response, args.response))
    figures = measure_update(chunks, micro)
    spec = model_builder.model_spec(hf_config)
    tokens = args.prompt + args.response
    figures["planned_activation_bytes"] = activation_bytes_per_token(spec, TP, 4, args.sequence_parallel) \
        * spec.num_layers * tokens
    ranks: list = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, figures)
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(ranks))
    state.destroy()
    dist.destroy_process_group()


def launch_setting(module: str, nproc: int, out: Path, arguments: list[str]) -> list[dict]:
    """Run ``python -m module --rank --out out *arguments`` as a torchrun launch of ``nproc`` ranks and return the
    per-rank figures it wrote to ``out`` (removed), each ``*_bytes`` also as ``*_gib``."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--standalone",
               "-m", module, "--rank", "--out", str(out), *arguments]
    # 1 MiB and larger allocations mapped on their own, so RSS follows what is held (as bench.fused)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "MALLOC_MMAP_THRESHOLD_": str(2**20)}
    subprocess.run(command, cwd=Path(__file__).resolve().parents[1], env=env, check=True)
    ranks = json.loads(out.read_text())
    out.unlink()
    return [{**rank, **{k.replace("_bytes", "_gib"): v / 2**30 for k, v in rank.items() if k.endswith("_bytes")}}
            for rank in ranks]


def memory_bars(axis, result: dict, settings) -> None:
    """Per setting, the largest rank's saved activations, peak RSS above the model and planned activations (GiB)."""
    keys = [("saved_activation_gib", "saved for backward"), ("update_peak_gib", "peak RSS above the model"),
            ("planned_activation_gib", "meshrl plan's activations")]
    width = 0.25
    for index, (key, label) in enumerate(keys):
        values = [max(rank[key] for rank in result["settings"][name]["ranks"]) for name in settings]
        bars = axis.bar([i + index * width for i in range(len(settings))], values, width, label=label)
        axis.bar_label(bars, fmt="%.2f", fontsize=8)
    axis.set_xticks([i + width for i in range(len(settings))], list(settings))
    axis.set_ylabel("GiB per rank (largest rank)")
    axis.legend(fontsize=8)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axis = plt.subplots(figsize=(7, 3.8))
    memory_bars(axis, result, SETTINGS)
    axis.set_title(f"SmolLM2-135M update, fp32, TP{TP} (gloo), one packed sequence of {result['tokens']} tokens",
                   fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--response", type=int, default=1792)
    parser.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--sequence-parallel", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank:
        rank_main(args)
        return
    load_before = load_average()
    settings = {}
    for name, sequence_parallel in SETTINGS.items():
        arguments = [f"--prompt={args.prompt}", f"--response={args.response}"] + (
            ["--sequence-parallel"] if sequence_parallel else [])
        settings[name] = {"ranks": launch_setting("bench.sequence_parallel", TP, Path(
            f"/tmp/bench_sequence_parallel_{name}.json"), arguments)}
    largest = {name: max(rank["saved_activation_bytes"] for rank in s["ranks"]) for name, s in settings.items()}
    peaks = {name: max(rank["update_peak_bytes"] for rank in s["ranks"]) for name, s in settings.items()}
    result = {"model": "SmolLM2-135M-Instruct", "dtype": "float32", "tp": TP, "tokens": args.prompt + args.response,
              "layout": "TP3 gloo, local spec + SDPA, one packed sequence, response-only outputs, fused output layer",
              "settings": settings,
              "saved_activations_on_over_off": largest["sp_on"] / largest["sp_off"],
              "update_peak_on_over_off": peaks["sp_on"] / peaks["sp_off"],
              "load_average_1m_before_after": [load_before, load_average()],
              "command": "python -m bench.sequence_parallel " + " ".join(sys.argv[1:])}
    write_result("sequence_parallel", result, plot)
    for name, s in settings.items():
        rank = max(s["ranks"], key=lambda r: r["saved_activation_bytes"])
        print(f"{name}: saved {rank['saved_activation_gib']:.3f} GiB, peak above model {rank['update_peak_gib']:.3f} "
              f"GiB, plan {rank['planned_activation_gib']:.3f} GiB, {rank['seconds']:.1f} s")
    print(f"on / off: saved {result['saved_activations_on_over_off']:.3f}, peak {result['update_peak_on_over_off']:.3f}"
          f"  load {result['load_average_1m_before_after']}")


if __name__ == "__main__":
    main()
