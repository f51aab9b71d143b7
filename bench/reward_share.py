"""The reward phase's share of a CPU training step on code data (issue 22), with and without verl's overlap.

Trains the main job's recipe (``cpu_smollm2_grpo``: SmolLM2-135M, GRPO, here with a KL loss, so a reference pass
runs between the scoring and the advantages) on HumanEval in verl's layout (written by
``meshrl.data.code_tasks``), so every response is scored by running it against its tests in the local sandbox the
run starts, twice in one invocation: ``reward_model.launch_reward_fn_async`` False (the reward function scores
before the log-prob passes) and True (it scores on a background thread while they run). Per step it reads
``timing/reward_s`` (the driver's time spent scoring or waiting for scores) and ``timing/step_s`` from the run's
``metrics.jsonl``. Target (issue 22): the reward phase adds < 10% to a step.

Writes bench/results/reward_share.json and reward_share.png.

    python -m bench.reward_share [--steps 3] [--prompts 4] [--n 4]     (from the repo root)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def train(data: Path, run_dir: Path, overlap: bool, args) -> list[dict]:
    command = [sys.executable, "-m", "meshrl.trainer.main", "--config-name", "cpu_smollm2_grpo",
               f"data.train_files={data / 'train.parquet'}", f"data.val_files={data / 'test.parquet'}",
               f"data.train_batch_size={args.prompts}", f"actor_rollout_ref.actor.ppo_mini_batch_size={args.prompts}",
               f"actor_rollout_ref.rollout.n={args.n}", "data.max_prompt_length=640",
               f"data.max_response_length={args.response}", f"trainer.total_training_steps={args.steps}",
               "trainer.test_freq=-1", "trainer.val_before_train=False", "trainer.save_freq=-1",
               "trainer.logger=[jsonl]", f"trainer.default_local_dir={run_dir}",
               "actor_rollout_ref.actor.use_kl_loss=True",
               "reward_model.num_workers=4", "reward_model.sandbox_fusion.max_concurrent=4",
               f"reward_model.launch_reward_fn_async={overlap}"]
    subprocess.run(command, check=True, env={**os.environ, "TORCHDYNAMO_DISABLE": "1"})
    steps: dict[int, dict] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        steps.setdefault(record["step"], {}).update(record)
    return [{"step": s, "reward_s": m["timing/reward_s"], "step_s": m["timing/step_s"],
             "reward_share": m["timing/reward_s"] / m["timing/step_s"], "score": m["score/mean"],
             "errors": {k.split("/", 2)[2]: v for k, v in m.items() if k.startswith("reward/errors/") and v}}
            for s, m in sorted(steps.items()) if s >= 1]


def plot(report: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for offset, (name, runs) in enumerate(report["runs"].items()):
        steps = [r["step"] + (offset - 0.5) * 0.35 for r in runs]
        ax.bar(steps, [100 * r["reward_share"] for r in runs], width=0.35, label=name)
    ax.set_xticks(sorted({r["step"] for runs in report["runs"].values() for r in runs}))
    ax.axhline(10, color="grey", linestyle="--", linewidth=1, label="target < 10%")
    ax.set_xlabel("step")
    ax.set_ylabel("reward phase, % of the step")
    ax.set_title("HumanEval in the local sandbox, SmolLM2-135M GRPO on CPU")
    ax.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / "reward_share.png", dpi=120)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.reward_share")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--response", type=int, default=128)
    args = parser.parse_args(argv)
    report = {"command": " ".join(["python -m bench.reward_share", *sys.argv[1:]]), "cpus": os.cpu_count(),
              "load_average_1m_before": os.getloadavg()[0], "runs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "humaneval"
        subprocess.run([sys.executable, "-m", "meshrl.data.code_tasks", "humaneval", "--local_dir", str(data)],
                       check=True)
        for name, overlap in (("scored before the passes", False), ("launch_reward_fn_async", True)):
            report["runs"][name] = train(data, Path(tmp) / name.replace(" ", "_"), overlap, args)
            for r in report["runs"][name]:
                print(f"{name}: step {r['step']}: reward {r['reward_s']:.2f} s of {r['step_s']:.1f} s "
                      f"({100 * r['reward_share']:.1f}%)", flush=True)
    report["load_average_1m_after"] = os.getloadavg()[0]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "reward_share.json").write_text(json.dumps(report, indent=2) + "\n")
    plot(report)


if __name__ == "__main__":
    main()
