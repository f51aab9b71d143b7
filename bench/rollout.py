"""Rollout on CPU: generation throughput (vLLM vs the HF fallback) and weight-sync cost, SmolLM2-135M.

Generation: GSM8K test questions, chat-templated as the trainer builds them
(``meshrl.data.preprocess.build_rows``), 4 samples each at temperature 1, at most 256 tokens, the
model's EOS ends a response; the full workload is 64 prompts x 4 x 256 tokens. Both engines get the
same prompts and settings, one after the other in this process, with the same torch thread count
(``--threads``); tokens/s = generated tokens / wall time of the ``generate`` call (the engines draw
different samples, so token counts differ a little). The machine is shared, so each measurement also
records this process's CPU time (tokens per CPU-second, less sensitive to other processes' load)
and the load average around it.

- vLLM runs the full workload.
- The HF engine decodes in batches of 64 sequences, one after another, so its rate is that of one
  batch: it runs the first ``--hf-prompts`` (16) prompts x 4 = one batch, and its full-workload time
  is reported as a projection, labelled as such.
- ``--quick``: 16 prompts x 4 x 128 tokens for both (the full time of each is then a projection).

Weight sync: the 135M model's 272 tensors (538 MB fp32) streamed from an HF copy as fresh buffers
(the way ``iter_hf_weights`` yields them, so the time includes making them) into the running
in-process vLLM engine, for several bucket sizes, after one warm-up sync: wall time and bytes/s;
then, in a second pass, the peak bytes of stream tensors alive at once (``LiveBytesMeter``: the
sync's extra memory) and the peak RSS growth sampled every 2 ms (for that pass glibc is told to
return freed blocks of >= 64 KiB to the OS at once, so RSS follows live memory).

Writes bench/results/rollout.json and bench/results/rollout.png.

    python -m bench.rollout [--quick] [--threads 1] [--hf-prompts 16] [--skip-hf]   (from the repo root)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import threading
import time
from pathlib import Path

from meshrl import process_memory

RESULTS = Path(__file__).resolve().parent / "results"
FULL = dict(prompts=64, n=4, max_tokens=256)
QUICK = dict(prompts=16, n=4, max_tokens=128)
BUCKETS_MIB = (16, 128, 1024)
MIB = 1 << 20


class PeakRSS:
    """Samples this process's RSS in a thread; ``peak - start`` is the growth during the block (the
    baseline is taken after returning free heap pages to the OS)."""

    def __init__(self, interval_s: float = 0.002) -> None:
        import psutil

        self._process = psutil.Process()
        self._interval = interval_s
        self._stop = threading.Event()
        self.start = self.peak = 0

    def _poll(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._process.memory_info().rss)
            time.sleep(self._interval)

    def __enter__(self) -> PeakRSS:
        process_memory.trim_heap()
        self.start = self.peak = self._process.memory_info().rss
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._process.memory_info().rss)


def return_freed_memory_to_the_os() -> None:
    """glibc: serve allocations >= 64 KiB with mmap (its adaptive default keeps freed tensors of up to
    32 MiB in the heap, which would hide the difference between bucket sizes in RSS)."""
    process_memory.set_mmap_threshold(64 << 10)


def gsm8k_prompts(model_dir: Path, count: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    from meshrl.data.preprocess import build_rows

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rows = build_rows("gsm8k", "test")[:count]
    texts = tokenizer.apply_chat_template([r["prompt"] for r in rows], add_generation_prompt=True, tokenize=False)
    return tokenizer(texts, add_special_tokens=False)["input_ids"]


def measure_generation(engine, prompts, n: int, max_tokens: int) -> dict:
    from meshrl.rollout import SamplingConfig

    sampling = SamplingConfig(n=n, temperature=1.0, max_response_length=max_tokens, seed=0)
    load = os.getloadavg()[0]
    start, cpu_start = time.perf_counter(), time.process_time()
    completions = engine.generate(prompts, sampling)
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    tokens = sum(len(c.token_ids) for c in completions)
    return {"prompts": len(prompts), "n": n, "max_tokens": max_tokens, "seconds": round(seconds, 1),
            "generated_tokens": tokens, "tokens_per_s": round(tokens / seconds, 1),
            "cpu_seconds": round(cpu_seconds, 1), "tokens_per_cpu_s": round(tokens / cpu_seconds, 1),
            "stopped_at_eos": sum(c.finish_reason == "stop" for c in completions),
            "load_average_1min_before": round(load, 2), "load_average_1min_after": round(os.getloadavg()[0], 2)}


def measure_sync(engine, model) -> list[dict]:
    """Per bucket size: wall time with the default allocator, then memory with ``mallopt`` set."""
    from meshrl.rollout import LiveBytesMeter

    def fresh():  # new buffers, as iter_hf_weights yields them
        return ((name, param.detach().clone()) for name, param in model.named_parameters())

    engine.load_weights(model.named_parameters())  # warm-up: vLLM's first reload allocates for good
    rows = []
    for bucket_mib in BUCKETS_MIB:
        start = time.perf_counter()
        stats = engine.load_weights(fresh(), bucket_bytes=bucket_mib * MIB)
        seconds = time.perf_counter() - start
        rows.append({"bucket_mib": bucket_mib, "seconds": round(seconds, 3), "tensors": stats.tensors,
                     "bytes": stats.bytes, "buckets": stats.buckets, "mb_per_s": round(stats.bytes / seconds / 1e6, 1)})
    return_freed_memory_to_the_os()  # slows allocation: memory pass only, after the timings
    for row in rows:
        meter = LiveBytesMeter()
        with PeakRSS() as rss:
            engine.load_weights(meter.wrap(fresh()), bucket_bytes=row["bucket_mib"] * MIB)
        row.update(peak_stream_mib=round(meter.peak / MIB, 1),
                   peak_rss_growth_mib=round((rss.peak - rss.start) / MIB, 1))
    return rows


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    gen = result["generation"]
    names = [k for k in ("vllm", "hf") if k in gen]
    labels = [f"{k}\n{gen[k]['prompts']}x{gen[k]['n']}x{gen[k]['max_tokens']}" for k in names]
    positions = range(len(names))
    for offset, (rate, label, color) in enumerate([("tokens_per_s", "per wall second", "tab:blue"),
                                                  ("tokens_per_cpu_s", "per CPU second", "tab:cyan")]):
        bars = left.bar([p + (offset - 0.5) * 0.38 for p in positions], [gen[k][rate] for k in names],
                        width=0.38, color=color, label=label)
        left.bar_label(bars, fmt="%.0f")
    left.set_xticks(list(positions), labels)
    left.legend(fontsize=8)
    left.set_title(f"generation, SmolLM2-135M fp32, CPU ({result['threads']} thread(s))\n"
                   "prompts x samples x max tokens")
    left.set_ylabel("generated tokens")
    sync = result["weight_sync"]
    x = [str(r["bucket_mib"]) for r in sync]
    right.bar(x, [r["peak_stream_mib"] for r in sync], color="tab:orange", label="peak stream tensors alive")
    right.plot(x, [r["peak_rss_growth_mib"] for r in sync], "k^", label="peak RSS growth (sampled)")
    right.axhline(sync[0]["bytes"] / MIB, color="tab:red", ls="--", label="model size")
    right.set_xlabel("bucket size (MiB)")
    right.set_ylabel("MiB")
    twin = right.twinx()
    twin.plot(x, [r["seconds"] for r in sync], "o-", color="tab:green", label="sync time")
    twin.set_ylabel("sync seconds")
    twin.set_ylim(0, 1.3 * max(r["seconds"] for r in sync))
    right.set_title(f"weight sync into the running vLLM engine (in process)\n"
                    f"{sync[0]['tensors']} tensors, {sync[0]['bytes'] / 1e6:.0f} MB")
    handles = right.get_legend_handles_labels()[0] + twin.get_legend_handles_labels()[0]
    right.legend(handles=handles, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help=f"{QUICK} for both engines")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads for both engines")
    parser.add_argument("--hf-prompts", type=int, default=16, help="prompts the HF engine runs (full mode)")
    parser.add_argument("--skip-hf", action="store_true", help="vLLM only")
    parser.add_argument("--kv-cache-gib", type=float, default=2.0)
    args = parser.parse_args()
    workload = QUICK if args.quick else FULL
    hf_prompts = workload["prompts"] if args.quick else args.hf_prompts

    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # vLLM's sampler compile: ~20 s, same outputs
    from meshrl.runtime import configure_environment

    configure_environment()
    import torch

    from meshrl.models.embedded import smollm2_hf_dir
    from meshrl.rollout import EngineConfig, SamplingConfig, create_engine

    torch.set_num_threads(args.threads)
    model_dir = smollm2_hf_dir()
    prompts = gsm8k_prompts(model_dir, workload["prompts"])
    result: dict = {"model": "SmolLM2-135M-Instruct (fp32)", "device": "cpu", "cpu_count": os.cpu_count(),
                    "threads": args.threads, "machine": platform.platform(), "quick": args.quick,
                    "workload": workload, "prompt_tokens_mean": round(sum(map(len, prompts)) / len(prompts), 1)}

    start = time.perf_counter()
    engine = create_engine(model_dir, EngineConfig(max_model_len=1024, max_num_seqs=256,
                                                   kv_cache_memory_bytes=int(args.kv_cache_gib * (1 << 30)),
                                                   generation_threads=args.threads))
    result["vllm_start_seconds"] = round(time.perf_counter() - start, 1)
    engine.generate(prompts[:2], SamplingConfig(max_response_length=4))  # warm-up
    generation = {"vllm": measure_generation(engine, prompts, workload["n"], workload["max_tokens"])}
    print("vllm", generation["vllm"], flush=True)

    if not args.skip_hf:  # while the idle vLLM engine waits (in process: no threads of its own)
        hf = create_engine(model_dir, EngineConfig(name="hf", hf_batch_size=64, max_model_len=1024))
        torch.set_num_threads(args.threads)
        hf.generate(prompts[:2], SamplingConfig(max_response_length=4))  # warm-up
        generation["hf"] = measure_generation(hf, prompts[:hf_prompts], workload["n"], workload["max_tokens"])
        print("hf", generation["hf"], flush=True)
        for rate in ("tokens_per_s", "tokens_per_cpu_s"):
            generation[f"vllm_over_hf_{rate}"] = round(generation["vllm"][rate] / generation["hf"][rate], 2)
        hf.shutdown()
        del hf

    from transformers import AutoModelForCausalLM

    policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    result["weight_sync"] = measure_sync(engine, policy)
    print("sync", result["weight_sync"], flush=True)
    engine.shutdown()
    del engine, policy
    result["generation"] = generation
    full_tokens = FULL["prompts"] * FULL["n"] * FULL["max_tokens"]
    projected = {k: round(full_tokens / generation[k]["tokens_per_s"]) for k in ("vllm", "hf")
                 if k in generation and (args.quick or k == "hf")}
    if projected:
        result["projected_full_workload"] = {
            "note": ("PROJECTION, not measured: the full workload's token cap (64 x 4 x 256) divided by "
                     "the rate measured above"),
            **{f"{k}_seconds": v for k, v in projected.items()}}

    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "rollout.json").write_text(json.dumps(result, indent=1) + "\n")
    plot(result, RESULTS / "rollout.png")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
