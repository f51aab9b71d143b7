"""MoE RL step time by phase (issue 21): GRPO on ``tiny:qwen2_moe`` (8 experts, top-2, a shared expert) through the
whole path — Megatron policy and reference, colocated vLLM, experts resharded into vLLM's fused-MoE layers — at
expert-parallel size 1 (one process) and 2 (two processes, four experts each, a TP2 engine), with megatron's
load-balancing loss through verl's keys. Per layout: the mean of each ``timing/*`` phase over the steps after the
first (the first compiles and warms caches) and the train/rollout log-prob mismatch of every step
(``rollout/log_prob_{mean,max}_abs_diff``); the ``ep2_r2`` layout adds router replay (R2) and two mini-batches.

Router replay (``--replay``, in process, ``meshrl.parallel.router_replay``): the log-prob mismatch with and without
replayed routing, on the fp32 Megatron ``tiny:qwen2_moe`` over ``ROWS`` random sequences, in two settings:

- ``bf16_rollout``: what replaying the rollout's routing (verl's R3, which vLLM cannot report on CPU) would do. The
  same weights in bf16 stand in for the engine: their routing is recorded and their log-probs are the "rollout's";
  the fp32 trainer's log-probs are compared with them routing natively and replaying the bf16 routing.
- ``perturbed``: what R2 does in the update. The old-log-prob pass records; every weight then moves by a relative
  ``PERTURBATION`` (about one optimizer step, and enough to flip near-tied routes); the new log-probs are compared
  with the old ones routing natively and replaying the recorded routes.

Each reports the share of (token, layer) routes that differ between the two passes, and the mean and max
|log-prob difference| over all predicted tokens and over the tokens with a differing route in some layer.

    python -m bench.moe [--steps 4]     (from the repo root; ~4 min here) -> bench/results/moe.json
    python -m bench.moe --replay        (~1 min)                        -> bench/results/moe_replay.json
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
    "ep2_r2": ["trainer.n_gpus_per_node=2", "actor_rollout_ref.actor.megatron.expert_model_parallel_size=2",
               "actor_rollout_ref.ref.megatron.expert_model_parallel_size=2",
               "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
               "actor_rollout_ref.actor.megatron.router_replay.mode=R2",
               "actor_rollout_ref.actor.ppo_mini_batch_size=2"],
}
ROWS, LENGTH, PERTURBATION = 16, 96, 1e-2
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
            "replayed_route_changes": [row.get("actor/replayed_route_changes") for row in rows],
            "load_average_after": os.getloadavg()[0]}


def _mismatch(a: list, b: list, masks: list, flipped: list) -> dict:
    """Mean / max |a - b| over the predicted tokens, and over those with a differing route."""
    import torch

    diff = torch.cat([(x - y).abs()[m] for x, y, m in zip(a, b, masks)])
    on_flips = torch.cat([(x - y).abs()[m & f] for x, y, m, f in zip(a, b, masks, flipped)])
    return {"mean_abs_diff": float(diff.mean()), "max_abs_diff": float(diff.max()),
            "tokens": int(diff.numel()), "tokens_with_a_changed_route": int(on_flips.numel()),
            "mean_abs_diff_on_changed": float(on_flips.mean()) if on_flips.numel() else 0.0,
            "max_abs_diff_on_changed": float(on_flips.max()) if on_flips.numel() else 0.0}


def replay_mismatch(seed: int = 0) -> dict:
    """The ``--replay`` measurements (module docstring), in this process at TP1 / EP1."""
    import torch
    from transformers import AutoConfig

    from meshrl.models.tiny import tiny_model_dir, tiny_spec
    from meshrl.parallel import hf_conversion, model_builder, router_replay, schedule, state
    from meshrl.parallel.forward import OutputRequest

    path = tiny_model_dir(tiny_spec("qwen2_moe"))
    config = AutoConfig.from_pretrained(path)
    g = torch.Generator().manual_seed(seed)
    batches = [{"input_ids": torch.randint(0, config.vocab_size, (4, LENGTH), generator=g),
                "attention_mask": torch.ones(4, LENGTH, dtype=torch.long)} for _ in range(ROWS // 4)]
    masks = [torch.arange(LENGTH).expand(4, -1) > 0 for _ in batches]  # every token but the first is predicted
    request = OutputRequest(remove_padding=True)

    def model(dtype):
        chunks = model_builder.build_forward_only_model(config, dtype=dtype)
        hf_conversion.load_hf_weights(chunks, path)
        router_replay.install(chunks)
        return chunks

    def run(chunks, routes=None):
        """(log-probs, routes the routers chose) of every micro-batch; ``routes``: replay those."""
        micros = (batches if routes is None
                  else [{**mb, router_replay.ROUTES: r.long()} for mb, r in zip(batches, routes)])
        if routes is not None:
            return [o["log_probs"] for o in schedule.forward_only(chunks, micros, request)], routes
        with router_replay.recording(chunks) as record:
            out = schedule.forward_only(chunks, micros, request)
            return [o["log_probs"] for o in out], record.gather(micros)

    def compare(reference: tuple, native: tuple, replayed: list) -> dict:
        (ref_lp, ref_routes), (lp, routes) = reference, native
        changed = [(r.sort(-1).values != n.sort(-1).values).any(-1) for r, n in zip(ref_routes, routes)]  # [b, s, L]
        flipped = [c.any(-1) for c in changed]
        share = float(torch.cat([c.flatten() for c in changed]).float().mean())
        return {"changed_route_share": share, "native": _mismatch(lp, ref_lp, masks, flipped),
                "replayed": _mismatch(replayed, ref_lp, masks, flipped)}

    state.initialize(state.ParallelConfig())
    try:
        trainer = model(torch.float32)
        rollout = run(model(torch.bfloat16))
        result = {"bf16_rollout": compare(rollout, run(trainer), run(trainer, rollout[1])[0])}
        old = run(trainer)
        with torch.no_grad():
            for chunk in trainer:
                for param in model_builder.unwrap(chunk).parameters():
                    param.add_(param * PERTURBATION * torch.randn(param.shape, generator=g))
        result["perturbed"] = compare(old, run(trainer), run(trainer, old[1])[0])
    finally:
        state.destroy()
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--replay", action="store_true", help="the router-replay mismatch measurements only")
    args = parser.parse_args()
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # vLLM's sampler would compile for ~20 s, same outputs
    if args.replay:
        result = {"command": "python -m bench.moe --replay", "python": platform.python_version(),
                  "model": "tiny:qwen2_moe", "rows": ROWS, "length": LENGTH, "perturbation": PERTURBATION,
                  **replay_mismatch()}
        print(json.dumps(result, indent=1))
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "moe_replay.json").write_text(json.dumps(result, indent=1))
        return
    result = {"command": "python -m bench.moe " + " ".join(sys.argv[1:]), "python": platform.python_version(),
              "load_average_before": os.getloadavg()[0], "layouts": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.layouts:
            load = os.getloadavg()[0]
            result["layouts"][name] = {"command": result["command"], "load_average_before": load,
                                       **run_layout(LAYOUTS[name], args.steps, Path(tmp) / name)}
            print(name, json.dumps(result["layouts"][name]), flush=True)
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / "moe.json"
    # layouts run separately (--layouts) join the file's others; each keeps its command and load
    earlier = json.loads(path.read_text())["layouts"] if path.is_file() else {}
    result["layouts"] = {**earlier, **result["layouts"]}
    path.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
