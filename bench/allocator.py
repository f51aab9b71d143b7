"""The policy update under glibc's allocator settings, side by side: time, page faults, peak memory.

meshrl's workers fix glibc's mmap threshold at 1 MiB (``meshrl.process_memory``): every freed tensor of 1 MiB or
more goes back to the system, so the update's activations do not stay resident in later phases, at the price of a
page fault for each page of each such tensor the next time one is allocated. This bench runs the update of
SmolLM2-135M-Instruct (fp32, TP1, shared prompts and packed sequences as the job runs them) on a vs_trl-sized step
(default 8 prompts x 4 responses, prompts of 90-130 tokens, responses of 20-128, two micro-batches) in one process
per variant, interleaving their updates so all see the same background load:

- ``fixed``: the default (``MESHRL_MALLOC_MMAP_THRESHOLD`` unset: 1 MiB; ``glibc.malloc.hugetlb=1`` as workers get);
- ``dynamic``: glibc's own threshold (``MESHRL_MALLOC_MMAP_THRESHOLD=dynamic``), huge pages as above;
- ``fixed@<commit>`` (``--baseline <commit>``): the default settings on meshrl as of ``<commit>`` (a git worktree),
  to show what a change to the update's allocations did.

Per update: wall seconds, minor page faults, system CPU seconds (the kernel's share: page faults and zeroing), and
the peak resident memory above the process's resident memory when the update started (``VmHWM`` reset before it).
The heap is trimmed after each update, as the worker does. Reported: the median over ``--steps`` updates after one
warm-up. Writes bench/results/allocator.json and .png.

    python -m bench.allocator [--steps 3] [--baseline <commit>]     (from the repo root)
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.machine import ServedVariant, load_average, timed, write_result

REPO = Path(__file__).resolve().parents[1]
SETTINGS = {"fixed": {}, "dynamic": {"MESHRL_MALLOC_MMAP_THRESHOLD": "dynamic"}}


def serve(variant: str, args: argparse.Namespace) -> None:
    """A variant's process: builds the model and the step, then runs an update per ``update`` line."""
    import torch
    from transformers import AutoConfig

    from bench.shared_prompts import grouped_micro_batch, policy_gradient_loss
    from meshrl import process_memory
    from meshrl.models.embedded import smollm2_hf_dir
    from meshrl.parallel import hf_conversion, model_builder, optimizer, state
    from meshrl.parallel.forward import OutputRequest
    from meshrl.runtime import configure_environment

    threshold = process_memory.limit_heap_growth()  # what a worker does first
    configure_environment()
    torch.set_num_threads(args.threads)
    micro_batches = [grouped_micro_batch(args.prompts, args.n, tuple(args.prompt), tuple(args.response), seed=seed)
                     for seed in range(args.micro_batches)]
    model_dir = smollm2_hf_dir()
    state.initialize(state.ParallelConfig())
    chunks = model_builder.build_model(AutoConfig.from_pretrained(model_dir))
    hf_conversion.load_hf_weights(chunks, model_dir)
    opt, sched = optimizer.build_optimizer(chunks, optimizer.OptimizerConfig(lr=1e-7, clip_grad=1.0))
    request = OutputRequest(remove_padding=True, shared_prompts=True)

    print(json.dumps({"ready": True, "mmap_threshold": threshold,
                      "tokens": sum(int(m["attention_mask"].sum()) for m in micro_batches)}), flush=True)
    for line in sys.stdin:
        if line.strip() == "done":
            print(json.dumps({"peak_rss_gib": process_memory.peak_rss_bytes() / 2**30}), flush=True)
            return
        start_rss = process_memory.rss_bytes()
        process_memory.reset_peak_rss()
        before = resource.getrusage(resource.RUSAGE_SELF)
        wall = timed(lambda: optimizer.train_step(chunks, opt, sched, micro_batches, policy_gradient_loss, request))
        after = resource.getrusage(resource.RUSAGE_SELF)
        peak = process_memory.peak_rss_bytes()
        process_memory.trim_heap()
        print(json.dumps({"seconds": wall, "minor_faults": after.ru_minflt - before.ru_minflt,
                          "system_s": after.ru_stime - before.ru_stime,
                          "peak_above_start_gib": (peak - start_rss) / 2**30}), flush=True)


def baseline_folder(commit: str, scratch: Path) -> Path:
    """A folder to start a variant in whose ``import meshrl`` is meshrl as of ``commit`` (a detached worktree under
    ``scratch``) and whose ``import bench`` is this one: ``python -m`` puts its working folder first on the path."""
    tree = scratch / "tree"
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(tree), commit], check=True,
                   capture_output=True)
    folder = scratch / "start"
    folder.mkdir()
    (folder / "meshrl").symlink_to(tree / "meshrl")
    (folder / "bench").symlink_to(REPO / "bench")
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--prompt", type=int, nargs=2, default=(90, 130))
    parser.add_argument("--response", type=int, nargs=2, default=(20, 128))
    parser.add_argument("--micro-batches", type=int, default=2)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--baseline", metavar="COMMIT", help="also run the default settings on meshrl as of COMMIT")
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args)
        return

    from meshrl.process_memory import allocator_environment
    from meshrl.runtime import cache_dir

    passed = ["--prompts", str(args.prompts), "--n", str(args.n), "--prompt", *map(str, args.prompt),
              "--response", *map(str, args.response), "--micro-batches", str(args.micro_batches),
              "--threads", str(args.threads)]
    os.environ.pop("MESHRL_MALLOC_MMAP_THRESHOLD", None)  # each variant says its own
    variants = {name: {**allocator_environment(), **extra} for name, extra in SETTINGS.items()}
    folders = {name: REPO for name in variants}
    served: dict[str, ServedVariant] = {}
    with tempfile.TemporaryDirectory(prefix="allocator-") as scratch:
        if args.baseline:
            name = f"fixed@{args.baseline}"
            # this checkout's cache: the worktree would convert the embedded model again into its own .cache
            variants[name] = {**allocator_environment(), "MESHRL_CACHE_DIR": str(cache_dir())}
            folders[name] = baseline_folder(args.baseline, Path(scratch))
        try:
            load_before = load_average()
            for name, extra in variants.items():
                served[name] = ServedVariant("bench.allocator", name, passed, args.threads, env=extra,
                                             cwd=folders[name])
            for proc in served.values():
                proc.ask("update")  # warm-up
            runs = {name: [] for name in served}
            for _ in range(args.steps):
                for name, proc in served.items():
                    runs[name].append(proc.ask("update"))
            peaks = {name: proc.close()["peak_rss_gib"] for name, proc in served.items()}
        finally:
            for proc in served.values():
                proc.kill()
            if args.baseline:
                subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(Path(scratch) / "tree")],
                               check=False, capture_output=True)
    summary = {name: {key: statistics.median(run[key] for run in rows)
                      for key in ("seconds", "minor_faults", "system_s", "peak_above_start_gib")}
               | {"process_peak_rss_gib": peaks[name]} for name, rows in runs.items()}
    result = {
        "model": "SmolLM2-135M-Instruct", "dtype": "float32", "layout": "TP1, packed, shared prompts",
        "step": {"prompts": args.prompts, "n": args.n, "prompt_range": list(args.prompt),
                 "response_range": list(args.response), "micro_batches": args.micro_batches},
        "threads": args.threads, "steps_timed": args.steps,
        "variants": {name: {"environment": variants[name], "updates": runs[name], "median": summary[name]}
                     for name in runs},
        "ratios_to_fixed": {name: {key: summary[name][key] / summary["fixed"][key]
                                   for key in ("seconds", "minor_faults", "peak_above_start_gib")}
                            for name in summary},
        "load_average_1m_before_after": [load_before, load_average()],
        "command": "python -m bench.allocator " + " ".join(sys.argv[1:]),
    }
    path = write_result("allocator", result, plot)
    for name, values in summary.items():
        print(f"{name:18s} update {values['seconds']:6.1f} s  faults {values['minor_faults']:>10,.0f}  system "
              f"{values['system_s']:5.1f} s  peak above start {values['peak_above_start_gib']:.2f} GiB")
    print(f"wrote {path}")


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["variants"])
    medians = [result["variants"][name]["median"] for name in names]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    for ax, key, label in zip(axes, ("seconds", "minor_faults", "peak_above_start_gib"),
                              ("update (s)", "minor page faults", "peak above start (GiB)")):
        ax.bar(names, [m[key] for m in medians], color=["#4c72b0", "#dd8452", "#8c8c8c", "#55a868"][:len(names)])
        ax.set_title(label)
        ax.tick_params(axis="x", labelrotation=20)
    fig.suptitle("SmolLM2-135M update under glibc allocator settings (median of "
                 f"{result['steps_timed']}; {result['step']['prompts']}x{result['step']['n']} rows)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
