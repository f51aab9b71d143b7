"""Ctrl-C and SIGTERM of ``python -m meshrl.trainer.main`` on the tiny recipe: one line naming the step and the
last checkpoint, exit code 130 / 143, no traceback, and none of the run's processes left. With
``trainer.save_on_preempt=True`` a SIGTERM first finishes and saves the step in progress. One run per signal."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from meshrl.trainer.checkpoint import CheckpointManager
from meshrl.trainer.tracking import METRICS_FILE, read_metrics

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

REPO = Path(__file__).resolve().parents[2]


def interrupt(tmp_path: Path, signum: int, ready, *overrides: str) -> tuple[int, str, Path]:
    """Start a run in ``tmp_path/run``, send ``signum`` once ``ready(run_dir)``, and wait for the exit:
    (exit code, stdout + stderr, run folder). Asserts that every process the run started is gone."""
    run_dir = tmp_path / "run"
    log = tmp_path / "output.txt"
    command = [sys.executable, "-m", "meshrl.trainer.main", "--config-name", "cpu_tiny_grpo", "trainer.device=cpu",
               f"trainer.default_local_dir={run_dir}", "trainer.total_training_steps=20",
               "trainer.val_before_train=False", "trainer.test_freq=-1", *overrides]
    with open(log, "w") as out:
        process = subprocess.Popen(command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 400
            while not ready(run_dir):
                assert process.poll() is None, log.read_text()[-3000:]
                assert time.monotonic() < deadline, "the run never got ready"
                time.sleep(0.2)
            started = psutil.Process(process.pid).children(recursive=True)
            process.send_signal(signum)
            code = process.wait(timeout=120)
        finally:
            if process.poll() is None:
                process.kill()
    gone, alive = psutil.wait_procs(started, timeout=30)
    assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE], alive
    return code, log.read_text(), run_dir


def stop_line(output: str, signame: str) -> re.Match:
    found = re.findall(rf"^meshrl: interrupted by {signame} at step (\d+); last checkpoint: (\S+); resume with the "
                       r"same command$", output, re.MULTILINE)
    assert len(found) == 1, output[-3000:]
    return found[0]


def test_ctrl_c_stops_with_one_line_and_exit_code_130(tmp_path):
    def saved_step_1(run_dir: Path) -> bool:
        return (run_dir / "global_step_1" / "COMPLETE").is_file()

    code, output, run_dir = interrupt(tmp_path, signal.SIGINT, saved_step_1, "trainer.save_freq=1")
    assert code == 130, output[-3000:]
    step, checkpoint = stop_line(output, "SIGINT")
    assert int(step) in (1, 2) and Path(checkpoint) == run_dir / "global_step_1"  # in step 2, or just after 1
    assert "Traceback" not in output and "KeyboardInterrupt" not in output


def test_sigterm_with_save_on_preempt_saves_the_step_then_exits_143(tmp_path):
    def logged_step_1(run_dir: Path) -> bool:
        return (run_dir / METRICS_FILE).is_file() and any(r["step"] >= 1 for r in read_metrics(run_dir / METRICS_FILE))

    code, output, run_dir = interrupt(tmp_path, signal.SIGTERM, logged_step_1, "trainer.save_on_preempt=True")
    assert code == 143, output[-3000:]
    step, checkpoint = stop_line(output, "SIGTERM")
    assert Path(checkpoint) == run_dir / f"global_step_{step}"  # the interrupted step, finished and saved
    manager = CheckpointManager(run_dir)
    assert manager.latest() == Path(checkpoint) and manager.load_driver_state(Path(checkpoint))["step"] == int(step)
    assert (Path(checkpoint) / "actor").is_dir()
    assert "meshrl: SIGTERM: finishing and saving the step in progress" in output
    assert "Traceback" not in output
