"""Context parallelism (``megatron.context_parallel_size``): an actor update of one long sequence, CP1 vs CP2.

SmolLM2-135M-Instruct (fp32, its real weights) on gloo, one packed micro-batch of ``--prompt`` + ``--response`` tokens
(default 512 + 3584 = 4096) with the workers' request (response-only outputs, fused output layer, entropy), measured
as ``bench.sequence_parallel`` measures it (``measure_update``): per rank, the bytes autograd saves for the backward,
the peak RSS of the pass above the model, its time. CP1 runs in one process, CP2 in a torchrun launch of two; each
setting also records its old-log-prob pass's response log-probs, and the result their largest difference (the
exactness on a real model at this length).

Writes bench/results/context_parallel.json (+ .png). Two ranks on two cores: CP2's time is one rank per core.

    python -m bench.context_parallel [--prompt 512] [--response 3584]        (from the repo root)
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import timedelta
from pathlib import Path

import torch

from bench.machine import load_average, write_result
from bench.sequence_parallel import launch_setting, measure_update, memory_bars

SETTINGS = {"cp1": 1, "cp2": 2}


def rank_main(args: argparse.Namespace) -> None:
    """One rank: build SmolLM2, the old-log-prob pass, one measured update; rank 0 writes every rank's figures."""
    import torch.distributed as dist
    from transformers import AutoConfig

    from bench.packing import rl_micro_batch
    from meshrl.memory_plan.activations import activation_bytes_per_token
    from meshrl.models.embedded import smollm2_hf_dir
    from meshrl.parallel import hf_conversion, model_builder, schedule, state
    from meshrl.parallel.forward import OutputRequest

    torch.set_num_threads(1 if args.cp > 1 else 2)  # one core per rank either way
    dist.init_process_group("gloo", timeout=timedelta(seconds=1800))
    state.initialize(state.ParallelConfig(context_parallel=args.cp, timeout_s=1800))
    model_dir = smollm2_hf_dir()
    hf_config = AutoConfig.from_pretrained(model_dir)
    chunks = model_builder.build_model(hf_config)
    hf_conversion.load_hf_weights(chunks, model_dir)
    micro = rl_micro_batch(1, prompt=(args.prompt, args.prompt), response=(args.response, args.response))
    (old,) = schedule.forward_only(chunks, [micro], OutputRequest(remove_padding=True, fused_chunk_size=512))
    figures = measure_update(chunks, micro)
    spec = model_builder.model_spec(hf_config)
    figures["planned_activation_bytes"] = activation_bytes_per_token(spec, 1, 4, False, args.cp) * spec.num_layers \
        * (args.prompt + args.response) // args.cp
    ranks: list = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, figures)
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(ranks))
        torch.save(old["log_probs"] * micro["output_mask"], Path(args.out).with_suffix(".pt"))
    state.destroy()
    dist.destroy_process_group()


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.8))
    memory_bars(axes[0], result, SETTINGS)
    seconds = [max(rank["seconds"] for rank in result["settings"][name]["ranks"]) for name in SETTINGS]
    bars = axes[1].bar(list(SETTINGS), seconds)
    axes[1].bar_label(bars, fmt="%.1f", fontsize=8)
    axes[1].set_ylabel("update seconds (forward + backward)")
    fig.suptitle(f"SmolLM2-135M update, fp32, gloo, one packed sequence of {result['tokens']} tokens", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--response", type=int, default=3584)
    parser.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--cp", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank:
        rank_main(args)
        return
    load_before = load_average()
    settings, log_probs = {}, {}
    for name, cp in SETTINGS.items():
        out = Path(f"/tmp/bench_context_parallel_{name}.json")
        settings[name] = {"ranks": launch_setting("bench.context_parallel", cp, out, [
            f"--cp={cp}", f"--prompt={args.prompt}", f"--response={args.response}"])}
        log_probs[name] = torch.load(out.with_suffix(".pt"))
        out.with_suffix(".pt").unlink()

    def largest(name: str, key: str) -> float:
        return max(rank[key] for rank in settings[name]["ranks"])

    result = {"model": "SmolLM2-135M-Instruct", "dtype": "float32", "tokens": args.prompt + args.response,
              "layout": "gloo, local spec + SDPA, one packed sequence, response-only outputs, fused output layer",
              "settings": settings,
              "saved_activations_cp2_over_cp1": largest("cp2", "saved_activation_bytes")
              / largest("cp1", "saved_activation_bytes"),
              "update_peak_cp2_over_cp1": largest("cp2", "update_peak_bytes") / largest("cp1", "update_peak_bytes"),
              "update_seconds_cp1_over_cp2": largest("cp1", "seconds") / largest("cp2", "seconds"),
              "old_log_probs_max_abs_diff": float((log_probs["cp2"] - log_probs["cp1"]).abs().max()),
              "load_average_1m_before_after": [load_before, load_average()],
              "command": "python -m bench.context_parallel " + " ".join(sys.argv[1:])}
    write_result("context_parallel", result, plot)
    for name in SETTINGS:
        print(f"{name}: saved {largest(name, 'saved_activation_gib'):.3f} GiB, peak above model "
              f"{largest(name, 'update_peak_gib'):.3f} GiB, plan {largest(name, 'planned_activation_gib'):.3f} GiB, "
              f"{largest(name, 'seconds'):.1f} s")
    print(f"cp2 / cp1: saved {result['saved_activations_cp2_over_cp1']:.3f}, "
          f"peak {result['update_peak_cp2_over_cp1']:.3f}; cp1 / cp2 time {result['update_seconds_cp1_over_cp2']:.2f}; "
          f"log-probs within {result['old_log_probs_max_abs_diff']:.2e}  load {result['load_average_1m_before_after']}")


if __name__ == "__main__":
    main()
