"""Actor update on RL-like variable lengths, meshrl.parallel at TP1 on CPU, in three variants:

- ``packed``: THD micro-batches (``use_remove_padding=True``), outputs for response tokens only (the
  ``output_mask`` the workers send) — meshrl's default;
- ``packed_all_outputs``: the same without ``output_mask``: every position runs the vocabulary projection;
- ``rows``: the row layout (each row trimmed to the micro-batch's longest), response outputs only.

One micro-batch of ``--rows`` sequences laid out as the policy worker lays them out
(``meshrl.workers.sequences.build_micro_batch``: prompts left-padded, responses right-padded), prompt
and response lengths drawn uniformly from ``--prompt`` and ``--response`` (seeded). SmolLM2-135M fp32,
one forward + backward + clip + AdamW step per update, the same model and optimizer for all variants,
whose updates alternate (packed, packed_all_outputs, rows, packed, ...) after one warm-up each so all
see the same background load. Tokens/s counts real tokens only (the same numerator for all); the
positions each variant computes are reported beside them. The 1-minute load average is recorded before and after.

Writes bench/results/packing.json.

    python -m bench.packing [--rows 6] [--prompt 60 150] [--response 40 450] [--steps 2] [--threads 2]
    python -m bench.packing --rows 8 --prompt 100 130 --response 20 128 --out packing_gsm8k.json   (vs_trl's lengths)
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
VARIANTS = {"packed": (True, True), "packed_all_outputs": (True, False), "rows": (False, True)}  # (packed, masked)


def rl_micro_batch(rows: int, prompt: tuple[int, int], response: tuple[int, int], seed: int = 0) -> dict:
    """A worker-layout micro-batch with random tokens, advantages and uniform random lengths."""
    from meshrl.protocol import Batch
    from meshrl.workers.sequences import build_micro_batch

    g = torch.Generator().manual_seed(seed)
    prompt_lens = torch.randint(prompt[0], prompt[1] + 1, (rows,), generator=g)
    response_lens = torch.randint(response[0], response[1] + 1, (rows,), generator=g)
    width = int(response_lens.max())
    mask = (torch.arange(width) < response_lens[:, None]).float()
    batch = Batch(tensors={"responses": torch.randint(10, 49152, (rows, width), generator=g), "response_mask": mask,
                           "advantages": torch.randn(rows, 1, generator=g) * mask},
                  non_tensors={"prompt_ids": [torch.randint(10, 49152, (int(n),), generator=g).tolist()
                                              for n in prompt_lens]})
    micro = build_micro_batch(batch, pad_id=0, response_fields=("advantages",))
    micro["n_tokens"] = float(mask.sum())
    return micro


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=6)
    parser.add_argument("--prompt", type=int, nargs=2, default=(60, 150))
    parser.add_argument("--response", type=int, nargs=2, default=(40, 450))
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--out", default="packing.json", help="file name under bench/results/")
    args = parser.parse_args()

    from transformers import AutoConfig

    from meshrl.models.embedded import smollm2_hf_dir
    from meshrl.parallel import hf_conversion, model_builder, optimizer, state
    from meshrl.parallel.forward import OutputRequest
    from meshrl.runtime import configure_environment
    from meshrl.workers.sequences import response_part

    configure_environment()
    torch.set_num_threads(args.threads)
    load_before = load_average()
    micro = rl_micro_batch(args.rows, tuple(args.prompt), tuple(args.response))
    model_dir = smollm2_hf_dir()
    state.initialize(state.ParallelConfig())
    chunks = model_builder.build_model(AutoConfig.from_pretrained(model_dir))
    hf_conversion.load_hf_weights(chunks, model_dir)
    opt, sched = optimizer.build_optimizer(chunks, optimizer.OptimizerConfig(lr=1e-7, clip_grad=1.0))

    def loss_fn(outputs, mb):
        log_probs = response_part(outputs["log_probs"], mb)
        return -(log_probs * mb["advantages"] * mb["response_mask"]).sum() / mb["n_tokens"], {}

    unmasked = {key: value for key, value in micro.items() if key != "output_mask"}

    def update(variant: str) -> float:
        packed, masked = VARIANTS[variant]
        request = OutputRequest(remove_padding=packed)
        batch = micro if masked else unmasked
        return timed(lambda: optimizer.train_step(chunks, opt, sched, [batch], loss_fn, request))

    seconds: dict[str, list[float]] = {variant: [] for variant in VARIANTS}
    warmup = {variant: update(variant) for variant in VARIANTS}
    for _ in range(args.steps):
        for variant in VARIANTS:
            seconds[variant].append(update(variant))
    mask = micro["attention_mask"]
    real, outputs = int(mask.sum()), int(micro["output_mask"].sum())
    computed = {"packed": real, "packed_all_outputs": real, "rows": int(mask.shape[0] * mask.sum(1).max())}
    layouts = {variant: {"step_seconds": seconds[variant], "warmup_seconds": warmup[variant],
                         "tokens_per_s": real / min(seconds[variant]),
                         "median_tokens_per_s": real / statistics.median(seconds[variant]),
                         "positions_computed": computed[variant],
                         "vocabulary_projections": outputs if VARIANTS[variant][1] else computed[variant]}
               for variant in VARIANTS}
    result = {
        "model": "SmolLM2-135M-Instruct", "dtype": "float32", "layout": "TP1 PP1 DP1, local spec + SDPA",
        "rows": args.rows, "prompt_range": list(args.prompt), "response_range": list(args.response),
        "sequence_lengths": mask.sum(1).tolist(), "real_tokens": real, "response_tokens": outputs,
        "threads": args.threads, "steps_timed": args.steps, "layouts": layouts,
        "speedup_best": layouts["packed"]["tokens_per_s"] / layouts["rows"]["tokens_per_s"],
        "output_mask_speedup_best": layouts["packed"]["tokens_per_s"] / layouts["packed_all_outputs"]["tokens_per_s"],
        # Other processes sharing the cores skew absolute figures; recorded so a reader can tell.
        "load_average_1m_before_after": [load_before, load_average()],
        "command": "python -m bench.packing " + " ".join(sys.argv[1:]),
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / args.out).write_text(json.dumps(result, indent=1))
    for layout, values in layouts.items():
        print(f"{layout:18s} best {values['tokens_per_s']:6.1f} tok/s  median {values['median_tokens_per_s']:6.1f} "
              f"tok/s  ({values['positions_computed']} positions for {real} tokens)")
    print(f"packed vs rows {result['speedup_best']:.2f}x, response-only outputs vs all "
          f"{result['output_mask_speedup_best']:.2f}x  load {result['load_average_1m_before_after']}")
    state.destroy()


if __name__ == "__main__":
    main()
