"""Dynamic batching vs fixed-size micro-batches at rollout scale: 16,384 sequences, 24,000-token budget.

Lengths: the empirical GSM8K distribution. Every GSM8K test row gives one length, its chat-templated
prompt (SmolLM2's template and tokenizer, as :class:`meshrl.data.dataset.RLDataset` builds it) plus
its tokenised reference answer (prompt 57–239 tokens, answer 30–400); 16,384 rows are drawn from the
1,319 with replacement (seeded). Reported for one rank's batch:

- ``dynamic``: :func:`meshrl.data.dynamic_batching.plan_micro_batches` (Karmarkar–Karp, strict
  budget): partition time, budget utilisation (tokens / budget per micro-batch: min, median), the
  padding ratio if each micro-batch were padded to its longest sequence, and the padding with
  packing (``use_remove_padding``, slots padded to a multiple of 8 = 2·TP·CP for TP 2, CP 2).
- ``fixed_same_count``: the same number of micro-batches, equal sample counts in rollout order
  (``ppo_micro_batch_size_per_gpu``): how often the budget is exceeded, utilisation, padding.
- ``fixed_safe``: the largest fixed count that can never exceed the budget,
  ``floor(budget / (max_prompt_length + max_response_length))`` = 24000 // 1536 = 15 (the seed
  recipe's limits): how many micro-batches that takes, utilisation, padding.

Writes bench/results/batching.json and bench/results/batching.png.

    python -m bench.batching [--sequences 16384] [--budget 24000] [--seed 0]     (from the repo root)
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import time
from pathlib import Path

import numpy as np

from meshrl.data.dynamic_batching import plan_micro_batches
from meshrl.parallel.packing import pad_multiple_for

RESULTS = Path(__file__).resolve().parent / "results"
MAX_SEQ_LEN = 512 + 1024  # data.max_prompt_length + data.max_response_length of the seed recipe


def gsm8k_lengths() -> np.ndarray:
    """Prompt (chat-templated) + reference-answer token counts of the 1,319 GSM8K test rows."""
    from meshrl.runtime import configure_environment

    configure_environment()
    from transformers import AutoTokenizer

    from meshrl.data.preprocess import build_rows
    from meshrl.models.embedded import smollm2_hf_dir

    tokenizer = AutoTokenizer.from_pretrained(smollm2_hf_dir())
    rows = build_rows("gsm8k", "test")
    prompts = tokenizer.apply_chat_template([r["prompt"] for r in rows], add_generation_prompt=True, tokenize=False)
    prompt_ids = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    # +1: the response ends with the end-of-turn token.
    answer_ids = tokenizer([r["extra_info"]["answer"] for r in rows], add_special_tokens=False)["input_ids"]
    return np.array([len(p) + len(a) + 1 for p, a in zip(prompt_ids, answer_ids, strict=True)], dtype=np.int64)


def split_stats(parts: list[np.ndarray], budget: int) -> dict[str, float]:
    tokens = np.array([p.sum() for p in parts], dtype=np.float64)
    padded = sum(len(p) * int(p.max()) for p in parts if len(p))
    util = tokens / budget
    return {
        "num_micro_batches": len(parts),
        "samples_min": int(min(len(p) for p in parts)),
        "samples_max": int(max(len(p) for p in parts)),
        "tokens_max": int(tokens.max()),
        "over_budget": int((tokens > budget).sum()),
        "budget_utilisation_min": float(util.min()),
        "budget_utilisation_median": float(np.median(util)),
        "padding_ratio_padded_to_longest": float(1 - tokens.sum() / padded),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", type=int, default=16384)
    parser.add_argument("--budget", type=int, default=24000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    source = gsm8k_lengths()
    lengths = np.random.default_rng(args.seed).choice(source, size=args.sequences, replace=True)

    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        plan = plan_micro_batches(lengths, args.budget)
        times.append(time.perf_counter() - start)
    dyn_parts = [lengths[mb] for mb in plan.micro_batches]
    multiple = pad_multiple_for(tp_size=2, cp_size=2)
    packed_slots = int(sum((-(-lengths // multiple) * multiple).tolist()))
    dynamic = split_stats(dyn_parts, args.budget)
    dynamic.update(
        partition_seconds_median=statistics.median(times),
        num_oversized=len(plan.oversized),
        padding_ratio_packed=1 - int(lengths.sum()) / packed_slots,
        packed_pad_multiple=multiple,
    )

    k = plan.num_micro_batches
    same_count = [lengths[idx] for idx in np.array_split(np.arange(len(lengths)), k)]
    safe_size = args.budget // MAX_SEQ_LEN
    safe = [lengths[i : i + safe_size] for i in range(0, len(lengths), safe_size)]
    results = {
        "setup": {
            "sequences": args.sequences,
            "budget": args.budget,
            "seed": args.seed,
            "length_source": "GSM8K test: SmolLM2 chat-templated prompt + reference answer + 1, resampled",
            "length_min": int(lengths.min()),
            "length_median": float(np.median(lengths)),
            "length_mean": float(lengths.mean()),
            "length_max": int(lengths.max()),
            "total_tokens": int(lengths.sum()),
            "lower_bound_micro_batches": math.ceil(int(lengths.sum()) / args.budget),
            "machine": f"{platform.processor() or platform.machine()}, python {platform.python_version()}",
        },
        "dynamic": dynamic,
        "fixed_same_count": split_stats(same_count, args.budget),
        "fixed_safe": {"samples_per_micro_batch": safe_size, **split_stats(safe, args.budget)},
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "batching.json").write_text(json.dumps(results, indent=2) + "\n")
    plot(
        lengths,
        {"dynamic (KK)": dyn_parts, f"fixed, {k} micro-batches": same_count, f"fixed, {safe_size} samples": safe},
        args.budget,
    )
    print(json.dumps(results, indent=2))


def plot(lengths: np.ndarray, splits: dict[str, list[np.ndarray]], budget: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_len, ax_tok) = plt.subplots(1, 2, figsize=(12, 4.2))
    ax_len.hist(lengths, bins=60, color="0.4")
    ax_len.set(title=f"Sequence lengths ({len(lengths):,} GSM8K-like)", xlabel="tokens", ylabel="sequences")
    # Dynamic last and thicker: it sits just under the budget line and would hide behind the others.
    styles = [dict(lw=1), dict(lw=1), dict(lw=2.2)]
    for (name, parts), style in zip(reversed(list(splits.items())), styles, strict=True):
        tokens = np.array([p.sum() for p in parts])
        x = np.arange(len(tokens)) / max(len(tokens) - 1, 1)
        ax_tok.plot(x, tokens / budget, label=f"{name} ({len(tokens)})", **style)
    ax_tok.axhline(1.0, color="red", ls="--", lw=0.8, label="budget")
    ax_tok.set(
        title=f"Tokens per micro-batch / budget ({budget:,})",
        xlabel="micro-batch (execution order, normalised)",
        ylabel="budget utilisation",
    )
    ax_tok.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(RESULTS / "batching.png", dpi=120)


if __name__ == "__main__":
    main()
