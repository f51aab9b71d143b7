"""CPU timings of meshrl.algorithms at rollout scale: 8,192 responses × 1,024 tokens (fp32).

Times every advantage estimator, the KL-in-reward step and the PPO (`vanilla`) loss with its
aggregation and backward pass; writes the median of a few repeats (ms per call) to
bench/results/algorithms.json and prints a table. Single-threaded (torch.set_num_threads(1)) so the
figures do not depend on what else shares the machine's cores.

    python -m bench.algorithms [--responses 8192] [--tokens 1024] [--repeats 3]     (from the repo root)
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from meshrl.algorithms import (
    ADVANTAGE_ESTIMATORS,
    GlobalNorm,
    aggregate_loss,
    apply_kl_penalty,
    call_with_available,
    vanilla,
)

RESULTS = Path(__file__).resolve().parent / "results" / "algorithms.json"


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up: first-touch allocation, lazy init
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def make_batch(responses: int, tokens: int, group_size: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, tokens + 1, (responses,), generator=generator)
    mask = torch.arange(tokens) < lengths.unsqueeze(-1)
    rewards = torch.zeros(responses, tokens)
    rewards[torch.arange(responses), lengths - 1] = torch.randint(0, 2, (responses,), generator=generator).float()
    return {
        "token_rewards": rewards,
        "response_mask": mask,
        "uid": torch.arange(responses) // group_size,
        "values": torch.randn(responses, tokens, generator=generator),
        "greedy_scores": torch.rand(responses, generator=generator),
        "log_prob": -torch.rand(responses, tokens, generator=generator) * 3,
        "ref_log_prob": -torch.rand(responses, tokens, generator=generator) * 3,
        "advantages": torch.randn(responses, tokens, generator=generator),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--responses", type=int, default=8192)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    load_before = os.getloadavg()[0]

    batch = make_batch(args.responses, args.tokens, args.group_size)
    estimator_inputs = {k: batch[k] for k in ("token_rewards", "response_mask", "uid", "values", "greedy_scores")}
    mask = batch["response_mask"]
    timings: dict[str, float] = {}

    for name in ADVANTAGE_ESTIMATORS.names():
        run = functools.partial(call_with_available, ADVANTAGE_ESTIMATORS.get(name), **estimator_inputs)
        timings[f"advantage/{name}"] = median_ms(run, args.repeats)

    timings["kl/apply_kl_penalty(k3)"] = median_ms(
        lambda: apply_kl_penalty(
            batch["token_rewards"], batch["log_prob"], batch["ref_log_prob"], mask, kl_coef=0.001, kl_type="k3"
        ),
        args.repeats,
    )

    norm = GlobalNorm.from_mask(mask)
    old_log_prob = batch["log_prob"] + 0.1 * torch.randn_like(batch["log_prob"])

    def vanilla_forward_backward() -> None:
        log_prob = batch["log_prob"].clone().requires_grad_(True)
        out = vanilla(log_prob, old_log_prob, batch["advantages"], mask, clip_ratio_high=0.28)
        aggregate_loss(out.loss, mask, "token-mean", norm).backward()

    timings["policy_loss/vanilla+token-mean+backward"] = median_ms(vanilla_forward_backward, args.repeats)

    report = {
        "responses": args.responses,
        "tokens": args.tokens,
        "group_size": args.group_size,
        "dtype": "float32",
        "threads": torch.get_num_threads(),
        "repeats": args.repeats,
        "statistic": "median ms per call (after one warm-up call)",
        "torch": torch.__version__,
        "machine": platform.processor() or platform.machine(),
        # The machine's cores are shared: a 1-minute load above the core count means noisy timings.
        "load_avg_1min": {"before": load_before, "after": os.getloadavg()[0], "cores": os.cpu_count()},
        "ms": {name: round(ms, 1) for name, ms in timings.items()},
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(report, indent=2) + "\n")

    width = max(map(len, timings))
    load = report["load_avg_1min"]
    print(
        f"{args.responses} responses × {args.tokens} tokens, fp32, 1 thread, median of {args.repeats} "
        f"(1-min load {load['before']:.1f} → {load['after']:.1f} on {load['cores']} cores)"
    )
    for name, ms in timings.items():
        print(f"{name:<{width}}  {ms:9.1f} ms")
    print(f"written to {RESULTS}")


if __name__ == "__main__":
    main()
