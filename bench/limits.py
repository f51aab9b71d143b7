"""This machine's limits, and how close a meshrl GRPO step gets to them.

Measured now (``bench.machine``, ``--threads`` threads): dense matmul FLOP/s in fp32 and bf16 and the
memory read bandwidth (``sum`` over a 512 MiB tensor). Where the meshrl run's own result file also
holds measurements (vs_trl records them before and after its run), the best of all is used: other
processes can only lower a measurement.

meshrl's per-step figures come from, in order of preference:
- ``--from FILE``: a ``bench/vs_trl.py`` result (default ``bench/results/vs_trl_fp32.json``; its meshrl side);
- ``--metrics FILE --rows N``: a trainer's ``metrics.jsonl`` (N = prompts x n per step);
- ``--run``: a small meshrl job run now with ``--steps/--prompts/--n/--response-length`` (vs_trl's meshrl side).

Per step, with N the parameter count, T the step's training tokens (prompt + response of every row),
S their mean sequence length, W = N x bytes per parameter of the rollout engine's dtype, D the decode
steps (the longest response: vLLM decodes every row of the step together), F the matmul FLOP/s of
the actor's dtype and B the read bandwidth:

    training FLOPs   = transformer_flops(T tokens at length S, forward + backward)  ~ 6·N·T + attention,
                       less the vocabulary projection (6·V·h) of the prompt tokens: only response
                       tokens' log-probs are needed, and meshrl computes only those
    decode bytes     = W · D                      (each decode step reads every weight once)
    floor_s          = training FLOPs / F + decode bytes / B   (issue 9's definition; target: step <= 1.25 x floor)
    update fraction  = training FLOPs / update_actor_s / F
    decode fraction  = decode bytes / gen_s / B   (and the decode's FLOP fraction, 2·N per generated token / gen_s / F)

``gen_over_decode_matmuls`` compares generation with what its weight matmuls alone cost on this machine
at the step's real decode batch (``bench.machine.decode_matmuls``: torch's GEMMs on M = rows per step,
times the decode steps): small-M products run far below the peak of large ones.

``matmul_floor_s`` = ``floor_train_s`` + ``decode_matmuls_s``: the step if the update did nothing but its
matrix products at the machine's peak rate and generation nothing but its weight products at the decode
batch's measured rate (no attention, norms, sampling, optimizer, sync). With a vs_trl input whose TRL side
ran, ``ceiling_speedup_vs_trl`` = TRL's median step / the median ``matmul_floor_s``: no meshrl step on this
machine can beat TRL's by more.

``corrected_floor_s`` is the floor of the step meshrl runs now, each term at what the step itself needs:

- training FLOPs with shared prompts (``actor.use_prefix_grouper``, meshrl's default): each prompt runs once per
  group of ``n`` (forward + backward), its responses after it; causal attention (token i attends to i keys, not
  to the whole sequence: half of PaLM's count); the vocabulary projection for response tokens only;
- decode at the larger of its compute at the machine's peak matmul rate (2·N and the attention per generated token
  actually generated) and its memory traffic (weights per decode step, the longest response this step generated,
  and the KV cache read per generated token);
- prefill: 2·N per unique prompt token and its causal attention (prefix caching shares a prompt between its n).

``corrected_ceiling_speedup_vs_trl`` = TRL's median step / the median ``corrected_floor_s``; ``step_over_corrected_
floor`` sits beside ``speedup_vs_trl`` in the summary. With a vs_trl input, the rates are those recorded with that
run (same machine, same time as its TRL step) when it recorded any; ``--measure-now`` adds this moment's.

``roofline_floor_s`` is stricter and closer to what the hardware allows: the decode phase costs
at least the larger of its compute (2·N and attention per generated token) and its memory traffic
(weights per decode step plus the KV cache read per generated token), and prefill adds 2·N per unique
prompt token (prefix caching shares a prompt between its n samples; the vocabulary projection only for
its last token). Neither floor counts meshrl's
log-prob recompute (``old_log_prob``), weight sync or reward scoring: an RL step with one optimizer
step does not need them, so they appear in the breakdown as time above the floor. Attention FLOPs
use the mean sequence length of the step (the metrics carry means; the attention term is ~6% of the
total here, so the error is small).

Writes ``bench/results/limits.json`` (``--out`` to write elsewhere).

    python -m bench.limits                                   (after python -m bench.vs_trl --dtype fp32)
    python -m bench.limits --from bench/results/vs_trl_bf16.json --out bench/results/limits_bf16.json
    python -m bench.limits --run --steps 1 --prompts 2 --n 2 --response-length 16 --out /tmp/limits.json   (smoke)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
from pathlib import Path

import torch

from bench.machine import (ModelShape, best_rate, decode_matmuls, kv_bytes_per_token, measure_rates, model_shape,
                           transformer_flops)

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
TARGET_STEP_OVER_FLOOR = 1.25  # issue 9: a meshrl step within 1.25x of the floor
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


def step_limits(step: dict, shape: ModelShape, *, rows: int, n: int, flops_per_s: float, read_bytes_per_s: float,
                weight_dtype_bytes: int, decode_step_matmul_s: float | None = None) -> dict:
    """Floors and achieved fractions of one meshrl step (a ``bench.vs_trl.step_record`` with meshrl's
    ``phases``); the module docstring defines every figure."""
    phases = step["phases"]
    tokens = step["prompt_tokens"] + step["response_tokens"]
    seq = tokens / rows
    # Only response tokens need their log-probs: the vocabulary projection runs for those alone.
    train_flops = transformer_flops([seq] * rows, shape, backward=True, output_tokens=step["response_tokens"])
    weight_bytes = shape.params * weight_dtype_bytes
    decode_steps = step.get("response_length_max") or step["response_tokens"] / rows
    decode_bytes = weight_bytes * decode_steps
    prompt_mean = step["prompt_tokens"] / rows
    response_mean = step["response_tokens"] / rows
    # Each generated token attends to its prompt and the response so far: on average prompt + response/2.
    context = prompt_mean + response_mean / 2
    decode_flops = step["response_tokens"] * (2 * shape.params + 4 * shape.layers * shape.hidden * context)
    kv_bytes = step["response_tokens"] * context * kv_bytes_per_token(shape, weight_dtype_bytes)
    prompts = max(rows // n, 1)  # prefill samples each prompt's last position only
    prefill_flops = transformer_flops([prompt_mean] * prompts, shape, backward=False, output_tokens=prompts)

    train_floor = train_flops / flops_per_s
    decode_floor = decode_bytes / read_bytes_per_s
    floor = train_floor + decode_floor
    roofline_decode = max(decode_flops / flops_per_s, (decode_bytes + kv_bytes) / read_bytes_per_s)
    roofline = train_floor + roofline_decode + prefill_flops / flops_per_s
    corrected_train, corrected_decode, corrected_prefill = corrected_flops(
        shape, rows=rows, n=n, prompt_mean=prompt_mean, response_mean=response_mean)
    corrected_decode_s = max(corrected_decode / flops_per_s, (decode_bytes + kv_bytes) / read_bytes_per_s)
    corrected = (corrected_train + corrected_prefill) / flops_per_s + corrected_decode_s
    update_s, gen_s, wall = phases.get("update_actor", 0.0), step["gen_s"], step["wall_s"]
    # generation's weight products alone at this decode batch, timed on this machine (None: not measured)
    decode_matmuls = decode_steps * decode_step_matmul_s if decode_step_matmul_s else None
    return {
        "step": step["step"], "wall_s": wall, "training_tokens": tokens, "mean_seq_len": seq,
        "training_flops": train_flops, "decode_steps": decode_steps, "decode_weight_bytes": decode_bytes,
        "decode_flops": decode_flops, "decode_kv_bytes": kv_bytes, "prefill_flops": prefill_flops,
        "floor_s": floor, "floor_train_s": train_floor, "floor_decode_s": decode_floor,
        "roofline_floor_s": roofline, "roofline_decode_s": roofline_decode,
        "corrected_training_flops": corrected_train, "corrected_floor_s": corrected,
        "corrected_floor_train_s": corrected_train / flops_per_s, "corrected_floor_decode_s": corrected_decode_s,
        "step_over_corrected_floor": wall / corrected,
        "step_over_floor": wall / floor, "step_over_roofline_floor": wall / roofline,
        "update_actor_s": update_s,
        "update_fraction_of_matmul_flops": train_flops / update_s / flops_per_s if update_s > 0 else None,
        "gen_s": gen_s,
        "decode_fraction_of_bandwidth": decode_bytes / gen_s / read_bytes_per_s if gen_s > 0 else None,
        "decode_fraction_of_matmul_flops": decode_flops / gen_s / flops_per_s if gen_s > 0 else None,
        "decode_matmuls_s": decode_matmuls,
        "matmul_floor_s": train_floor + decode_matmuls if decode_matmuls else None,
        "gen_over_decode_matmuls": gen_s / decode_matmuls if decode_matmuls else None,
        # Where the step's time goes relative to the floor's two terms.
        "above_floor_s": {"generation": gen_s - decode_floor, "update_actor": update_s - train_floor,
                          "old_log_prob": phases.get("old_log_prob", 0.0), "sync": phases.get("sync", 0.0),
                          "other": wall - gen_s - update_s - phases.get("old_log_prob", 0.0) - phases.get("sync", 0.0)},
    }


def corrected_flops(shape: ModelShape, *, rows: int, n: int, prompt_mean: float, response_mean: float
                    ) -> tuple[float, float, float]:
    """(training, decode, prefill) FLOPs of a step of ``rows`` = prompts x ``n`` sequences of the mean lengths, as
    meshrl runs it: each prompt once per group (shared prompts), causal attention (a token at position i attends to
    i + 1 keys: 4·layers·hidden per key, forward), the vocabulary projection for response tokens only; training is
    forward + backward (3x the forward), decode and prefill forward only."""
    groups = rows / n
    weights = 2 * shape.params
    vocab = 2 * shape.vocab * shape.hidden
    per_key = 4 * shape.layers * shape.hidden
    p, r = prompt_mean, response_mean
    prompt_attention = per_key * p * (p + 1) / 2  # keys 1..p
    response_attention = per_key * r * (p + (r + 1) / 2)  # the prompt's p keys and its own 1..r
    unique = groups * p + rows * r
    forward = weights * unique - vocab * groups * p + groups * prompt_attention + rows * response_attention
    decode = rows * r * weights + rows * response_attention
    prefill = groups * (p * (weights - vocab) + vocab + prompt_attention)  # the last position's outputs only
    return 3 * forward, decode, prefill


def summarize_limits(per_step: list[dict], warmup: int = 1, trl_step_s: float | None = None) -> dict:
    """Medians over the steps after ``warmup`` (all steps when there are not more than ``warmup``); with
    ``trl_step_s`` (TRL's median step in the same vs_trl run), the ceiling on meshrl's speed-up over it."""
    used = per_step[warmup:] if len(per_step) > warmup else per_step
    out = {"steps_used": [s["step"] for s in used]}
    for key in ("wall_s", "floor_s", "roofline_floor_s", "matmul_floor_s", "corrected_floor_s", "step_over_floor",
                "step_over_roofline_floor", "step_over_corrected_floor", "update_fraction_of_matmul_flops",
                "decode_fraction_of_bandwidth", "decode_fraction_of_matmul_flops", "gen_over_decode_matmuls"):
        values = [s[key] for s in used if s.get(key) is not None]
        out[key] = statistics.median(values) if values else None
    if trl_step_s and out["matmul_floor_s"]:
        out["trl_step_s"] = trl_step_s
        out["speedup_vs_trl"] = trl_step_s / out["wall_s"]
        out["ceiling_speedup_vs_trl"] = trl_step_s / out["matmul_floor_s"]
    if trl_step_s and out["corrected_floor_s"]:
        out["trl_step_s"] = trl_step_s
        out["speedup_vs_trl"] = trl_step_s / out["wall_s"]
        out["corrected_ceiling_speedup_vs_trl"] = trl_step_s / out["corrected_floor_s"]
    out["target_step_over_floor"] = TARGET_STEP_OVER_FLOOR
    out["meets_target"] = out["step_over_floor"] is not None and out["step_over_floor"] <= TARGET_STEP_OVER_FLOOR
    return out


def meshrl_source(args) -> dict:
    """meshrl's steps, their settings and any rates recorded with them, from the chosen input."""
    from bench import vs_trl

    if args.run:
        s = vs_trl.Settings(steps=args.steps, prompts=args.prompts, n=args.n, response_length=args.response_length,
                            threads=args.threads)
        from meshrl.models.embedded import smollm2_hf_dir
        from meshrl.runtime import cache_dir

        work = cache_dir() / "bench" / "limits"
        work.mkdir(parents=True, exist_ok=True)
        prompts = vs_trl.write_prompts(s, smollm2_hf_dir(), work / "prompts.jsonl")
        budget = s.micro_batch * (prompts["prompt_tokens_max"] + s.response_length)
        side = vs_trl.run_meshrl(s, work, Path(prompts["file"]), budget)
        if side["status"] != "ok":
            raise SystemExit(f"limits: the meshrl run failed: {side['error']}")
        return {"input": f"--run ({side['log']})", "steps": side["steps"], "rows": s.rows, "n": s.n,
                "rollout_dtype": "float32", "actor_dtype": "float32", "recorded_rates": [], "trl_step_s": None}
    if args.metrics:
        from meshrl.trainer.tracking import read_metrics

        if not args.rows or not args.n:
            raise SystemExit("limits: --metrics needs --rows (prompts x n per step) and --n")
        steps = [vs_trl.meshrl_step(r, args.rows) for r in read_metrics(args.metrics) if "timing/step_s" in r]
        return {"input": str(args.metrics), "steps": steps, "rows": args.rows, "n": args.n,
                "rollout_dtype": args.rollout_dtype, "actor_dtype": "float32", "recorded_rates": [], "trl_step_s": None}
    path = Path(args.source)
    if not path.is_file():
        raise SystemExit(f"limits: {path} does not exist; run `python -m bench.vs_trl --dtype fp32` first, "
                         "or pass --metrics FILE --rows N --n N, or --run")
    result = json.loads(path.read_text())
    side = result["sides"]["meshrl"]
    if side.get("status") != "ok":
        raise SystemExit(f"limits: the meshrl side of {path} did not run: {side.get('error')}")
    settings = result["settings"]
    rollout = "bfloat16" if result["dtype"] == "bf16" else "float32"
    return {"input": str(path), "steps": side["steps"], "rows": settings["rows_per_step"], "n": settings["n"],
            "rollout_dtype": rollout, "actor_dtype": "float32",
            "recorded_rates": [result["machine"].get("rates_before"), result["machine"].get("rates_after")],
            "trl_step_s": (result.get("summary") or {}).get("trl", {}).get("step_s")}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--from", dest="source", default=str(RESULTS / "vs_trl_fp32.json"))
    p.add_argument("--metrics", type=Path, help="a meshrl metrics.jsonl instead of a vs_trl result")
    p.add_argument("--rows", type=int, help="with --metrics: rows (prompts x n) per step")
    p.add_argument("--n", type=int, default=4, help="with --metrics/--run: completions per prompt")
    p.add_argument("--rollout-dtype", choices=tuple(DTYPE_BYTES), default="float32", help="with --metrics")
    p.add_argument("--run", action="store_true", help="run a small meshrl job now instead")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--response-length", type=int, default=128)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--out", type=Path, default=None,
                   help="default: bench/results/limits_<input's name>.json (limits_run.json with --run)")
    p.add_argument("--measure-now", action="store_true",
                   help="also measure this machine's rates now (best of those and the run's; the default uses the "
                        "rates recorded with a vs_trl input, the same run and machine as its TRL step)")
    p.add_argument("--rates-from", type=Path, help="a limits JSON whose machine measurements (rates, decode matmuls) "
                   "to reuse instead of measuring now: on a busy machine, the figures of a quiet one")
    args = p.parse_args(argv)

    source = meshrl_source(args)
    if args.out is None:
        name = "run" if args.run else Path(args.metrics or args.source).stem
        args.out = RESULTS / f"limits_{name}.json"
    from meshrl.models.embedded import smollm2_hf_dir

    shape = model_shape(smollm2_hf_dir())
    if args.rates_from:
        earlier = json.loads(args.rates_from.read_text())["machine"]
        measured, decode = earlier["measured_now"], earlier["decode_matmuls"]
        if decode["rows"] != source["rows"]:
            raise SystemExit(f"limits: {args.rates_from} measured decode matmuls at {decode['rows']} rows, "
                             f"this input decodes {source['rows']}; measure now instead (drop --rates-from)")
        print(f"limits: machine measurements from {args.rates_from} (load average {measured['load_average']})")
    else:
        print(f"limits: measuring matmul FLOP/s and memory bandwidth ({args.threads} threads)", flush=True)
        measured = measure_rates(args.threads)
        rollout_dtype = torch.bfloat16 if source["rollout_dtype"] == "bfloat16" else torch.float32
        decode = decode_matmuls(smollm2_hf_dir(), rows=source["rows"], threads=args.threads, dtype=rollout_dtype)
    recorded = [r for r in source["recorded_rates"] if r]
    flops_key = "matmul_flops_bf16" if source["actor_dtype"] == "bfloat16" else "matmul_flops_fp32"
    # the run's own rates where it recorded them (its machine, its time: the floor and TRL's step then pair); this
    # moment's as well only when asked, or when the input recorded none
    used = recorded + ([measured] if args.measure_now or not recorded else [])
    rates = {key: best_rate(*(r.get(key) for r in used))
             for key in ("matmul_flops_fp32", "matmul_flops_bf16", "read_bytes_per_s", "copy_bytes_per_s")}
    rates_rule = ("best of the rates recorded with the run" + (" and measured now" if len(used) > len(recorded)
                                                              else "") if recorded else "measured now")
    per_step = [step_limits(step, shape, rows=source["rows"], n=source["n"], flops_per_s=rates[flops_key],
                            read_bytes_per_s=rates["read_bytes_per_s"],
                            weight_dtype_bytes=DTYPE_BYTES[source["rollout_dtype"]],
                            decode_step_matmul_s=decode["seconds_per_step"])
                for step in source["steps"]]
    summary = summarize_limits(per_step, trl_step_s=source["trl_step_s"])
    result = {
        "benchmark": "limits", "input": source["input"],
        "machine": {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine(),
                    "threads": args.threads, "measured_now": measured, "recorded_with_run": recorded,
                    "rates_used": rates, "rates_rule": rates_rule + " (others' load only lowers a measurement)",
                    "decode_matmuls": decode},
        "model_shape": shape.as_dict(), "actor_dtype": source["actor_dtype"], "rollout_dtype": source["rollout_dtype"],
        "flops_per_s_used": rates[flops_key], "rows_per_step": source["rows"], "n": source["n"],
        "steps": per_step, "summary": summary,
        "command": "python -m bench.limits " + " ".join(sys.argv[1:] if argv is None else argv),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    g = 1e9
    print(f"machine: matmul fp32 {rates['matmul_flops_fp32'] / g:.0f} GFLOP/s, "
          f"bf16 {rates['matmul_flops_bf16'] / g:.1f} "
          f"GFLOP/s, read {rates['read_bytes_per_s'] / g:.1f} GB/s (load average {measured['load_average']}); "
          f"a decode step's matmuls at {decode['rows']} rows: {decode['seconds_per_step'] * 1e3:.0f} ms "
          f"({decode['flops_per_s'] / g:.0f} GFLOP/s)")
    for st in per_step:
        print(f"step {st['step']}: {st['wall_s']:.1f} s vs floor {st['floor_s']:.1f} s ({st['step_over_floor']:.2f}x; "
              f"roofline {st['roofline_floor_s']:.1f} s, {st['step_over_roofline_floor']:.2f}x)  update "
              f"{_pct(st['update_fraction_of_matmul_flops'])} of FLOP/s  "
              f"decode {_pct(st['decode_fraction_of_bandwidth'])} "
              f"of bandwidth, {_pct(st['decode_fraction_of_matmul_flops'])} of FLOP/s, "
              f"{st['gen_over_decode_matmuls']:.2f}x its matmuls' time")
    if "ceiling_speedup_vs_trl" in summary:
        print(f"TRL's step {summary['trl_step_s']:.1f} s: meshrl {summary['speedup_vs_trl']:.2f}x faster; "
              "at its matmul "
              f"floor ({summary['matmul_floor_s']:.1f} s) it would be {summary['ceiling_speedup_vs_trl']:.2f}x")
    if "corrected_ceiling_speedup_vs_trl" in summary:
        print(f"corrected floor {summary['corrected_floor_s']:.1f} s (shared prompts, causal attention, decode at the "
              f"peak rate, measured lengths): meshrl's step is {summary['step_over_corrected_floor']:.2f}x it; at it "
              f"meshrl would be {summary['corrected_ceiling_speedup_vs_trl']:.2f}x TRL")
    print(f"median step/floor {summary['step_over_floor']:.2f}x (target <= {TARGET_STEP_OVER_FLOOR}: "
          f"{'met' if summary['meets_target'] else 'NOT met'}); wrote {args.out}")
    return 0


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.0f}%"


if __name__ == "__main__":
    sys.exit(main())
