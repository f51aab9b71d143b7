"""LoRA vs full fine-tuning on CPU, SmolLM2-135M: weight-sync time, update time and trainer memory, side by side.

Each mode runs in a fresh process: one policy worker (``ActorRolloutRefWorker``, world size 1, no Ray) with
its colocated vLLM engine and a KL loss, so the reference exists (full: a second, forward-only model; LoRA:
the policy with its adapters off). ``lora`` is rank 16, alpha 32 on every linear layer (the CPU recipe's).

- sync: ``sync_weights`` (full: ``iter_hf_weights``; LoRA: the merged stream), after one warm-up sync;
  the median of ``--repeats`` wall times, as the worker reports them (``sync/seconds``).
- update: one ``update`` (two optimizer steps of ``--rows`` / 2 random 100-token prompts with 32-token
  responses), the median of ``--repeats``; the old and reference log-probs are computed once before.
- trainer memory, counted from the tensors (exact, unlike RSS on a shared machine): parameters, DDP gradient
  buffers, optimizer state (fp32 moments and step), the reference model's parameters; plus the peak PSS of
  the process tree (engine included) over the run, sampled.

Writes bench/results/lora.json.

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
        cfg = load_config(COMMON + (LORA if mode == "lora" else []), recipe="cpu_tiny_grpo")
        worker = ActorRolloutRefWorker(0, 1, OmegaConf.to_container(cfg.actor_rollout_ref, resolve=True),
                                       str(resolve_model_path(cfg.actor_rollout_ref.model.path)), validate_config(cfg))
        worker.setup(worker.address())
        worker.sync_weights()  # warm-up
        syncs = [worker.sync_weights() for _ in range(repeats)]
        data = batch(rows, cfg.data.max_response_length)
        data = data.union(worker.compute_log_probs(data, "actor")).union(worker.compute_log_probs(data, "ref"))
        halves = [data.take(list(range(i, i + rows // 2))) for i in (0, rows // 2)]
        updates = []
        for _ in range(repeats):
            start = time.perf_counter()
            worker.update([(half, GlobalNorm.from_mask(half["response_mask"], max_len=data["responses"].shape[1]))
                           for half in halves])
            updates.append(time.perf_counter() - start)
        memory = trainer_memory(worker)
        worker.shutdown_engine()
    return {"sync_seconds": statistics.median(s["sync/seconds"] for s in syncs),
            "sync_seconds_all": [s["sync/seconds"] for s in syncs], "sync_gigabytes": syncs[0]["sync/gigabytes"],
            "update_seconds": statistics.median(updates), "update_seconds_all": updates, **memory,
            "peak_tree_pss_bytes": max((pss for _, pss in sampler.pss_samples), default=None),
            "load_average": os.getloadavg()[0]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--mode", choices=("full", "lora"), help="(internal) run one mode in this process")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.mode:
        args.out.write_text(json.dumps(run_mode(args.mode, args.rows, args.repeats)))
        return
    results = {"rows": args.rows, "repeats": args.repeats, "lora": "rank 16, alpha 32, all-linear"}
    env = {**os.environ, "TORCHDYNAMO_DISABLE": "1", "OMP_NUM_THREADS": "1"}
    for mode in ("full", "lora"):
        out = RESULTS / f".lora-{mode}.json"
        subprocess.run([sys.executable, "-m", "bench.lora", "--mode", mode, "--rows", str(args.rows), "--repeats",
                        str(args.repeats), "--out", str(out)], check=True, env=env)
        results[mode] = json.loads(out.read_text())
        out.unlink()
    results["lora_vs_full"] = {key: results["lora"][key] / results["full"][key]
                               for key in ("sync_seconds", "update_seconds", "optimizer_state_bytes",
                                           "grad_buffer_bytes") if results["full"][key]}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "lora.json").write_text(json.dumps(results, indent=1))
    print(json.dumps(results["lora_vs_full"], indent=1))


if __name__ == "__main__":
    main()
