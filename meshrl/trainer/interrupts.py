"""Ctrl-C and SIGTERM in the training driver: one line, the shell's exit code, workers stopped.

    Ctrl-C (SIGINT)   the run stops at once: a ``KeyboardInterrupt`` unwinds ``meshrl.trainer.main.run``,
                      whose ``finally`` stops the workers, engines, reward processes and Ray; the command
                      prints one line and exits 130.
    SIGTERM           the same, exit 143 (Slurm's preemption, ``scancel``, Kubernetes, ``kill``). With
                      ``trainer.save_on_preempt=True`` the step in progress finishes first and is saved as
                      a checkpoint (as a ``save_freq`` one would be), then the run stops.
    a second signal   stops at once, even while a preempted step finishes; once the workers are being
                      stopped, further signals are ignored so that the shutdown completes.

The line: ``meshrl: interrupted by SIGINT at step 3; last checkpoint: <dir>/global_step_2; resume with the
same command``.

Exit codes are 128 + the signal number: what a shell reports for a process the signal ended, so batch
scripts and schedulers read a meshrl run the same way as any killed program; 143 rather than Ctrl-C's 130
lets a job script tell a preemption (requeue and resume) from a user's interrupt.

Under Slurm, ``save_on_preempt`` needs the warning to reach the driver alone and early enough for a step
and a save: Slurm's own end-of-job SIGTERM goes to every process of the job, Ray's workers included, which
then die before the step completes. Ask for an early signal to the batch shell and forward it, e.g.
``#SBATCH --signal=B:TERM@300`` with ``trap 'kill -TERM $PID' TERM`` around ``python -m meshrl.trainer.main
... & PID=$!; wait $PID; wait $PID``.
"""

from __future__ import annotations

import signal
import sys
import threading
from pathlib import Path

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(KeyboardInterrupt):
    """The run stopped on a signal; ``str()`` is the line to show, ``exit_code`` 128 + the signal number.

    A ``KeyboardInterrupt``, so callers of ``run`` that catch Ctrl-C (a notebook, a test) still do.
    """

    def __init__(self, line: str, exit_code: int) -> None:
        super().__init__(line)
        self.exit_code = exit_code


class Interrupts:
    """The driver's SIGINT and SIGTERM handlers while its workers run (module docstring); a context manager.

    Installed only from the main thread (the only one Python delivers signals to); the previous handlers are
    restored on exit. Install it after ``ray.init``, which sets a SIGTERM handler of its own.

    Args:
        save_on_preempt: ``trainer.save_on_preempt``: a first SIGTERM lets the step in progress finish and be
            saved (the trainer polls :meth:`stop_requested` after each step) instead of stopping at once.
    """

    def __init__(self, save_on_preempt: bool) -> None:
        self.save_on_preempt = save_on_preempt
        self.signal: int | None = None  # the last signal received
        self.stopping = False  # the workers are being stopped: let the shutdown finish
        self._previous: dict[int, object] = {}

    def __enter__(self) -> Interrupts:
        if threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, self._handle) for sig in SIGNALS}
        return self

    def __exit__(self, *exc_info: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, frame: object) -> None:
        first = self.signal is None
        self.signal = signum
        if self.stopping:
            print(f"meshrl: {signal.Signals(signum).name}: still stopping the workers", file=sys.stderr, flush=True)
            return
        if first and signum == signal.SIGTERM and self.save_on_preempt:
            print("meshrl: SIGTERM: finishing and saving the step in progress, then stopping (trainer.save_on_preempt;"
                  " a second signal stops at once)", file=sys.stderr, flush=True)
            return
        # Ray's blocking calls turn only a KeyboardInterrupt raised by a handler into an interrupted wait.
        raise KeyboardInterrupt

    def stop_requested(self) -> bool:
        """Whether a signal asked the run to stop (the trainer then saves the step it finished, and stops)."""
        return self.signal is not None

    def interrupted(self, step: int, checkpoint: Path | None, resume_mode: str) -> Interrupted:
        """The exception ``run`` raises once its workers are stopped: the line names the signal, the step, the
        last complete ``checkpoint`` and how to resume (``trainer.resume_mode``)."""
        signum = self.signal if self.signal is not None else signal.SIGINT  # a KeyboardInterrupt raised directly
        return Interrupted(stop_line(signum, step, checkpoint, resume_mode), 128 + signum)


def stop_line(signum: int, step: int, checkpoint: Path | None, resume_mode: str) -> str:
    """``meshrl: interrupted by SIGINT at step N; last checkpoint: PATH; resume with the same command``, or the
    variant that says what the same command does when it would not resume from ``checkpoint``."""
    stopped = f"meshrl: interrupted by {signal.Signals(signum).name} {at_step(step)}"
    return f"{stopped}; {resume_hint(checkpoint, resume_mode)}"


def at_step(step: int) -> str:
    """``at step N`` for the step in progress, or ``before the first step``."""
    return f"at step {step}" if step > 0 else "before the first step"


def resume_hint(checkpoint: Path | None, resume_mode: str) -> str:
    """``last checkpoint: PATH; resume with the same command``, or what the same command does instead."""
    if checkpoint is None:
        again = "starts from trainer.resume_from_path again" if resume_mode == "resume_path" else "starts over"
        return f"no checkpoint yet: the same command {again}"
    resume = "resume with the same command" if resume_mode == "auto" else \
        f"resume with trainer.resume_mode=auto (this command's resume_mode={resume_mode} does not start from it)"
    return f"last checkpoint: {checkpoint}; {resume}"
