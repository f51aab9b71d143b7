"""Actor update at long responses: the fused output layer (``model.use_fused_kernels``) vs the unfused one.

One update = forward, backward, clip (1.0) and AdamW step of SmolLM2-135M-Instruct (fp32, TP1, packed THD
micro-batches, outputs for response tokens only: the workers' layout) over ``--rows`` sequences of
``--prompt`` + ``--response`` tokens (default 8 x (128 + 1920) = 8 x 2048), in micro-batches of
``--micro-rows`` sequences, with a policy-gradient loss plus an entropy bonus (coefficient 0.01, so the
unfused pass keeps its entropy's log-softmax too, as a run with ``entropy_coeff`` does):

- ``unfused``: the output layer's ``[response tokens, V]`` fp32 logits, megatron's vocab-parallel cross
  entropy and meshrl's vocab-parallel entropy (each keeps a ``[tokens, V]`` tensor for backward);
- ``fused``: ``meshrl.parallel.fused_output``, ``--chunk`` tokens at a time.

Each variant lives in its own process (its memory is its own); the parent alternates their updates
(fused, unfused, fused, ...) after one warm-up each (which also allocates AdamW's state), so both see the
same background load. Memory of an update: the process's peak RSS during it (``VmHWM``, reset before it)
minus its RSS just before it (the model, gradient buffer and AdamW state, the same in both), the largest
over the timed updates, beside the size of one ``[response tokens of a micro-batch, V]`` fp32 tensor.
Time: the best and the median update.

Writes bench/results/fused.json and bench/results/fused.png.

    python -m bench.fused [--rows 8] [--prompt 128] [--response 1920] [--micro-rows 1] [--chunk 512]
                          [--steps 3] [--threads 2]                     (from the repo root)
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
from pathlib import Path

import torch

from bench.machine import ServedVariant, load_average, timed
from bench.packing import rl_micro_batch
from meshrl import process_memory

RESULTS = Path(__file__).resolve().parent / "results"
VARIANTS = ("fused", "unfused")
ENTROPY_COEFF = 0.01


def serve(variant: str, args: argparse.Namespace) -> None:
    """Child: build the model and batches, say ready, run one update per ``step`` line; ``done`` reports memory."""
    from transformers import AutoConfig

    from meshrl.models.embedded import smollm2_hf_dir
    from meshrl.parallel import hf_conversion, model_builder, optimizer, state
    from meshrl.parallel.forward import OutputRequest
    from meshrl.runtime import configure_environment
    from meshrl.workers.sequences import response_part

    configure_environment()
    torch.set_num_threads(args.threads)
    lengths = dict(prompt=(args.prompt, args.prompt), response=(args.response, args.response))
    micro_batches = [rl_micro_batch(args.micro_rows, **lengths, seed=seed)
                     for seed in range(args.rows // args.micro_rows)]
    total = sum(mb["n_tokens"] for mb in micro_batches)
    model_dir = smollm2_hf_dir()
    state.initialize(state.ParallelConfig())
    chunks = model_builder.build_model(AutoConfig.from_pretrained(model_dir))
    hf_conversion.load_hf_weights(chunks, model_dir)
    opt, sched = optimizer.build_optimizer(chunks, optimizer.OptimizerConfig(lr=1e-7, clip_grad=1.0))
    request = OutputRequest(entropy=True, remove_padding=True,
                            fused_chunk_size=args.chunk if variant == "fused" else None)

    def loss_fn(outputs, mb):
        mask = mb["response_mask"]
        log_probs, entropy = response_part(outputs["log_probs"], mb), response_part(outputs["entropy"], mb)
        return -((log_probs * mb["advantages"] + ENTROPY_COEFF * entropy) * mask).sum() / total, {}

    print(json.dumps({"ready": variant}), flush=True)
    for line in sys.stdin:
        if line.strip() != "step":
            break
        process_memory.reset_peak_rss()
        before = process_memory.rss_bytes()
        seconds = timed(lambda: optimizer.train_step(chunks, opt, sched, micro_batches, loss_fn, request))
        print(json.dumps({"seconds": seconds, "rss_before_bytes": before,
                          "peak_above_bytes": process_memory.peak_rss_bytes() - before}), flush=True)
    print(json.dumps({"peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}), flush=True)
    state.destroy()


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["variants"])
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.8))
    metrics = [("update_peak_gib", "update's peak RSS above the resident model, GiB"),
               ("best_step_seconds", "seconds per update, best (lower is better)")]
    for axis, (key, title) in zip(axes, metrics):
        values = [result["variants"][n][key] for n in names]
        bars = axis.bar(names, values, color=["#3b7dd8", "#9a9a9a"][: len(names)])
        axis.bar_label(bars, fmt="%.3g")
        axis.set_title(title, fontsize=10)
        axis.set_ylim(0, max(values) * 1.2)
    axes[0].axhline(result["logits_gib_per_micro_batch"], color="#c44", linestyle="--", linewidth=1,
                    label="one [response tokens, V] fp32 tensor")
    axes[0].legend(fontsize=8, loc="upper left")
    fig.suptitle(f"SmolLM2-135M update, fp32 CPU, {result['rows']} x {result['prompt'] + result['response']} "
                 f"tokens, micro-batches of {result['micro_rows']} sequence(s), chunk {result['chunk']}", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--response", type=int, default=1920)
    parser.add_argument("--micro-rows", type=int, default=1)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--serve", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rows % args.micro_rows:
        parser.error("--micro-rows must divide --rows")
    if args.serve:
        serve(args.serve, args)
        return
    load_before = load_average()
    served = [f"--{key.replace('_', '-')}={value}" for key, value in vars(args).items() if key != "serve"]
    # Allocations of 1 MiB and more are mapped on their own and unmapped when freed (glibc would raise this
    # threshold as it goes and keep freed memory), so the RSS between updates is what is held then.
    children = {variant: ServedVariant("bench.fused", variant, served, args.threads,
                                       env={"MALLOC_MMAP_THRESHOLD_": str(2**20)}) for variant in VARIANTS}
    try:
        # The warm-up update allocates AdamW's state: the timed ones measure the update alone.
        warmup = {variant: child.ask("step")["seconds"] for variant, child in children.items()}
        steps: dict[str, list[dict]] = {variant: [] for variant in VARIANTS}
        for _ in range(args.steps):
            for variant, child in children.items():
                steps[variant].append(child.ask("step"))
        reports = {variant: child.close() for variant, child in children.items()}
    finally:
        for child in children.values():
            child.kill()
    vocab = 49152
    logits_bytes = args.micro_rows * args.response * vocab * 4
    variants = {}
    for variant in VARIANTS:
        seconds = [step["seconds"] for step in steps[variant]]
        variants[variant] = {
            "step_seconds": seconds, "warmup_seconds": warmup[variant], "best_step_seconds": min(seconds),
            "median_step_seconds": statistics.median(seconds),
            "tokens_per_s": args.rows * (args.prompt + args.response) / min(seconds),
            "update_peak_gib": max(step["peak_above_bytes"] for step in steps[variant]) / 2**30,
            "update_peak_gib_per_step": [step["peak_above_bytes"] / 2**30 for step in steps[variant]],
            "rss_before_update_gib": steps[variant][-1]["rss_before_bytes"] / 2**30,
            "process_peak_rss_gib": reports[variant]["peak_rss_bytes"] / 2**30}
    fused, unfused = variants["fused"], variants["unfused"]
    result = {
        "model": "SmolLM2-135M-Instruct", "vocab": vocab, "dtype": "float32",
        "layout": "TP1 PP1 DP1, local spec + SDPA, packed THD, response-only outputs, torch AdamW",
        "rows": args.rows, "prompt": args.prompt, "response": args.response, "micro_rows": args.micro_rows,
        "chunk": args.chunk, "entropy_coeff": ENTROPY_COEFF, "threads": args.threads, "steps_timed": args.steps,
        "logits_gib_per_micro_batch": logits_bytes / 2**30,
        "variants": variants,
        "update_peak_saved_gib": unfused["update_peak_gib"] - fused["update_peak_gib"],
        "saved_in_logits_tensors": (unfused["update_peak_gib"] - fused["update_peak_gib"]) / (logits_bytes / 2**30),
        "time_ratio_fused_over_unfused_best": fused["best_step_seconds"] / unfused["best_step_seconds"],
        "time_ratio_fused_over_unfused_median": fused["median_step_seconds"] / unfused["median_step_seconds"],
        # Other processes sharing the cores skew the times (not the memory); recorded so a reader can tell.
        "load_average_1m_before_after": [load_before, load_average()],
        "command": "python -m bench.fused " + " ".join(sys.argv[1:]),
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "fused.json").write_text(json.dumps(result, indent=1))
    plot(result, RESULTS / "fused.png")
    for name, v in variants.items():
        print(f"{name:8s} update peak {v['update_peak_gib']:.2f} GiB (process {v['process_peak_rss_gib']:.2f} GiB)  "
              f"best {v['best_step_seconds']:.1f} s  median {v['median_step_seconds']:.1f} s")
    print(f"saved {result['update_peak_saved_gib']:.2f} GiB = {result['saved_in_logits_tensors']:.1f} x one "
          f"[{args.micro_rows * args.response}, {vocab}] fp32 tensor ({result['logits_gib_per_micro_batch']:.2f} GiB); "
          f"fused / unfused time {result['time_ratio_fused_over_unfused_median']:.2f} (median)  "
          f"load {result['load_average_1m_before_after']}")


if __name__ == "__main__":
    main()
