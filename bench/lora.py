"""LoRA vs full fine-tuning on CPU, SmolLM2-135M: weight-sync time, generation time, update time and trainer
memory, side by side.

Each mode runs in a fresh process: one policy worker (``ActorRolloutRefWorker``, world size 1, no Ray) with
its colocated vLLM engine and a KL loss, so the reference exists (full: a second, forward-only model; LoRA:
the policy with its adapters off). LoRA is rank 16, alpha 32 on every linear layer (the CPU recipe's), synced
two ways: ``lora_adapter`` (``model.lora.merge=False``, the default: the adapters alone, served by vLLM's LoRA
layers) and ``lora_merged`` (``merge=True``: the merged weights through the full sync).

- update: one ``update`` (two optimizer steps of ``--rows`` / 2 random 100-token prompts with 32-token
  responses), the median of ``--repeats``; the old and reference log-probs are computed once before. The
  updates come first, so the adapters synced next are trained ones (B != 0).
- sync: ``sync_weights`` (full: ``iter_hf_weights``; LoRA: the adapters or the merged stream), after one warm-up
  sync; the median of ``--repeats`` wall times, as the worker reports them (``sync/seconds``).
- generation: ``generate`` of the ``--rows`` prompts (``rollout.n`` samples of up to 32 tokens each, sampled), the
  median of ``--repeats``, and the largest |engine - trainer| log-prob of a sampled token over those rollouts
  (the run's ``rollout/log_prob_max_abs_diff``).
- trainer memory, counted from the tensors (exact, unlike RSS on a shared machine): parameters, DDP gradient
  buffers, optimizer state (fp32 moments and step), the reference model's parameters; plus the peak PSS of
  the process tree (engine included) over the run, sampled.

Writes bench/results/lora.json and lora.png.

    python -m bench.lora [--rows 8] [--repeats 3]      (from the repo root)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
LORA = ["actor_rollout_ref.model.lora_rank=16", "actor_rollout_ref.model.lora_alpha=32"]
SYNC_TARGET = 0.25  # issue 20: a LoRA (rank 16) sync costs at most this share of the full sync
MODES = {"full": [], "lora_merged": LORA + ["actor_rollout_ref.model.lora.merge=True"],
         "lora_adapter": LORA + ["actor_rollout_ref.model.lora.merge=False"]}
COMMON = ["actor_rollout_ref.model.path=embedded:smollm2", "actor_rollout_ref.actor.use_kl_loss=True",
          "actor_rollout_ref.rollout.kv_cache_memory_bytes=1073741824", "data.max_prompt_length=128",
          "data.max_response_length=32", "trainer.device=cpu", "trainer.n_gpus_per_node=1",
          "actor_rollout_ref.actor.ppo_mini_batch_size=1", "data.train_batch_size=2"]


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def trainer_memory(worker) -> dict:
    import torch

    from meshrl.parallel.optimizer import _inner_optimizers

    params = [p for chunk in worker.policy for p in chunk.parameters()]
    state = [value for inner in _inner_optimizers(worker.optimizer) for item in inner.optimizer.state.values()
             for value in item.values() if isinstance(value, torch.Tensor)]
    return {"params_bytes": tensor_bytes(params),
            "trained_params": sum(p.numel() for p in params if p.requires_grad),
            "grad_buffer_bytes": sum(b.grad_data.numel() * b.grad_data.element_size()
                                     for chunk in worker.policy for b in chunk.buffers),
            "optimizer_state_bytes": tensor_bytes(state),
            "reference_bytes": tensor_bytes(p for chunk in worker.ref for p in chunk.parameters())
            if worker.ref is not None else 0}


def batch(rows: int, width: int):
    import torch

    from meshrl.protocol import Batch

    g = torch.Generator().manual_seed(0)
    mask = torch.ones(rows, width)
    return Batch(tensors={"responses": torch.randint(10, 40000, (rows, width), generator=g), "response_mask": mask,
                          "advantages": torch.randn(rows, 1, generator=g) * mask},
                 non_tensors={"prompt_ids": [torch.randint(10, 40000, (100,), generator=g).tolist()
                                             for _ in range(rows)]})


def run_mode(mode: str, rows: int, repeats: int) -> dict:
    import torch
    from omegaconf import OmegaConf

    from bench.machine import ProcessTreeSampler
    from meshrl.algorithms import GlobalNorm
    from meshrl.config import load_config
    from meshrl.config.validate import validate_config
    from meshrl.models.resolve import resolve_model_path
    from meshrl.runtime import configure_environment
    from meshrl.workers.actor_rollout_ref import ActorRolloutRefWorker

    configure_environment()
    torch.set_num_threads(1)
    with ProcessTreeSampler(os.getpid()) as sampler:
        cfg = load_config(COMMON + MODES[mode], recipe="cpu_tiny_grpo")
        worker = ActorRolloutRefWorker(0, 1, OmegaConf.to_container(cfg.actor_rollout_ref, resolve=True),
                                       str(resolve_model_path(cfg.actor_rollout_ref.model.path)), validate_config(cfg))
        worker.setup(worker.address())
        data = batch(rows, cfg.data.max_response_length)
        data = data.union(worker.compute_log_probs(data, "actor")).union(worker.compute_log_probs(data, "ref"))
        halves = [data.take(list(range(i, i + rows // 2))) for i in (0, rows // 2)]
        updates = []
        for _ in range(repeats):
            start = time.perf_counter()
            worker.update([(half, GlobalNorm.from_mask(half["response_mask"], max_len=data["responses"].shape[1]))
                           for half in halves])
            updates.append(time.perf_counter() - start)
        worker.sync_weights()  # warm-up
        syncs = [worker.sync_weights() for _ in range(repeats)]
        generations, gaps = [], []
        for _ in range(repeats):
            start = time.perf_counter()
            rollout = worker.generate(data, "train")
            generations.append(time.perf_counter() - start)
            trainer = worker.compute_log_probs(rollout, "actor")["old_log_probs"]
            mask = rollout["response_mask"].bool()
            gaps.append(float((trainer - rollout["rollout_log_probs"])[mask].abs().max()))
        memory = trainer_memory(worker)
        worker.shutdown_engine()
    return {"sync_seconds": statistics.median(s["sync/seconds"] for s in syncs),
            "sync_seconds_all": [s["sync/seconds"] for s in syncs], "sync_gigabytes": syncs[0]["sync/gigabytes"],
            "generate_seconds": statistics.median(generations), "generate_seconds_all": generations,
            "rollout_log_prob_max_abs_diff": max(gaps),
            "update_seconds": statistics.median(updates), "update_seconds_all": updates, **memory,
            "peak_tree_pss_bytes": max((pss for _, pss in sampler.pss_samples), default=None),
            "load_average": os.getloadavg()[0]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--mode", choices=tuple(MODES), help="(internal) run one mode in this process")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.mode:
        args.out.write_text(json.dumps(run_mode(args.mode, args.rows, args.repeats)))
        return
    results = {"rows": args.rows, "repeats": args.repeats, "lora": "rank 16, alpha 32, all-linear"}
    env = {**os.environ, "TORCHDYNAMO_DISABLE": "1", "OMP_NUM_THREADS": "1"}
    for mode in MODES:
        out = RESULTS / f".lora-{mode}.json"
        subprocess.run([sys.executable, "-m", "bench.lora", "--mode", mode, "--rows", str(args.rows), "--repeats",
                        str(args.repeats), "--out", str(out)], check=True, env=env)
        results[mode] = json.loads(out.read_text())
        out.unlink()
    for mode in ("lora_merged", "lora_adapter"):
        results[f"{mode}_vs_full"] = {key: results[mode][key] / results["full"][key]
                                      for key in ("sync_seconds", "sync_gigabytes", "generate_seconds",
                                                  "update_seconds", "optimizer_state_bytes", "grad_buffer_bytes")
                                      if results["full"][key]}
    results["sync_target"] = {"lora_sync_over_full_sync_at_most": SYNC_TARGET,
                              "lora_adapter": results["lora_adapter_vs_full"]["sync_seconds"]}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "lora.json").write_text(json.dumps(results, indent=1))
    plot(results)
    print(json.dumps({key: results[key] for key in ("lora_merged_vs_full", "lora_adapter_vs_full")}, indent=1))


def plot(results: dict) -> None:
    """Sync and generation time per mode (median and the repeats' range), the 25% sync target as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    for ax, key, title in ((axes[0], "sync_seconds", "weight sync"), (axes[1], "generate_seconds", "generation")):
        for x, mode in enumerate(MODES):
            runs = results[mode][f"{key}_all"]
            ax.bar(x, results[mode][key], color=("tab:gray", "tab:orange", "tab:blue")[x])
            ax.vlines(x, min(runs), max(runs), color="black")
        ax.set_xticks(range(len(MODES)), [mode.replace("_", "\n") for mode in MODES])
        ax.set_ylabel("seconds")
        ax.set_title(title)
    axes[0].axhline(SYNC_TARGET * results["full"]["sync_seconds"], color="tab:red", linestyle="--",
                    label=f"{SYNC_TARGET:.0%} of the full sync")
    axes[0].legend(fontsize=8)
    load = max(results[mode]["load_average"] for mode in MODES)
    fig.suptitle(f"SmolLM2-135M on CPU, LoRA rank 16 (load average up to {load:.0f} on 2 cores)", fontsize=9)
    fig.tight_layout()
    fig.savefig(RESULTS / "lora.png", dpi=120)


if __name__ == "__main__":
    main()
