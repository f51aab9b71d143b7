"""Time to first step of a training command: seconds from its start to its ``step 1/`` line, then it is stopped.

    python -m bench.first_step                      # the main job (`make run`'s command)
    python -m bench.first_step --repo /tmp/before   # the same command on another checkout's code (e.g. a
                                                    # `git worktree` of an older commit), with this .venv

Writes ``bench/results/first_step.json``: the seconds, the command, the run's own start-up line (``meshrl: ready in``,
when the code prints one) and the load average before and after. Run it on a quiet machine, twice back to back
(before / after) to compare.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
COMMAND = ["-m", "meshrl.trainer.main", "--config-name", "cpu_smollm2_grpo"]


def first_step(repo: Path, overrides: list[str]) -> dict:
    """Run the main job from ``repo``'s code (this checkout's caches) until its step 1 line; its timings."""
    env = {**os.environ, "PYTHONPATH": str(repo), "MESHRL_CACHE_DIR": os.environ.get("MESHRL_CACHE_DIR",
                                                                                   str(REPO / ".cache"))}
    command = [sys.executable, *COMMAND, *overrides]
    load_before = os.getloadavg()
    started = time.monotonic()
    process = subprocess.Popen(command, cwd=repo, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True)
    ready, seconds = None, None
    for line in process.stdout:
        if line.startswith("meshrl: ready in"):
            ready = line.strip()
        if line.startswith("step 1/"):
            seconds = time.monotonic() - started
            break
    os.killpg(process.pid, signal.SIGINT)  # the run stops as on Ctrl-C: workers, Ray and segments cleaned up
    try:
        process.wait(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    if seconds is None:
        raise RuntimeError(f"the run ended without a step 1 line (exit code {process.returncode})")
    return {"first_step_s": round(seconds, 2), "ready_line": ready, "command": " ".join(command),
            "code": str(repo), "load_average_before": load_before, "load_average_after": os.getloadavg()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repo", type=Path, default=REPO, help="the checkout whose code runs (default: this one)")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "first_step.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as run_dir:
        result = first_step(args.repo.resolve(), [f"trainer.default_local_dir={run_dir}"])
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
