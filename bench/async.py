"""The main job under each of meshrl's trainers: synchronous, one-step-off, fully async, verl V1 colocate_async.

Each mode runs ``python -m meshrl.trainer.main --config-name cpu_smollm2_grpo`` (SmolLM2-135M-Instruct, GRPO on the
arithmetic task, 4 prompts x 8 samples a step, greedy validation every 4 steps) with the same seeds, one after the
other, ``--steps`` steps each:

- ``sync``: meshrl's synchronous trainer;
- ``one_step_off``: verl's one-step-off trainer (``trainer.async_mode=one_step_off``, bypass mode);
- ``fully_async``: verl's fully async trainer at ``staleness_threshold=0.5``, ``require_batches=2`` (4 prompts a
  step, as the others), a sync every step, bypass mode;
- ``colocate_async``: verl V1's colocate_async trainer (``trainer.v1.trainer_mode=colocate_async``) with its
  defaults: one warm-up batch, the 4 groups that finish first trained, the others cut and finished on the next
  weights (``meshrl.trainer.colocate_async_trainer``).

Per mode: trained samples per second (responses trained / the steps' wall time, and over the whole command), the
validation curve, the staleness the steps trained on, and the time per phase (``timing/*``, averaged over the steps
after the first), which explains the ratios: the asynchronous trainers' rollouter is the training ranks' engines
(``meshrl.trainer.async_trainer``), so generation and training take turns, and what differs is only how many samples
each generation call makes and how stale they are. Writes bench/results/async.json and .png (``--out``: another name;
``--seeds``: each mode once per seed, its figures the means and its validation band the seeds' range).

    python -m bench.async [--steps 16] [--modes sync,one_step_off,fully_async,colocate_async] [--seeds 1,2 --out NAME]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
REPO = Path(__file__).resolve().parents[1]
MODES = {
    "sync": [],
    "one_step_off": ["trainer.async_mode=one_step_off", "algorithm.rollout_correction.bypass_mode=True"],
    "fully_async": ["trainer.async_mode=fully_async", "algorithm.rollout_correction.bypass_mode=True",
                    "async_training.staleness_threshold=0.5", "async_training.require_batches=2",
                    "async_training.trigger_parameter_sync_step=1"],
    "colocate_async": ["trainer.v1.trainer_mode=colocate_async"],
}


def seed_overrides(seed: int | None) -> list[str]:
    """The run's seeds: the sampler's order of the prompts and the engine's sampling (None: the recipe's own)."""
    return [] if seed is None else [f"data.seed={seed}", f"actor_rollout_ref.rollout.seed={seed}"]


def run_mode(mode: str, steps: int, folder: Path, seed: int | None = None) -> dict:
    run_dir = folder / (mode if seed is None else f"{mode}-seed{seed}")
    command = [sys.executable, "-m", "meshrl.trainer.main", "--config-name", "cpu_smollm2_grpo",
               f"trainer.total_training_steps={steps}", f"trainer.default_local_dir={run_dir}", *MODES[mode],
               *seed_overrides(seed)]
    load = os.getloadavg()[0]
    start = time.perf_counter()
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{mode} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if "timing/step_s" in r]
    later = trained[1:] or trained
    responses = 4 * 8  # prompts x rollout.n per step (the recipe's)
    phases = sorted({k for r in later for k in r if k.startswith("timing/")})
    return {
        "command": " ".join(command[1:]),
        "wall_s": round(wall, 1),
        "load_average_1min_before": round(load, 2),
        "samples_per_s_steps": round(responses * len(trained) / sum(r["timing/step_s"] for r in trained), 3),
        "samples_per_s_wall": round(responses * len(trained) / wall, 3),
        "validation": {int(r["step"]): r["val/score"] for r in rows if "val/score" in r},
        "score_mean": [round(r["score/mean"], 4) for r in trained],
        "staleness_mean": [r.get("training/off_policy/trajectory_staleness/mean", 0.0) for r in trained],
        "spans_max": [r.get("training/off_policy/trajectory_spans/max", 1.0) for r in trained],
        "generated_samples": trained[-1].get("fully_async/count/total_generated_samples",
                                             float(4 * len(trained))),
        "phases_s": {p.removeprefix("timing/"): round(statistics.mean(r.get(p, 0.0) for r in later), 3)
                     for p in phases},
    }


def over_seeds(runs: dict[int, dict]) -> dict:
    """One mode's runs of several seeds as one entry: the means of the rates and of the validation score per step,
    the score's lowest and highest per step (``validation_range``), and every run (``per_seed``)."""
    steps = sorted(set.intersection(*(set(r["validation"]) for r in runs.values())))
    phases = sorted(set.intersection(*(set(r["phases_s"]) for r in runs.values())))
    return {
        "samples_per_s_steps": round(statistics.mean(r["samples_per_s_steps"] for r in runs.values()), 3),
        "samples_per_s_wall": round(statistics.mean(r["samples_per_s_wall"] for r in runs.values()), 3),
        "validation": {s: round(statistics.mean(r["validation"][s] for r in runs.values()), 4) for s in steps},
        "validation_range": {s: (min(r["validation"][s] for r in runs.values()),
                                 max(r["validation"][s] for r in runs.values())) for s in steps},
        "phases_s": {p: round(statistics.mean(r["phases_s"][p] for r in runs.values()), 3) for p in phases},
        "per_seed": runs,
    }


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (curve, rate, phases) = plt.subplots(1, 3, figsize=(15, 4.2))
    for mode, r in results["modes"].items():
        steps = sorted(r["validation"])
        curve.plot(steps, [r["validation"][s] for s in steps], marker="o", label=mode)
        if "validation_range" in r:  # several seeds: the mean, and the band from the lowest to the highest
            curve.fill_between(steps, *zip(*(r["validation_range"][s] for s in steps)), alpha=0.2)
    seeds = results.get("seeds")
    curve.set(title="main job: greedy validation score" + (f" (mean of seeds {seeds})" if seeds else ""),
              xlabel="step", ylabel="val/score")
    curve.legend()
    modes = list(results["modes"])
    rate.bar(modes, [results["modes"][m]["samples_per_s_steps"] for m in modes])
    rate.set(title="trained samples / s (steps' wall time)", ylabel="samples / s")
    names = sorted({p for m in modes for p in results["modes"][m]["phases_s"]} - {"step_s"})
    bottom = [0.0] * len(modes)
    for name in names:
        values = [results["modes"][m]["phases_s"].get(name, 0.0) for m in modes]
        phases.bar(modes, values, bottom=bottom, label=name)
        bottom = [b + v for b, v in zip(bottom, values)]
    phases.set(title="seconds per step by phase (steps 2..)", ylabel="s")
    phases.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--seeds", default="", help="comma-separated seeds (data.seed and rollout.seed); each mode "
                        "runs once per seed and its figures are the seeds' means (default: the recipe's seeds, once)")
    parser.add_argument("--out", default="async", help="results name: bench/results/<out>.json and .png")
    args = parser.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",") if s] or [None]
    results = {"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.processor() or platform.machine()}, "
               f"{os.cpu_count()} CPUs", "steps": args.steps, "modes": {}}
    if seeds != [None]:
        results["seeds"] = seeds
    with tempfile.TemporaryDirectory(prefix="meshrl-bench-async-") as tmp:
        for mode in args.modes.split(","):
            runs = {}
            for seed in seeds:
                runs[seed] = run_mode(mode, args.steps, Path(tmp), seed)
                print(mode, seed, json.dumps({k: v for k, v in runs[seed].items() if k != "command"}), flush=True)
            results["modes"][mode] = runs[None] if seeds == [None] else over_seeds(runs)
    base = results["modes"].get("sync")
    if base:
        results["ratios_vs_sync"] = {m: round(r["samples_per_s_steps"] / base["samples_per_s_steps"], 3)
                                     for m, r in results["modes"].items()}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.out}.json").write_text(json.dumps(results, indent=1) + "\n")
    plot(results, RESULTS / f"{args.out}.png")
    print(f"wrote {RESULTS / args.out}.json and .png; ratios vs sync: {results.get('ratios_vs_sync')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
