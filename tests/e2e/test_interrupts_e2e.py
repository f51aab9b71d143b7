"""Ctrl-C and SIGTERM of ``python -m meshrl.trainer.main`` on the tiny recipe: one line naming the step and the
last checkpoint, exit code 130 / 143, no traceback, and nothing of the run left (processes, temporary files,
shared memory: ``run_sandbox``). With ``trainer.save_on_preempt=True`` a SIGTERM first finishes and saves the
step in progress. One run per signal; the Ctrl-C one on the fully async trainer (a generation in flight on the
workers' threads).
The SIGTERM run also checks the quiet console: no library line in the output, all of them in the run's logs."""

from __future__ import annotations

import re
import signal
from pathlib import Path

import pytest
from run_sandbox import TINY, RunSandbox, run_main

from meshrl.trainer.checkpoint import CheckpointManager
from meshrl.trainer.tracking import METRICS_FILE, read_metrics

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]


def interrupt(tmp_path: Path, signum: int, ready, *overrides: str) -> tuple[int, str, Path]:
    """Start a run in ``tmp_path/run``, send ``signum`` once ``ready(run_dir)``, and wait for the exit:
    (exit code, stdout + stderr, run folder). Asserts that the run left nothing behind (``run_sandbox``)."""
    run_dir, log, sandbox = tmp_path / "run", tmp_path / "output.txt", RunSandbox()
    try:
        code = run_main(sandbox, *TINY, f"trainer.default_local_dir={run_dir}", "trainer.total_training_steps=20",
                        *overrides, log=log, until=lambda: ready(run_dir), signum=signum, timeout_s=400)
        sandbox.assert_clean()
    finally:
        sandbox.cleanup()
    return code, log.read_text(), run_dir


def stop_line(output: str, signame: str) -> re.Match:
    found = re.findall(rf"^meshrl: interrupted by {signame} at step (\d+); last checkpoint: (\S+); resume with the "
                       r"same command$", output, re.MULTILINE)
    assert len(found) == 1, output[-3000:]
    return found[0]


# `make test-extended` (68 test-seconds): the stop request and its one line are the SIGTERM case's below, the fully
# async trainer's stop between syncs tests/trainer/test_trainer_loop.py's.
@pytest.mark.extended
def test_ctrl_c_stops_with_one_line_and_exit_code_130(tmp_path):
    """On the fully async trainer, its rollouter a batch ahead on the workers' threads (staleness 1): Ctrl-C lands
    while a generation is in flight, which the run leaves as cleanly as the synchronous one."""
    def saved_step_1(run_dir: Path) -> bool:
        return (run_dir / "global_step_1" / "COMPLETE").is_file()

    code, output, run_dir = interrupt(tmp_path, signal.SIGINT, saved_step_1, "trainer.save_freq=1",
                                      "trainer.async_mode=fully_async", "algorithm.rollout_correction.bypass_mode=True",
                                      "async_training.staleness_threshold=1", "async_training.require_batches=2",
                                      "async_training.trigger_parameter_sync_step=1")
    assert code == 130, output[-3000:]
    step, checkpoint = stop_line(output, "SIGINT")
    assert int(step) in (1, 2) and Path(checkpoint) == run_dir / "global_step_1"  # in step 2, or just after 1
    assert "Traceback" not in output and "KeyboardInterrupt" not in output
    assert "on a thread of each worker while it trains" in output  # the overlapped rollouter


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
    # A quiet console (meshrl.logs): the libraries' lines, the driver's and the worker's, are in the logs folder.
    logs = run_dir / "logs"
    assert output.count(f"goes to {logs}/") == 1, output[-3000:]
    for library_line in ("INFO", "Transformer Engine", "pid=", "Warning"):
        assert library_line not in output, output[-3000:]
    worker_log = (logs / "ActorRolloutRefWorker-rank0.log").read_text()
    assert "Transformer Engine and Apex are not installed" in worker_log and " INFO " in worker_log
    assert "Started a local Ray instance" in (logs / "driver.log").read_text()
