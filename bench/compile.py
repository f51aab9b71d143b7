"""``actor.use_torch_compile`` and the fused AdamW kernel on CPU: a SmolLM2-135M actor update, side by side in one run.

Three variants of one meshrl.parallel update (TP1, fp32, the ``bench.actor`` batch and policy-gradient loss):

- ``eager, loop AdamW``: no compile, torch AdamW's per-parameter loop (``OptimizerConfig.fused_adam=False``: what
  megatron builds without TE/apex, and meshrl's optimizer before the fused kernel);
- ``eager, fused AdamW``: no compile, torch's fused AdamW kernel (meshrl's default);
- ``compiled, fused AdamW``: ``meshrl.parallel.compiled.compile_elementwise`` (norms, SwiGLU, rotary under
  ``torch.compile(dynamic=True)``, inductor C++) and the fused kernel.

Each variant lives in its own process (its peak RSS is its own) with an empty inductor cache of its own (the
compile warm-up measured is a first run's), and the parent interleaves their updates after one warm-up each, so
all see the same background load. Reported per variant: the first update's seconds (for the compiled variant:
compilation included), the best and median of the timed updates and of their optimizer steps (clip + AdamW),
peak RSS, and the first update's loss and gradient norm (same weights, same batch: eager vs compiled numerics).
Then each compiled region alone (``region_seconds``: one RMSNorm, SwiGLU and rotary call forward + backward at
the batch's token count, best of 20, eager and compiled alternating). The 1-minute load average before and after
is recorded: on a shared machine it skews every timing.

Writes bench/results/compile.json and bench/results/compile.png.

    python -m bench.compile [--batch 4] [--seq 256] [--steps 3] [--threads 2]     (from the repo root)
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.actor import make_batch, pg_loss
from bench.machine import ServedVariant, load_average, timed, write_result

VARIANTS = {"eager, loop AdamW": dict(compile=False, fused_adam=False),
            "eager, fused AdamW": dict(compile=False, fused_adam=True),
            "compiled, fused AdamW": dict(compile=True, fused_adam=True)}
KEYS = {name: name.replace(", ", "-").replace(" ", "_") for name in VARIANTS}  # command-line spelling


def update_closure(model_dir: Path, mb: dict, compile: bool, fused_adam: bool):
    """(one update, the list its optimizer-step seconds are appended to, compiled regions or None)."""
    from transformers import AutoConfig

    from meshrl.parallel import compiled, hf_conversion, model_builder, optimizer, state
    from meshrl.parallel.forward import OutputRequest

    state.initialize(state.ParallelConfig())
    chunks = model_builder.build_model(AutoConfig.from_pretrained(model_dir))
    hf_conversion.load_hf_weights(chunks, model_dir)
    regions = compiled.compile_elementwise(chunks) if compile else None
    opt, sched = optimizer.build_optimizer(chunks, optimizer.OptimizerConfig(lr=1e-6, clip_grad=1.0,
                                                                             fused_adam=fused_adam))
    step_seconds: list[float] = []
    step = optimizer.optimizer_step

    def timed_step(opt_):
        start = time.perf_counter()
        try:
            return step(opt_)
        finally:
            step_seconds.append(time.perf_counter() - start)

    optimizer.optimizer_step = timed_step  # train_step looks it up at call time

    def loss_fn(outputs, micro_batch):
        return pg_loss(outputs["log_probs"], micro_batch), {}

    return (lambda: optimizer.train_step(chunks, opt, sched, [mb], loss_fn, OutputRequest())), step_seconds, regions


def region_seconds(tokens: int, reps: int) -> dict[str, dict[str, float]]:
    """Forward + backward seconds (best of ``reps``, eager and compiled calls alternating) of each compiled region
    alone at SmolLM2's shapes over ``tokens`` tokens: one RMSNorm of the hidden state, one SwiGLU of the MLP's
    ``[tokens, 2 x 1536]``, one rotary of the queries ``[tokens, 1, 9, 64]``; eager as the model runs it without
    the key. Short calls timed many times: the best is little disturbed by other processes."""
    import torch.nn.functional as F
    from megatron.core.fusions import fused_bias_swiglu
    from megatron.core.models.common.embeddings import rope_utils

    from meshrl.parallel import compiled

    g = torch.Generator().manual_seed(0)
    compiled._install_compiled_swiglu()
    norm = torch.nn.RMSNorm(576, eps=1e-5)
    compiled_norm = torch.nn.RMSNorm(576, eps=1e-5)
    compiled_norm.compile(dynamic=True)
    freqs = torch.randn(tokens, 1, 1, 64, generator=g)
    eager_rope, compiled_rope = (rope_utils._apply_rotary_pos_emb_bshd,
                                 compiled._compile(rope_utils._apply_rotary_pos_emb_bshd))

    def glu(y):  # megatron's MLP without bias_activation_fusion
        a, b = torch.chunk(y, 2, dim=-1)
        return F.silu(a) * b

    regions = {
        "rmsnorm": ((tokens, 1, 576), norm, compiled_norm),
        "swiglu": ((tokens, 1, 2 * 1536), glu, lambda y: fused_bias_swiglu.SwiGLUFunction.apply(y, False, False)),
        "rotary": ((tokens, 1, 9, 64), lambda t: eager_rope(t, freqs), lambda t: compiled_rope(t, freqs)),
    }
    result = {}
    for name, (shape, eager, fast) in regions.items():
        x = torch.randn(shape, generator=g)
        best = {"eager": float("inf"), "compiled": float("inf")}
        for rep in range(reps + 1):  # the first round compiles
            for kind, fn in (("eager", eager), ("compiled", fast)):
                leaf = x.clone().requires_grad_()
                seconds = timed(lambda: fn(leaf).sum().backward())
                if rep:
                    best[kind] = min(best[kind], seconds)
        result[name] = {**best, "speedup": best["eager"] / best["compiled"]}
    return result


def serve(variant: str, batch: int, seq: int, threads: int) -> None:
    """Child: load, say ready, then one update per ``step`` line on stdin (``regions``: :func:`region_seconds`);
    ``done`` reports peak RSS."""
    from meshrl.models.embedded import smollm2_hf_dir
    from meshrl.runtime import configure_environment

    configure_environment()
    torch.set_num_threads(threads)
    if variant == "regions":
        print(json.dumps({"ready": variant}), flush=True)
        for line in sys.stdin:
            if line.strip() != "regions":
                break
            print(json.dumps(region_seconds(batch * seq, 20)), flush=True)
        return
    name = {key: name for name, key in KEYS.items()}[variant]
    update, step_seconds, regions = update_closure(smollm2_hf_dir(), make_batch(batch, seq), **VARIANTS[name])
    print(json.dumps({"ready": variant, "regions": regions}), flush=True)
    for line in sys.stdin:
        if line.strip() != "step":
            break
        result = {}
        seconds = timed(lambda: result.update(update()))
        print(json.dumps({"seconds": seconds, "optimizer_seconds": step_seconds[-1], "loss": result["loss"],
                          "grad_norm": result["grad_norm"]}), flush=True)
    print(json.dumps({"peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}), flush=True)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["variants"])
    fig, axes = plt.subplots(1, 4, figsize=(16, 4))
    metrics = [("best_update_seconds", "update, s (best; lower is better)"),
               ("best_optimizer_seconds", "optimizer step, s (best)"),
               ("first_update_seconds", "first update, s (compile warm-up)"),
               ("peak_rss_gib", "peak RSS, GiB")]
    for axis, (key, title) in zip(axes, metrics):
        bars = axis.bar(range(len(names)), [result["variants"][n][key] for n in names],
                        color=["#9a9a9a", "#3b7dd8", "#d8873b"][: len(names)])
        axis.set_xticks(range(len(names)), [n.replace(", ", ",\n") for n in names], fontsize=8)
        axis.bar_label(bars, fmt="%.3g")
        axis.set_title(title, fontsize=10)
    load = result["machine"]["load_average_1m_before_after"]
    fig.suptitle(f"SmolLM2-135M actor update, fp32 CPU, {result['batch']}x{result['seq']} tokens, "
                 f"{result['threads']} threads, load average {load[0]:.0f} -> {load[1]:.0f} (updates interleaved)",
                 fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--serve", choices=[*KEYS.values(), "regions"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.batch, args.seq, args.threads)
        return
    load_before = load_average()
    cache_root = Path(tempfile.mkdtemp(prefix="bench-compile-", dir=Path(__file__).resolve().parents[1] / ".cache"))
    children, first, timed_runs = {}, {}, {name: [] for name in VARIANTS}
    try:
        for name, key in KEYS.items():
            # A cache of its own per variant: the warm-up measured is a first run's compilation.
            env = {"TORCHINDUCTOR_CACHE_DIR": str(cache_root / key), "TORCHDYNAMO_DISABLE": "0"}
            children[name] = ServedVariant("bench.compile", key, ["--batch", str(args.batch), "--seq", str(args.seq),
                                                                  "--threads", str(args.threads)], args.threads, env)
        for name, child in children.items():
            first[name] = child.ask("step")
        for _ in range(args.steps):
            for name, child in children.items():
                timed_runs[name].append(child.ask("step"))
        reports = {name: child.close() for name, child in children.items()}
        regions_child = ServedVariant("bench.compile", "regions", ["--batch", str(args.batch), "--seq", str(args.seq),
                                                                   "--threads", str(args.threads)], args.threads,
                                      {"TORCHINDUCTOR_CACHE_DIR": str(cache_root / "regions"),
                                       "TORCHDYNAMO_DISABLE": "0"})
        children["regions"] = regions_child
        regions = regions_child.ask("regions")
    finally:
        for child in children.values():
            child.kill()
        shutil.rmtree(cache_root, ignore_errors=True)
    reference = first["eager, loop AdamW"]
    variants = {}
    for name in VARIANTS:
        updates = [run["seconds"] for run in timed_runs[name]]
        steps = [run["optimizer_seconds"] for run in timed_runs[name]]
        variants[name] = {
            **VARIANTS[name],
            "first_update_seconds": first[name]["seconds"],
            "update_seconds": updates, "best_update_seconds": min(updates),
            "median_update_seconds": statistics.median(updates),
            "optimizer_seconds": steps, "best_optimizer_seconds": min(steps),
            "median_optimizer_seconds": statistics.median(steps),
            "tokens_per_s": args.batch * args.seq / min(updates),
            "peak_rss_gib": reports[name]["peak_rss_bytes"] / 2**30,
            "first_loss": first[name]["loss"], "first_grad_norm": first[name]["grad_norm"],
            "first_loss_minus_reference": first[name]["loss"] - reference["loss"],
            "first_grad_norm_minus_reference": first[name]["grad_norm"] - reference["grad_norm"],
        }
    load = [load_before, load_average()]  # other processes sharing the cores skew every timing
    result = {
        "model": "SmolLM2-135M-Instruct", "dtype": "float32", "batch": args.batch, "seq": args.seq,
        "threads": args.threads, "steps_timed": args.steps,
        "layout": "TP1 PP1 DP1, megatron local spec (RMSNorm) + SDPA core attention, fused output layer off",
        "machine": {"cpus": os.cpu_count(), "torch": torch.__version__, "load_average_1m_before_after": load},
        "variants": variants, "regions_forward_backward_seconds": regions,
        "command": "python -m bench.compile " + " ".join(sys.argv[1:]),
    }
    write_result("compile", result, plot)
    for name, v in variants.items():
        print(f"{name:22s} update best {v['best_update_seconds']:6.2f} s median {v['median_update_seconds']:6.2f} s, "
              f"optimizer best {v['best_optimizer_seconds']:5.2f} s, first {v['first_update_seconds']:6.1f} s, "
              f"peak RSS {v['peak_rss_gib']:.2f} GiB, first loss / grad norm - eager loop's: "
              f"{v['first_loss_minus_reference']:.2e} / {v['first_grad_norm_minus_reference']:.2e}")
    for name, r in regions.items():
        print(f"{name:8s} forward + backward, best of 20: eager {r['eager'] * 1e3:.2f} ms, compiled "
              f"{r['compiled'] * 1e3:.2f} ms ({r['speedup']:.2f}x)")
    print(f"load average {load}")

if __name__ == "__main__":
    main()
