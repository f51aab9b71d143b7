"""Actor update throughput on CPU: meshrl.parallel (megatron-core, TP1) vs plain transformers + torch AdamW.

One update = forward, backward, grad clipping (1.0) and AdamW step of SmolLM2-135M-Instruct (fp32) on
the same batch (default 8 sequences x 256 tokens, one micro-batch) with a policy-gradient loss on
per-token log-probs, ``-sum(log_prob * advantage * mask) / n_tokens``.

Each variant lives in its own process (so its peak RSS is its own) and the parent interleaves their
updates — meshrl, hf, meshrl, hf, ... after one warm-up each — so both see the same background load
(the machine's cores are shared). Between updates the parent measures the fp32 matmul rate
(``torch.mm`` 2048^3, best of 3, same thread count); each update's achieved FLOP/s is divided by the
mean of the rates measured just before and after it. Reported per variant: the best update (least
disturbed by other processes, like ``timeit``'s minimum; the headline figures and the chart) and the
median.

Model FLOPs per update (PaLM's convention, attention not halved for causality):
``tokens * (6 * N + 12 * layers * hidden * seq_len)``, N = all parameters (the tied embedding counts
once, as the vocabulary projection).

Writes bench/results/actor.json and bench/results/actor.png.

    python -m bench.actor [--batch 8] [--seq 256] [--steps 5] [--threads 2]     (from the repo root)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import sys
from pathlib import Path

import torch

from bench.machine import ServedVariant, matmul_flops, model_shape, timed, transformer_flops

RESULTS = Path(__file__).resolve().parent / "results"
VARIANTS = ("meshrl", "hf")


def make_batch(batch: int, seq: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    mask = torch.ones(batch, seq, dtype=torch.long)
    loss_mask = mask.float()
    loss_mask[:, 0] = 0
    return {"input_ids": torch.randint(0, 49152, (batch, seq), generator=g), "attention_mask": mask,
            "advantages": torch.randn(batch, seq, generator=g), "loss_mask": loss_mask,
            "n_tokens": float(loss_mask.sum())}


def pg_loss(log_probs: torch.Tensor, mb: dict) -> torch.Tensor:
    return -(log_probs * mb["advantages"] * mb["loss_mask"]).sum() / mb["n_tokens"]


def meshrl_update(model_dir: Path, mb: dict):
    """A closure running one meshrl.parallel actor update (TP1, megatron optimizer)."""
    from transformers import AutoConfig

    from meshrl.parallel import hf_conversion, model_builder, optimizer, state
    from meshrl.parallel.forward import OutputRequest

    state.initialize(state.ParallelConfig())
    chunks = model_builder.build_model(AutoConfig.from_pretrained(model_dir))
    hf_conversion.load_hf_weights(chunks, model_dir)
    opt, sched = optimizer.build_optimizer(chunks, optimizer.OptimizerConfig(lr=1e-6, clip_grad=1.0))

    def loss_fn(outputs, micro_batch):
        return pg_loss(outputs["log_probs"], micro_batch), {}

    return lambda: optimizer.train_step(chunks, opt, sched, [mb], loss_fn, OutputRequest())


def hf_update(model_dir: Path, mb: dict):
    """A closure running one plain transformers + torch AdamW update."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.01)

    def step():
        opt.zero_grad(set_to_none=True)
        logits = model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"]).logits
        log_probs = torch.zeros_like(mb["advantages"])
        log_probs[:, 1:] = torch.log_softmax(logits[:, :-1].float(), dim=-1).gather(
            -1, mb["input_ids"][:, 1:, None]).squeeze(-1)
        pg_loss(log_probs, mb).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    return step


def serve(variant: str, batch: int, seq: int, threads: int) -> None:
    """Child: load, say ready, then run one update per ``step`` line on stdin; ``done`` reports peak RSS."""
    from meshrl.models.embedded import smollm2_hf_dir
    from meshrl.runtime import configure_environment

    configure_environment()
    torch.set_num_threads(threads)
    update = (meshrl_update if variant == "meshrl" else hf_update)(smollm2_hf_dir(), make_batch(batch, seq))
    print(json.dumps({"ready": variant}), flush=True)
    for line in sys.stdin:
        if line.strip() == "step":
            print(json.dumps({"seconds": timed(update)}), flush=True)
        else:
            break
    print(json.dumps({"peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}), flush=True)


def model_flops_per_update(batch: int, seq: int) -> tuple[float, int]:
    from meshrl.models.embedded import smollm2_hf_dir

    shape = model_shape(smollm2_hf_dir())
    return transformer_flops([seq] * batch, shape, backward=True), shape.params


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["variants"])
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.8))
    metrics = [("tokens_per_s", "tokens / s, best update (higher is better)"),
               ("fraction_of_matmul_flops", "fraction of measured fp32 matmul FLOP/s"),
               ("peak_rss_gib", "peak RSS, GiB (lower is better)")]
    for axis, (key, title) in zip(axes, metrics):
        values = [result["variants"][n][key] for n in names]
        bars = axis.bar(names, values, color=["#3b7dd8", "#9a9a9a"][: len(names)])
        axis.bar_label(bars, fmt="%.3g")
        axis.set_title(title, fontsize=10)
    axes[1].axhline(0.75, color="#c44", linestyle="--", linewidth=1, label="target 0.75")
    axes[1].legend(fontsize=8, loc="lower right")
    fig.suptitle(f"SmolLM2-135M actor update, fp32 CPU, {result['batch']}x{result['seq']} tokens, "
                 f"{result['threads']} threads (updates interleaved)", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--serve", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.batch, args.seq, args.threads)
        return
    torch.set_num_threads(args.threads)
    flops, params = model_flops_per_update(args.batch, args.seq)
    load_before = os.getloadavg()
    children = {variant: ServedVariant("bench.actor", variant, ["--batch", str(args.batch), "--seq", str(args.seq),
                                                                "--threads", str(args.threads)], args.threads)
                for variant in VARIANTS}
    try:
        for child in children.values():
            child.ask("step")  # warm-up
        seconds: dict[str, list[float]] = {v: [] for v in VARIANTS}
        fractions: dict[str, list[float]] = {v: [] for v in VARIANTS}
        rates: dict[str, list[float]] = {v: [] for v in VARIANTS}
        before = matmul_flops()
        for _ in range(args.steps):
            for variant, child in children.items():
                took = child.ask("step")["seconds"]
                after = matmul_flops()
                rate = (before + after) / 2
                seconds[variant].append(took)
                rates[variant].append(rate)
                fractions[variant].append(flops / took / rate)
                before = after
        reports = {variant: child.close() for variant, child in children.items()}
    finally:
        for child in children.values():
            child.kill()
    variants = {}
    for variant in VARIANTS:
        median, best = statistics.median(seconds[variant]), min(seconds[variant])
        variants[variant] = {
            "step_seconds": seconds[variant],
            "best_step_seconds": best,
            "tokens_per_s": args.batch * args.seq / best,
            "fraction_of_matmul_flops": fractions[variant][seconds[variant].index(best)],
            "achieved_flops": flops / best,
            "median_step_seconds": median,
            "median_tokens_per_s": args.batch * args.seq / median,
            "median_fraction_of_matmul_flops": statistics.median(fractions[variant]),
            "matmul_flops_around_each_step": rates[variant],
            "matmul_flops": statistics.median(rates[variant]),
            "fraction_of_matmul_flops_per_step": fractions[variant],
            "peak_rss_gib": reports[variant]["peak_rss_bytes"] / 2**30,
        }
    result = {
        "model": "SmolLM2-135M-Instruct", "params": params, "dtype": "float32", "batch": args.batch,
        "seq": args.seq, "threads": args.threads, "steps_timed": args.steps,
        "model_flops_per_update": flops,
        "meshrl_layout": "TP1 PP1 DP1, megatron local spec (RMSNorm) + SDPA core attention, torch AdamW",
        "machine": {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine(),
                    "torch": torch.__version__,
                    # Other processes sharing the cores skew absolute figures; recorded so a reader can tell.
                    "load_average_1m_before_after": [load_before[0], os.getloadavg()[0]]},
        "variants": variants,
        "command": "python -m bench.actor " + " ".join(sys.argv[1:]),
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "actor.json").write_text(json.dumps(result, indent=1))
    plot(result, RESULTS / "actor.png")
    for name, v in variants.items():
        print(f"{name:7s} best {v['tokens_per_s']:6.1f} tok/s ({v['best_step_seconds']:.2f} s, "
              f"{v['fraction_of_matmul_flops']:.2f} of matmul)  median {v['median_tokens_per_s']:6.1f} tok/s "
              f"({v['median_fraction_of_matmul_flops']:.2f})  matmul {v['matmul_flops'] / 1e9:.0f} GFLOP/s  "
              f"peak RSS {v['peak_rss_gib']:.2f} GiB")


if __name__ == "__main__":
    main()
