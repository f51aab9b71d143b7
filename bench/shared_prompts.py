"""Shared-prompt training (``actor.use_prefix_grouper``): a group's prompt run once for its ``n`` responses.

SmolLM2-135M fp32 at TP1 on CPU, one micro-batch of ``--prompts`` groups of ``--n`` responses in the policy
worker's layout (``meshrl.workers.sequences.build_micro_batch``), prompt and response lengths drawn uniformly
(seeded; the defaults are ``bench.vs_trl``'s GSM8K lengths). Two variants, alternating after a warm-up each so both
see the same background load:

- ``packed``: every row packed with its own copy of the prompt (THD, ``use_remove_padding``);
- ``shared``: the shared-prompt layout (``meshrl.parallel.shared_prefix``).

Each is timed on the update (forward + backward + clip + AdamW step) and on the forward-only old-log-prob pass; the
outputs of the two are compared (max |difference| of the log-probs). Tokens/s counts the rows' real tokens (the same
numerator for both); the positions each variant computes are reported beside them.

Writes bench/results/shared_prompts.{json,png}.

    python -m bench.shared_prompts [--prompts 4] [--n 4] [--prompt 100 130] [--response 20 128] [--steps 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch

from bench.machine import load_average, timed

RESULTS = Path(__file__).resolve().parent / "results"
VARIANTS = ("packed", "shared")


def grouped_micro_batch(prompts: int, n: int, prompt: tuple[int, int], response: tuple[int, int],
                        seed: int = 0) -> dict:
    """A worker-layout micro-batch of ``prompts`` groups of ``n`` responses each, random tokens and advantages."""
    from meshrl.protocol import Batch
    from meshrl.workers.sequences import build_micro_batch

    g = torch.Generator().manual_seed(seed)
    rows = prompts * n
    prompt_ids = [torch.randint(10, 49152, (int(torch.randint(prompt[0], prompt[1] + 1, (), generator=g)),),
                                generator=g).tolist() for _ in range(prompts)]
    response_lens = torch.randint(response[0], response[1] + 1, (rows,), generator=g)
    width = int(response_lens.max())
    mask = (torch.arange(width) < response_lens[:, None]).float()
    batch = Batch(tensors={"responses": torch.randint(10, 49152, (rows, width), generator=g), "response_mask": mask,
                           "advantages": torch.randn(rows, 1, generator=g) * mask},
                  non_tensors={"prompt_ids": [prompt_ids[row // n] for row in range(rows)]})
    micro = build_micro_batch(batch, pad_id=0, response_fields=("advantages",))
    micro["n_tokens"] = float(mask.sum())
    return micro


def policy_gradient_loss(outputs: dict, micro: dict):
    """``-sum(log_prob * advantage * mask) / n_tokens`` over the response tokens of ``grouped_micro_batch``'s rows."""
    from meshrl.workers.sequences import response_part

    log_probs = response_part(outputs["log_probs"], micro)
    return -(log_probs * micro["advantages"] * micro["response_mask"]).sum() / micro["n_tokens"], {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--prompt", type=int, nargs=2, default=(100, 130))
    parser.add_argument("--response", type=int, nargs=2, default=(20, 128))
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--out", default="shared_prompts", help="file stem under bench/results/")
    args = parser.parse_args()

    from transformers import AutoConfig

    from meshrl.models.embedded import smollm2_hf_dir
    from meshrl.parallel import forward, hf_conversion, model_builder, optimizer, schedule, state
    from meshrl.parallel.forward import OutputRequest
    from meshrl.runtime import configure_environment

    configure_environment()
    torch.set_num_threads(args.threads)
    load_before = load_average()
    micro = grouped_micro_batch(args.prompts, args.n, tuple(args.prompt), tuple(args.response))
    model_dir = smollm2_hf_dir()
    state.initialize(state.ParallelConfig())
    chunks = model_builder.build_model(AutoConfig.from_pretrained(model_dir))
    hf_conversion.load_hf_weights(chunks, model_dir)
    opt, sched = optimizer.build_optimizer(chunks, optimizer.OptimizerConfig(lr=1e-7, clip_grad=1.0))
    requests = {variant: OutputRequest(remove_padding=True, shared_prompts=variant == "shared") for variant in VARIANTS}

    def update(variant: str) -> float:
        return timed(lambda: optimizer.train_step(chunks, opt, sched, [micro], policy_gradient_loss, requests[variant]))

    def log_probs(variant: str) -> float:
        return timed(lambda: schedule.forward_only(chunks, [micro], requests[variant]))

    outputs = {variant: schedule.forward_only(chunks, [micro], requests[variant])[0]["log_probs"]
               for variant in VARIANTS}
    seconds = {(phase, variant): [] for phase in ("update", "log_prob") for variant in VARIANTS}
    for variant in VARIANTS:  # warm-up
        update(variant)
    for _ in range(args.steps):
        for variant in VARIANTS:
            seconds["update", variant].append(update(variant))
            seconds["log_prob", variant].append(log_probs(variant))
    mask = micro["attention_mask"]
    real = int(mask.sum())
    computed = {"packed": forward.pack_thd(micro["input_ids"], mask, 1).input_ids.shape[1],
                "shared": forward.pack_shared(micro["input_ids"], mask, micro["response_start"], 1).input_ids.shape[1]}
    variants = {variant: {phase: {"seconds": seconds[phase, variant],
                                  "tokens_per_s": real / min(seconds[phase, variant]),
                                  "median_tokens_per_s": real / statistics.median(seconds[phase, variant])}
                          for phase in ("update", "log_prob")} | {"positions_computed": computed[variant]}
                for variant in VARIANTS}
    result = {
        "model": "SmolLM2-135M-Instruct", "dtype": "float32", "layout": "TP1 PP1 DP1, local spec + SDPA, packed",
        "prompts": args.prompts, "n": args.n, "prompt_range": list(args.prompt),
        "response_range": list(args.response), "real_tokens": real, "response_tokens": int(micro["output_mask"].sum()),
        "threads": args.threads, "steps_timed": args.steps, "variants": variants,
        "speedup_update_best": (variants["shared"]["update"]["tokens_per_s"]
                                / variants["packed"]["update"]["tokens_per_s"]),
        "speedup_log_prob_best": (variants["shared"]["log_prob"]["tokens_per_s"]
                                  / variants["packed"]["log_prob"]["tokens_per_s"]),
        "positions_ratio": computed["shared"] / computed["packed"],
        "log_prob_max_abs_diff": float((outputs["shared"] - outputs["packed"]).abs().max()),
        "load_average_1m_before_after": [load_before, load_average()],
        "command": "python -m bench.shared_prompts " + " ".join(sys.argv[1:]),
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.out}.json").write_text(json.dumps(result, indent=1))
    plot(result, RESULTS / f"{args.out}.png")
    for variant, values in variants.items():
        print(f"{variant:7s} update {values['update']['tokens_per_s']:6.1f} tok/s  old-log-prob "
              f"{values['log_prob']['tokens_per_s']:6.1f} tok/s  ({values['positions_computed']} positions for "
              f"{real} tokens)")
    print(f"shared vs packed: update {result['speedup_update_best']:.2f}x, old-log-prob "
          f"{result['speedup_log_prob_best']:.2f}x, positions {result['positions_ratio']:.2f}x, log-probs differ by "
          f"{result['log_prob_max_abs_diff']:.1e}; load {result['load_average_1m_before_after']}")
    state.destroy()


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    phases = ("update", "log_prob")
    for offset, variant in zip((-0.2, 0.2), VARIANTS):
        values = [result["variants"][variant][phase]["tokens_per_s"] for phase in phases]
        ax.bar([i + offset for i in range(len(phases))], values, width=0.4, label=variant)
    ax.set_xticks(range(len(phases)), ["update (fwd+bwd+step)", "old-log-prob (fwd)"])
    ax.set_ylabel("real tokens / s (best)")
    ax.set_title(f"SmolLM2-135M fp32 CPU, {result['prompts']} prompts x {result['n']} responses: shared "
                 f"{result['speedup_update_best']:.2f}x / {result['speedup_log_prob_best']:.2f}x", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
