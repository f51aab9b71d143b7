"""``rollout.mode=async`` vs ``sync`` on CPU (issue 23): single-turn generation throughput, a multi-turn GRPO
step by phase, and multi-turn generation with a slow tool.

Single-turn: SmolLM2-135M-Instruct (fp32) on GSM8K test questions, chat-templated as the trainer builds them,
``--n`` samples each at temperature 1, at most ``--max-tokens`` tokens, EOS ends a response; one in-process
vLLM engine serves both modes. Each round runs the same rollout (the engine's call counter reset, so both
modes draw the same seeds) once per mode, the mode that goes first alternating between rounds, so a change
in the machine's load hits both alike; the samples are compared token for token. Rate = generated tokens /
wall seconds of the call, and per CPU-second of this process (less sensitive to other processes' load).

Multi-turn (``--skip-multi-turn`` to leave it out): ``--steps`` GRPO steps of the real trainer (Ray, Megatron,
colocated vLLM) on ``tiny:llama`` and the GSM8K calculator task, per mode, made to converse by the hook of
tests/rollout/test_agent_e2e.py (a random model writes no tool calls: every token id divisible by 3 ends a
turn, and a turn without a call gets a calculator call). Per mode: each ``timing/*`` phase averaged over the
steps after the first, the agent metrics, and ``rollout/log_prob_max_abs_diff`` per step. Then the multi-turn
generation alone (``AgentLoop.generate``, no trainer) on one ``tiny:llama`` engine, same hook, ``--prompts`` x 2
conversations of at most ``--turns`` assistant turns, the calculator answering after a random delay in
[0, ``--tool-delay-s``) per call: wall seconds per mode over ``--rounds`` alternating rounds after a warm-up.

Writes bench/results/async_rollout.json and .png.

    python -m bench.async_rollout [--rounds 3] [--prompts 32] [--n 4] [--max-tokens 128] [--steps 3] [--turns 6]
                                  [--tool-delay-s 0.3] [--skip-multi-turn]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from meshrl.rollout.tools.calculator import CalculatorTool

RESULTS = Path(__file__).resolve().parent / "results"
MODES = ("sync", "async")


def timed(call) -> tuple[list, dict]:
    load = os.getloadavg()[0]
    start, cpu_start = time.perf_counter(), time.process_time()
    completions = call()
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    tokens = sum(len(c.token_ids) for c in completions)
    return completions, {"seconds": round(seconds, 2), "cpu_seconds": round(cpu_seconds, 2), "tokens": tokens,
                         "tokens_per_s": round(tokens / seconds, 1), "tokens_per_cpu_s": round(tokens / cpu_seconds, 1),
                         "load_average_1min_before": round(load, 2),
                         "load_average_1min_after": round(os.getloadavg()[0], 2)}


def single_turn(args) -> dict:
    import torch

    from bench.rollout import gsm8k_prompts
    from meshrl.models.embedded import smollm2_hf_dir
    from meshrl.rollout import EngineConfig, SamplingConfig, create_engine
    from meshrl.rollout.async_engine import AsyncEngine

    torch.set_num_threads(args.threads)
    model_dir = smollm2_hf_dir()
    prompts = gsm8k_prompts(model_dir, args.prompts)
    engine = create_engine(model_dir, EngineConfig(max_model_len=1024, max_num_seqs=256,
                                                   kv_cache_memory_bytes=2 << 30, generation_threads=args.threads))
    driver = AsyncEngine(engine)
    run = {"sync": engine.generate, "async": driver.generate}
    sampling = SamplingConfig(n=args.n, temperature=1.0, max_response_length=args.max_tokens, seed=0)
    engine.generate(prompts[:2], SamplingConfig(max_response_length=4))  # warm-up
    driver.generate(prompts[:2], SamplingConfig(max_response_length=4))
    state = engine.state_dict()
    rounds = []
    for index in range(args.rounds):
        order = MODES if index % 2 == 0 else MODES[::-1]
        row, samples = {"first": order[0]}, {}
        for mode in order:
            engine.load_state_dict(state)  # the same call index: the same seeds in both modes
            samples[mode], row[mode] = timed(lambda: run[mode](prompts, sampling))
            print(index, mode, row[mode], flush=True)
        row["identical_samples"] = all(
            (a.token_ids, a.logprobs) == (b.token_ids, b.logprobs) for a, b in zip(samples["sync"], samples["async"]))
        rounds.append(row)
    engine.shutdown()
    summary = {mode: {rate: round(statistics.median(r[mode][rate] for r in rounds), 1)
                      for rate in ("tokens_per_s", "tokens_per_cpu_s")} for mode in MODES}
    for rate in ("tokens_per_s", "tokens_per_cpu_s"):
        summary[f"async_over_sync_{rate}"] = round(summary["async"][rate] / summary["sync"][rate], 3)
    return {"model": "SmolLM2-135M-Instruct (fp32)", "prompts": len(prompts), "n": args.n,
            "max_tokens": args.max_tokens, "threads": args.threads, "rounds": rounds,
            "median": summary, "identical_samples_every_round": all(r["identical_samples"] for r in rounds)}


class SlowCalculator(CalculatorTool):
    """Stands in for a remote tool: the calculator answering after a delay drawn uniformly from [0, max_delay_s)
    per call (seeded), as a sandbox or a search API would."""

    def __init__(self, max_delay_s: float, seed: int) -> None:
        super().__init__({}, {"type": "function", "function": {"name": "calculator"}})
        self.max_delay_s = max_delay_s
        self._rng, self._lock = random.Random(seed), threading.Lock()

    def call(self, arguments, create_kwargs):
        with self._lock:  # calls run on the runner's threads
            delay = self._rng.uniform(0.0, self.max_delay_s)
        time.sleep(delay)
        return super().call(arguments, create_kwargs)


def multi_turn_rollout(args) -> dict:
    """Multi-turn generation alone, sync vs async, with a tool of random latency: the batched loop waits for the
    slowest call of every turn, the async loop only for each conversation's own calls."""
    import torch
    from transformers import AutoTokenizer

    from bench.rollout import gsm8k_prompts
    from meshrl.models.tiny import TinySpec, tiny_model_dir
    from meshrl.rollout import EngineConfig, SamplingConfig, create_engine
    from meshrl.rollout.agent_loop import AgentLoop, MultiTurnSettings
    from meshrl.rollout.async_engine import AsyncEngine
    from meshrl.rollout.tools import ToolRunner

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "rollout"))
    from test_agent_e2e import SITECUSTOMIZE

    exec(SITECUSTOMIZE, {})  # turns end at every token id divisible by 3 and each calls the calculator
    torch.set_num_threads(args.threads)
    model_dir = tiny_model_dir(TinySpec())
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = gsm8k_prompts(model_dir, args.prompts)
    engine = create_engine(model_dir, EngineConfig(max_model_len=1024, kv_cache_memory_bytes=512 << 20,
                                                   generation_threads=args.threads))
    settings = MultiTurnSettings(max_assistant_turns=args.turns)
    sampling = SamplingConfig(n=2, temperature=1.0, max_response_length=128, seed=0)
    rows = []
    for index in range(-1, args.rounds):  # round -1: a warm-up of both modes, not recorded
        row = {}
        for mode in (MODES if index % 2 == 0 else MODES[::-1]):
            runner = ToolRunner([SlowCalculator(args.tool_delay_s, seed=index)], max_response_chars=8)
            loop = AgentLoop(engine, tokenizer, runner, settings, 128, AsyncEngine(engine) if mode == "async" else None)
            load, seconds = os.getloadavg()[0], time.perf_counter()
            completions, stats = loop.generate(prompts, sampling)
            row[mode] = {"seconds": round(time.perf_counter() - seconds, 2), "load_average_1min_before": round(load, 2),
                         "assistant_turns": sum(s.assistant_turns for s in stats),
                         "tool_calls": int(sum(r[0] for s in stats for r in s.tools.values()))}
            runner.shutdown()
            print("multi-turn rollout", index, mode, row[mode], flush=True)
        rows += [row] if index >= 0 else []
    engine.shutdown()
    return {"model": "tiny:llama (random, fp32), the e2e test's hook", "prompts": len(prompts), "n": 2,
            "max_assistant_turns": args.turns, "tool_delay_s": f"uniform [0, {args.tool_delay_s})", "rounds": rows,
            "median_seconds": {m: statistics.median(r[m]["seconds"] for r in rows) for m in MODES}}


def multi_turn(args) -> dict:
    from meshrl.config import load_config
    from meshrl.config.validate import validate_config
    from meshrl.data.gsm8k_tools import write_task
    from meshrl.trainer.main import run

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "rollout"))
    from test_agent_e2e import SITECUSTOMIZE

    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        task = write_task(tmp / "data")
        hook = tmp / "hook"
        hook.mkdir()
        (hook / "sitecustomize.py").write_text(SITECUSTOMIZE)
        path = os.pathsep.join([str(hook), *filter(None, [os.environ.get("PYTHONPATH")])])
        for mode in MODES:
            run_dir = tmp / mode
            cfg = load_config([
                f"trainer.default_local_dir={run_dir}", f"trainer.total_training_steps={args.steps}",
                "trainer.val_before_train=False", "trainer.test_freq=-1", "trainer.save_freq=-1",
                f"data.train_files={task['train']}", f"data.val_files={task['test']}", "data.train_batch_size=4",
                "data.max_response_length=96", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                f"actor_rollout_ref.rollout.mode={mode}", "actor_rollout_ref.rollout.multi_turn.enable=True",
                "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=4",
                "actor_rollout_ref.rollout.multi_turn.max_tool_response_length=8",
                f"actor_rollout_ref.rollout.multi_turn.tool_config_path={task['tool_config']}",
                f"+ray_kwargs.ray_init.runtime_env.env_vars.PYTHONPATH={path}"], recipe="cpu_tiny_grpo")
            load, seconds = os.getloadavg()[0], time.perf_counter()
            run(cfg, validate_config(cfg))
            seconds = time.perf_counter() - seconds
            lines = (run_dir / "metrics.jsonl").read_text().splitlines()
            out[mode] = summarize([m for m in map(json.loads, lines) if "timing/step_s" in m], seconds, load)
            print(mode, out[mode], flush=True)
    return {"model": "tiny:llama (random, fp32)", "task": "GSM8K + calculator, 4 prompts x rollout.n of cpu_tiny_grpo",
            "hook": "tests/rollout/test_agent_e2e.py SITECUSTOMIZE", **out}


def summarize(steps: list[dict], seconds: float, load: float) -> dict:
    """One mode's multi-turn run: phases averaged over the steps after the first (it warms caches), the agent
    metrics over all steps, the train/rollout log-prob gap of each step."""
    def mean(key: str, rows: list[dict]) -> float:
        return round(statistics.mean(m[key] for m in rows), 2)

    return {"wall_seconds": round(seconds, 1), "steps": len(steps),
            "phase_seconds_mean_after_step_1": {k: mean(k, steps[1:] or steps)
                                                for k in sorted(steps[0]) if k.startswith("timing/")},
            "agent_mean": {k: mean(k, steps) for k in ("agent/num_turns/mean", "agent/tool_calls/mean",
                                                       "agent/tool_tokens/mean", "response_length/mean")},
            "log_prob_max_abs_diff": [m["rollout/log_prob_max_abs_diff"] for m in steps],
            "load_average_1min_before": round(load, 2), "load_average_1min_after": round(os.getloadavg()[0], 2)}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    multi, loop = result.get("multi_turn"), result.get("multi_turn_rollout")
    panels = 1 + bool(multi) + bool(loop)
    fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 4.2), squeeze=False)
    left = axes[0][0]
    single = result["single_turn"]
    rounds = single["rounds"]
    for offset, mode, color in ((-0.2, "sync", "tab:gray"), (0.2, "async", "tab:blue")):
        bars = left.bar([i + offset for i in range(len(rounds))], [r[mode]["tokens_per_s"] for r in rounds],
                        width=0.4, color=color, label=mode)
        left.bar_label(bars, fmt="%.0f", fontsize=8)
        left.plot([i + offset for i in range(len(rounds))], [r[mode]["tokens_per_cpu_s"] for r in rounds], "v",
                  color="black" if mode == "sync" else "navy", label=f"{mode}, per CPU-second of this process")
    left.set_xticks(range(len(rounds)), [f"round {i + 1}\n({r['first']} first)" for i, r in enumerate(rounds)])
    left.set_ylabel("generated tokens per second (bars: wall)")
    loads = [r[m]["load_average_1min_before"] for r in rounds for m in MODES]
    left.set_title(f"single-turn, {single['model']}\n{single['prompts']} GSM8K prompts x {single['n']} x "
                   f"<= {single['max_tokens']} tokens; identical samples: {single['identical_samples_every_round']}; "
                   f"load {min(loads):.0f}-{max(loads):.0f}", fontsize=9)
    left.legend(fontsize=7, loc="lower right")
    if multi:
        right = axes[0][1]
        phases = [k for k in multi["sync"]["phase_seconds_mean_after_step_1"] if k != "timing/step_s"]
        for offset, mode, color in ((-0.2, "sync", "tab:gray"), (0.2, "async", "tab:blue")):
            values = [multi[mode]["phase_seconds_mean_after_step_1"].get(k, 0.0) for k in phases]
            right.bar([i + offset for i in range(len(phases))], values, width=0.4, color=color,
                      label=f"{mode} (step {multi[mode]['phase_seconds_mean_after_step_1']['timing/step_s']:.1f} s)")
        right.set_xticks(range(len(phases)), [k.removeprefix("timing/").removesuffix("_s") for k in phases],
                         rotation=45, fontsize=8)
        right.set_ylabel("seconds (mean over steps after the first)")
        right.set_title(f"multi-turn GRPO step by phase, {multi['model']}\n{multi['task']}", fontsize=9)
        right.legend(fontsize=8)
    if loop:
        ax = axes[0][-1]
        for offset, mode, color in ((-0.2, "sync", "tab:gray"), (0.2, "async", "tab:blue")):
            bars = ax.bar([i + offset for i in range(len(loop["rounds"]))],
                          [r[mode]["seconds"] for r in loop["rounds"]],
                          width=0.4, color=color, label=mode)
            ax.bar_label(bars, fmt="%.1f", fontsize=8)
        ax.set_xticks(range(len(loop["rounds"])), [f"round {i + 1}" for i in range(len(loop["rounds"]))])
        ax.set_ylabel("seconds for the multi-turn rollout")
        ax.set_title(f"multi-turn generation alone, {loop['prompts']} prompts x {loop['n']}, <= "
                     f"{loop['max_assistant_turns']} turns,\ntool latency {loop['tool_delay_s']} s per call",
                     fontsize=9)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--turns", type=int, default=6, help="max assistant turns of the multi-turn rollout")
    parser.add_argument("--tool-delay-s", type=float, default=0.3, help="the slow calculator's largest delay")
    parser.add_argument("--skip-multi-turn", action="store_true")
    args = parser.parse_args()
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # vLLM's sampler compile: ~20 s, same outputs
    from meshrl.runtime import configure_environment

    configure_environment()
    result = {"command": "python -m bench.async_rollout " + " ".join(sys.argv[1:]), "machine": platform.platform(),
              "cpu_count": os.cpu_count(), "single_turn": single_turn(args)}
    if not args.skip_multi_turn:
        result["multi_turn"] = multi_turn(args)
        result["multi_turn_rollout"] = multi_turn_rollout(args)  # last: it patches the engine's stop tokens
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "async_rollout.json").write_text(json.dumps(result, indent=1) + "\n")
    plot(result, RESULTS / "async_rollout.png")
    print(json.dumps(result["single_turn"]["median"], indent=1))


if __name__ == "__main__":
    main()
