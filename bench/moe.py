"""MoE RL step time by phase (issue 21): GRPO on ``tiny:qwen2_moe`` (8 experts, top-2, a shared expert) through the
whole path — Megatron policy and reference, colocated vLLM, experts resharded into vLLM's fused-MoE layers — at
expert-parallel size 1 (one process) and 2 (two processes, four experts each, a TP2 engine), with megatron's
load-balancing loss through verl's keys. Per layout: the mean of each ``timing/*`` phase over the steps after the
first (the first compiles and warms caches) and the train/rollout log-prob mismatch of every step
(``rollout/log_prob_{mean,max}_abs_diff``: what router replay would act on; router replay itself is not built yet).

    python -m bench.moe [--steps 4]     (from the repo root; ~4 min here) -> bench/results/moe.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
LAYOUTS = {
    "ep1": ["trainer.n_gpus_per_node=1"],
    "ep2": ["trainer.n_gpus_per_node=2", "actor_rollout_ref.actor.megatron.expert_model_parallel_size=2",
            "actor_rollout_ref.ref.megatron.expert_model_parallel_size=2",
            "actor_rollout_ref.rollout.tensor_model_parallel_size=2"],
}
COMMON = ["actor_rollout_ref.model.path=tiny:qwen2_moe", "trainer.test_freq=-1", "trainer.val_before_train=False",
          "trainer.save_freq=-1", "actor_rollout_ref.actor.use_kl_loss=True",
          "+actor_rollout_ref.actor.megatron.override_transformer_config.moe_router_load_balancing_type=aux_loss",
          "+actor_rollout_ref.actor.megatron.override_transformer_config.moe_aux_loss_coeff=0.01"]


def run_layout(overrides: list[str], steps: int, run_dir: Path) -> dict:
    from meshrl.config import load_config
    from meshrl.config.validate import validate_config
    from meshrl.trainer.main import run

    cfg = load_config([*COMMON, *overrides, f"trainer.total_training_steps={steps}",
                       f"trainer.default_local_dir={run_dir}"], recipe="cpu_tiny_grpo")
    start = time.perf_counter()
    run(cfg, validate_config(cfg))
    wall = time.perf_counter() - start
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [row for row in rows if "timing/step_s" in row]
    later = rows[1:] or rows
    phases = sorted(key for key in rows[0] if key.startswith("timing/"))
    return {"wall_seconds": wall, "steps": len(rows),
            "phase_seconds_mean_after_step_1": {key: statistics.mean(row[key] for row in later) for key in phases},
            "log_prob_mean_abs_diff": [row["rollout/log_prob_mean_abs_diff"] for row in rows],
            "log_prob_max_abs_diff": [row["rollout/log_prob_max_abs_diff"] for row in rows],
            "load_average_after": os.getloadavg()[0]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    args = parser.parse_args()
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # vLLM's sampler would compile for ~20 s, same outputs
    result = {"command": "python -m bench.moe " + " ".join(sys.argv[1:]), "python": platform.python_version(),
              "load_average_before": os.getloadavg()[0], "layouts": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.layouts:
            result["layouts"][name] = run_layout(LAYOUTS[name], args.steps, Path(tmp) / name)
            print(name, json.dumps(result["layouts"][name]), flush=True)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "moe.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
