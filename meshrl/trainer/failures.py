"""A run that fails for a reason meshrl recognises ends with a report, not the driver's traceback.

Recognised failures (``RECOGNISED``) are the ones whose message already says what happened and what to check:
a worker that died or raised (``WorkerError``: its message names the role, the rank, the call and the worker's
own exception), the reward function failing batch after batch (``RewardError``) and the train/rollout log-prob
alarm (``LogProbMismatchError``). The command prints

    meshrl: the run failed at step 3: actor_rollout_ref rank 0 failed in update: FloatingPointError: ...
    meshrl: last checkpoint: <dir>/global_step_2; resume with the same command
    meshrl: the full output of the libraries and workers of this run is in <dir>/logs/

and exits 1. The driver's traceback goes to the run's ``logs/driver.log``. Any other exception is a bug, and
keeps its traceback on the console.
"""

from __future__ import annotations

import sys
import traceback
from pathlib import Path

from meshrl.rewards.pool import RewardError
from meshrl.trainer.alarms import LogProbMismatchError
from meshrl.trainer.interrupts import at_step, resume_hint
from meshrl.workers.group import WorkerError

RECOGNISED = (WorkerError, RewardError, LogProbMismatchError)


class RunFailed(RuntimeError):
    """The run stopped on a recognised failure; ``str()`` is the report (module docstring)."""

    exit_code = 1


def run_failed(cause: BaseException, step: int, checkpoint: Path | None, resume_mode: str,
               log_file: Path | None) -> RunFailed:
    """The exception ``run`` raises for ``cause`` once its workers are stopped. ``cause``'s traceback is appended
    to ``log_file`` (the run's driver log), or shown on the console without one (``trainer.verbose``)."""
    if log_file is None:
        traceback.print_exception(cause, file=sys.stderr)
    else:
        log_file.parent.mkdir(parents=True, exist_ok=True)
        with open(log_file, "a", encoding="utf-8") as out:
            traceback.print_exception(cause, file=out)
    return RunFailed(f"meshrl: the run failed {at_step(step)}: {cause}\nmeshrl: {resume_hint(checkpoint, resume_mode)}")
