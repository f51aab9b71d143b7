"""The train/rollout mismatch that rollout correction sees (issue 34): verl's ``rollout_corr/*`` metrics over a few
steps of the main job (``python -m meshrl.trainer.main --config-name cpu_smollm2_grpo``: GRPO on the embedded
SmolLM2-135M, vLLM on CPU) with token-level IS weights (``algorithm.rollout_correction.rollout_is=token``, verl's
default truncation at 2.0), in precision settings of the actor against the engine:

- ``fp32_fp32``: the actor (Megatron) and the engine (vLLM) in float32, the recipe's default on CPU;
- ``bf16_fp32``: a bf16 actor (``actor_rollout_ref.actor.megatron.dtype=bfloat16``; its old log-probs come from the
  bf16 model) against the fp32 engine;
- ``fp32_bf16``: the fp32 actor against a bf16 engine (``actor_rollout_ref.rollout.dtype=bfloat16``);
- ``bf16_bf16``: both in bf16 (the usual GPU setting: bf16 weights in both, different kernels).

Each setting is one run of the main command with ``COMMON``'s overrides (no validation, no checkpoint, the first
``data.train_max_samples`` prompts) in its own process. Per step the script keeps every ``rollout_corr/*`` and
``rollout/*`` metric, the score and the step time from the run's ``metrics.jsonl``; a run that exits non-zero is
recorded with its last output lines (a refusal's message). The machine (CPU flags, whether bf16 matmuls have a
hardware path), the date, the commit and the load average go beside.

    python -m bench.rollout_mismatch                      # all settings, 4 steps each; ~2 min a setting here
    python -m bench.rollout_mismatch --settings fp32_fp32 bf16_fp32 --steps 5
    python -m bench.rollout_mismatch --replot             # redraw the PNG from the JSON

-> ``bench/results/rollout_mismatch.{json,png}`` (settings run separately join the JSON's others).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
NAME = "rollout_mismatch"
COMMAND = ["-m", "meshrl.trainer.main", "--config-name", "cpu_smollm2_grpo"]
COMMON = ["algorithm.rollout_correction.rollout_is=token", "trainer.test_freq=-1", "trainer.val_before_train=False",
          "trainer.save_freq=-1", "data.train_max_samples=16",
          # the bf16 settings' gap may pass the alarm's 16-bit tolerance: it is what is measured, not a fault
          "trainer.on_mismatch=warn"]
SETTINGS = {
    "fp32_fp32": ("actor fp32, engine fp32", []),
    "bf16_fp32": ("actor bf16, engine fp32", ["actor_rollout_ref.actor.megatron.dtype=bfloat16"]),
    "fp32_bf16": ("actor fp32, engine bf16", ["actor_rollout_ref.rollout.dtype=bfloat16"]),
    "bf16_bf16": ("actor bf16, engine bf16", ["actor_rollout_ref.actor.megatron.dtype=bfloat16",
                                              "actor_rollout_ref.rollout.dtype=bfloat16"]),
}
KEPT_PREFIXES = ("rollout_corr/", "rollout/")
KEPT_KEYS = ("step", "score/mean", "score/accuracy", "response_length/mean", "timing/step_s", "actor/pg_clipfrac",
             "actor/grad_norm")
# the table's columns: (label, metric key)
TABLE = (("kl", "rollout_corr/kl"), ("k3_kl", "rollout_corr/k3_kl"),
         ("mean abs Δlogp", "rollout/log_prob_mean_abs_diff"), ("max abs Δlogp", "rollout/log_prob_max_abs_diff"),
         ("w mean", "rollout_corr/rollout_is_mean"), ("w min", "rollout_corr/rollout_is_min"),
         ("w max", "rollout_corr/rollout_is_max"), ("w std", "rollout_corr/rollout_is_std"),
         ("ESS", "rollout_corr/rollout_is_eff_sample_size"), ("w>U", "rollout_corr/rollout_is_ratio_fraction_high"),
         ("w<1/U", "rollout_corr/rollout_is_ratio_fraction_low"),
         ("chi2_token", "rollout_corr/chi2_token"), ("chi2_seq", "rollout_corr/chi2_seq"),
         ("score", "score/mean"))
PRECISE = ("rollout_corr/rollout_is_mean", "rollout_corr/rollout_is_min", "rollout_corr/rollout_is_max",
           "rollout_corr/rollout_is_eff_sample_size")  # near 1 in fp32: 6 significant digits in the table
TAIL_LINES = 40


def kept(record: dict) -> dict:
    """The metrics of one ``metrics.jsonl`` record this bench keeps (``KEPT_PREFIXES``, ``KEPT_KEYS``)."""
    return {k: v for k, v in record.items() if k in KEPT_KEYS or k.startswith(KEPT_PREFIXES)}


def step_records(lines: list[str]) -> list[dict]:
    """The training steps' kept metrics, in step order, from a ``metrics.jsonl``'s lines: records with an
    integer ``step`` and a step time (validation-only or cut-short lines are skipped; a repeated step keeps
    its last record)."""
    steps: dict[int, dict] = {}
    for line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int) and "timing/step_s" in record:
            steps[record["step"]] = kept(record)
    return [steps[s] for s in sorted(steps)]


def summarise(steps: list[dict]) -> dict:
    """Per ``TABLE`` key: the mean, min and max over the steps that logged it (absent: not in the dict)."""
    out = {}
    for _, key in TABLE:
        values = [s[key] for s in steps if isinstance(s.get(key), (int, float)) and math.isfinite(s[key])]
        if values:
            out[key] = {"mean": statistics.fmean(values), "min": min(values), "max": max(values)}
    return out


def machine() -> dict:
    """This machine: platform, CPU model and count, whether bf16 matmuls have a hardware path, versions, commit."""
    flags = ""
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        pass
    model = ""
    try:
        model = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    versions = {}
    for package in ("torch", "vllm", "megatron.core"):
        try:
            versions[package] = __import__(package, fromlist=["__version__"]).__version__
        except Exception:  # noqa: BLE001 (a version is a label, never a reason to stop)
            versions[package] = None
    return {"platform": platform.platform(), "cpu": model, "cpu_count": os.cpu_count(),
            "bf16_hardware": {f: f in flags.split() for f in ("avx512_bf16", "amx_bf16")},
            "python": platform.python_version(), **versions,
            **commit()}


def commit() -> dict:
    """The checkout's commit and whether its work tree differs from it (a setting's own, beside its date)."""
    git = lambda *a: subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True).stdout.strip()  # noqa: E731
    return {"commit": git("rev-parse", "--short", "HEAD"), "worktree_dirty": bool(git("status", "--porcelain"))}


def run_setting(name: str, steps: int, run_dir: Path) -> dict:
    """One run of the main command in ``name``'s setting, to ``steps`` steps; its per-step metrics."""
    overrides = [*COMMON, *SETTINGS[name][1], f"trainer.total_training_steps={steps}"]
    command = [sys.executable, *COMMAND, *overrides, f"trainer.default_local_dir={run_dir}"]
    env = {**os.environ, "TORCHDYNAMO_DISABLE": os.environ.get("TORCHDYNAMO_DISABLE", "1")}
    load_before = os.getloadavg()[0]
    start = time.monotonic()
    done = subprocess.run(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wall = time.monotonic() - start
    lines = done.stdout.splitlines()
    metrics = run_dir / "metrics.jsonl"
    records = step_records(metrics.read_text().splitlines()) if metrics.is_file() else []
    alarms = [line.strip() for line in lines if "mismatch" in line.lower() and "warn" in line.lower()]
    return {"label": SETTINGS[name][0],
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), **commit(),
            "command": "python " + " ".join([*COMMAND, *overrides]),
            "returncode": done.returncode, "wall_s": round(wall, 1),
            "load_average_before": round(load_before, 2), "load_average_after": round(os.getloadavg()[0], 2),
            "refusal": None if done.returncode == 0 else "\n".join(lines[-TAIL_LINES:]),
            "mismatch_warnings": alarms[:5],
            "ready_line": next((line for line in lines if line.startswith("meshrl: ready")), None),
            "steps": records, "summary": summarise(records)}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (("rollout_corr/kl", "rollout_corr/kl (token mean of logπ_rollout − logπ_old)", "symlog"),
              ("rollout/log_prob_mean_abs_diff", "mean |logπ_old − logπ_rollout|", "log"),
              ("rollout_corr/rollout_is_mean", "IS weight mean", "linear"),
              ("rollout_corr/rollout_is_max", "IS weight max (solid) / min (dashed)", "log"),
              ("rollout_corr/rollout_is_std", "IS weight std (fp32: 0 or 3.45e-4 = sqrt(one fp32 ulp), verl's formula)",
               "symlog"),
              ("rollout_corr/rollout_is_eff_sample_size", "IS effective sample size (fraction)", "linear"),
              ("rollout_corr/rollout_is_ratio_fraction_high",
               "fraction of tokens w > U=2 (truncated; solid) / w < 1/U (dashed)", "linear"),
              ("score/mean", "score (mean reward)", "linear"))
    fig, axes = plt.subplots(2, 4, figsize=(18, 8))
    for ax, (key, title, scale) in zip(axes.flat, panels):
        for i, (name, setting) in enumerate(result["settings"].items()):
            steps = setting["steps"]
            colour = f"C{i}"
            xs = [s["step"] for s in steps if key in s]
            ax.plot(xs, [s[key] for s in steps if key in s], "o-", color=colour, label=setting["label"])
            low = {"rollout_corr/rollout_is_max": "rollout_corr/rollout_is_min",
                   "rollout_corr/rollout_is_ratio_fraction_high": "rollout_corr/rollout_is_ratio_fraction_low"}.get(key)
            if low:
                ax.plot([s["step"] for s in steps if low in s], [s[low] for s in steps if low in s], "s--",
                        color=colour)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("step")
        ax.xaxis.get_major_locator().set_params(integer=True)
        if scale == "symlog":
            ax.set_yscale("symlog", linthresh=1e-6 if key == "rollout_corr/kl" else 1e-4)
        elif scale == "log":
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=8)
    m = result["machine"]
    fig.suptitle(f"train/rollout mismatch seen by rollout correction (rollout_is=token), SmolLM2-135M GRPO on CPU — "
                 f"{m['cpu']}, {m['cpu_count']} cores, {result['date'][:10]}, {m['commit']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def table(result: dict) -> str:
    """A markdown table of the per-step metrics of every setting (the doc's)."""
    cols = [label for label, _ in TABLE]
    out = ["| setting | step | " + " | ".join(cols) + " |", "|" + " --- |" * (len(cols) + 2)]
    for setting in result["settings"].values():
        for s in setting["steps"]:
            cells = [_fmt(s.get(key), 6 if key in PRECISE else 3) for _, key in TABLE]
            out.append(f"| {setting['label']} | {s['step']} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def _fmt(value, digits: int = 3) -> str:
    if not isinstance(value, (int, float)):
        return "–"
    if value == 0:
        return "0"
    return f"{value:.{digits}g}" if 1e-3 <= abs(value) < 1e4 else f"{value:.2e}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--replot", action="store_true", help="redraw the PNG (and print the table) from the JSON")
    args = parser.parse_args()
    path = RESULTS / f"{NAME}.json"
    if args.replot:
        result = json.loads(path.read_text())
        plot(result, RESULTS / f"{NAME}.png")
        print(table(result))
        return
    result = {"command": "python -m bench.rollout_mismatch " + " ".join(sys.argv[1:]),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": machine(), "common_overrides": COMMON, "steps": args.steps, "settings": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.settings:
            result["settings"][name] = run_setting(name, args.steps, Path(tmp) / name)
            done = result["settings"][name]
            print(name, f"rc={done['returncode']} wall={done['wall_s']} s", json.dumps(done["summary"]), flush=True)
    if path.is_file():  # settings run separately join the file's others (each keeps its command and load)
        earlier = json.loads(path.read_text())["settings"]
        result["settings"] = {**{k: v for k, v in earlier.items() if k not in result["settings"]},
                              **result["settings"]}
        result["settings"] = {k: result["settings"][k] for k in SETTINGS if k in result["settings"]}
    RESULTS.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    plot(result, RESULTS / f"{NAME}.png")
    print(table(result))


if __name__ == "__main__":
    main()
