"""The train/rollout log-prob alarm: the engine must serve the policy the trainer evaluates.

Peers' worst bugs are silent: stale weights in the engine after a sync, a conversion that drops or misplaces
a tensor. Both show as a gap between the log-probs the engine reported for its sampled tokens
(``rollout_log_probs``) and those the trainer recomputes for them (``old_log_probs``). The statistic is

    d = mean over response tokens of |old_log_probs − rollout_log_probs|     (rollout/log_prob_mean_abs_diff)

— the mean, not the maximum (``rollout/log_prob_max_abs_diff``, logged beside it and named in the message):
in 16-bit a few low-probability tokens differ by far more than the rest on a healthy run, while a broken
sync moves every token. ``MismatchAlarm.check`` judges each step that has both log-probs:

1. **first check** of a process (step 1, and the first step after every resume, whose engine was just
   re-synced): ``d > tolerance`` is an alarm;
2. **jump**, once ``MIN_HISTORY`` earlier steps were judged: ``d > JUMP_FACTOR × median(the last HISTORY d's)``
   and ``d > tolerance / JUMP_FACTOR`` (the floor keeps float32 rounding noise, ~1e-6, from counting as a
   jump) is an alarm. The median is robust to single outliers; every step's ``d`` enters the history, so a
   lasting change of level stops being news after ``HISTORY / 2`` steps;
3. a non-finite ``d`` is an alarm.

``tolerance`` is the run plan's (``RunPlan.mismatch_tolerance``: ``trainer.mismatch_tolerance``, else by the
precision of trainer and engine; None when the config makes the two log-probs incomparable, e.g. top-k
sampling with ``processed_logprobs``). An alarm stops the run with ``LogProbMismatchError`` naming the
likely causes (``trainer.on_mismatch=stop``), or logs one warning and sets ``rollout/log_prob_mismatch_alarm``
(``warn``). The history is part of the checkpoint's driver state, so a resumed run judges jumps as an
uninterrupted one would.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

logger = logging.getLogger(__name__)

MEAN_KEY = "rollout/log_prob_mean_abs_diff"
MAX_KEY = "rollout/log_prob_max_abs_diff"
ALARM_KEY = "rollout/log_prob_mismatch_alarm"
HISTORY = 20
MIN_HISTORY = 3
JUMP_FACTOR = 10.0

CAUSES = ("likely causes: a stale or partial weight sync (the engine kept old or random weights for some "
          "tensors); a weight conversion that drops, transposes or misplaces a tensor (fused QKV / gate-up "
          "split, tied embeddings, a norm); sampling settings that change what the engine reports "
          "(rollout.logprobs_mode, temperature, top_k / top_p); a precision gap (rollout.dtype against "
          "actor_rollout_ref.actor.megatron.dtype)")


class LogProbMismatchError(RuntimeError):
    """The engine's log-probs of its sampled tokens are not the trainer's (``trainer.on_mismatch=stop``)."""


def mismatch_verdict(mean: float, history: Sequence[float], tolerance: float, first: bool) -> str | None:
    """Why ``mean`` (this step's token-mean |old − rollout|) is an alarm, or None; rules in the module doc."""
    if not math.isfinite(mean):
        return f"the mean is {mean}"
    if first and mean > tolerance:
        return f"it exceeds the tolerance {tolerance:.3g} at the first check since the run started or resumed"
    if len(history) >= MIN_HISTORY:
        median = statistics.median(history[-HISTORY:])
        if mean > JUMP_FACTOR * median and mean > tolerance / JUMP_FACTOR:
            return (f"it jumped above {JUMP_FACTOR:g}x the median {median:.3g} of the last "
                    f"{min(len(history), HISTORY)} "
                    f"steps (and above the floor {tolerance / JUMP_FACTOR:.3g})")
    return None


def alarm_message(step: int, metrics: Mapping[str, float], why: str) -> str:
    """What the alarm says: the step, the gap (mean and max), why it is an alarm, the likely causes."""
    return (f"train/rollout log-prob mismatch at step {step}: mean |old_log_probs - rollout_log_probs| over the "
            f"response tokens is {metrics[MEAN_KEY]:.3g} (max {metrics.get(MAX_KEY, float('nan')):.3g}); {why}. "
            f"The engine does not serve the policy the trainer evaluates; {CAUSES}.")


class MismatchAlarm:
    """The alarm's state over a run: the recent means and whether this process has judged a step yet."""

    def __init__(self, tolerance: float | None, action: str) -> None:
        self.tolerance = tolerance  # None: off (RunPlan.mismatch_tolerance)
        self.action = action  # trainer.on_mismatch: stop | warn
        self.history: deque[float] = deque(maxlen=HISTORY)
        self.first = True  # not saved: after a resume the re-synced engine gets the first check again

    def check(self, step: int, metrics: Mapping[str, float]) -> dict[str, float]:
        """Judge ``metrics[MEAN_KEY]`` of ``step`` (nothing when the step has none or the alarm is off); returns
        ``{ALARM_KEY: 0 or 1}``. Raises ``LogProbMismatchError`` on an alarm under ``action="stop"``."""
        if self.tolerance is None or MEAN_KEY not in metrics:
            return {}
        mean = float(metrics[MEAN_KEY])
        why = mismatch_verdict(mean, list(self.history), self.tolerance, self.first)
        self.first = False
        if math.isfinite(mean):  # a NaN would leave the median undefined (under warn the run goes on)
            self.history.append(mean)
        if why is None:
            return {ALARM_KEY: 0.0}
        if self.action == "stop":
            raise LogProbMismatchError(f"{alarm_message(step, metrics, why)} Stopped (trainer.on_mismatch=stop); if "
                                       "the gap is expected, raise trainer.mismatch_tolerance or set "
                                       "trainer.on_mismatch=warn or ignore.")
        logger.warning("%s Training goes on (trainer.on_mismatch=warn).", alarm_message(step, metrics, why))
        return {ALARM_KEY: 1.0}

    def state_dict(self) -> dict[str, Any]:
        return {"history": list(self.history)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.history = deque((float(v) for v in state["history"]), maxlen=HISTORY)
