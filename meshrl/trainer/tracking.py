"""Where a run's metrics go (``trainer.logger``), and the per-phase step timer.

Backends, any combination:

    console      a tqdm bar over the training steps (rate, ETA; a few key metrics as postfix) on stderr,
                 shown only on a terminal, and one summary line per step on stdout (also in log files)
    jsonl        ``<run_dir>/metrics.jsonl``: one JSON object per line, ``{"step": N, "<key>": value}``,
                 flushed per line; non-finite values are written as null so every line is valid JSON
    tensorboard  ``<run_dir>/tensorboard`` (torch's SummaryWriter); the config as a text entry
    wandb        Weights & Biases, offline unless ``WANDB_MODE`` says otherwise; the run id is kept in
                 ``<run_dir>/wandb_run_id.txt`` so a resumed run continues the same W&B run

Resuming: the trainer calls :meth:`Tracker.truncate_after` with the step it restarts from (0 for a
fresh start). The JSONL file is appended to, so that call drops the lines a crashed run wrote after its
last checkpoint (at 0: every line, an older run's step 0 included), and the resumed run never shows a
step twice; TensorBoard purges the same steps.
Several lines may share a step (e.g. validation logged in its own call); readers merge them.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from tqdm import tqdm

from meshrl.config.schema import LOGGERS

METRICS_FILE = "metrics.jsonl"

# What the console shows, by label: the first candidate key present in a step's metrics wins (meshrl's
# names first, then verl's). Keys not listed here are left to the other backends.
CONSOLE_KEYS: dict[str, tuple[str, ...]] = {
    "score": ("score/mean", "critic/score/mean"),
    "acc": ("score/accuracy",),
    "val": ("val/score", "val/score/mean", "val/accuracy"),
    "len": ("response_length/mean",),
    # the features a run switched on, when it did: multi-turn rollouts (meshrl.rollout.agent_loop), rollout
    # correction's IS weights and rejection (meshrl.algorithms.rollout_correction), the asynchronous trainers' staleness
    "turns": ("agent/num_turns/mean",),
    "tool_calls": ("agent/tool_calls/mean",),
    "is_weight": ("rollout_corr/rollout_is_mean",),
    "rejected": ("rollout_corr/rollout_rs_masked_fraction",),
    "stale": ("training/off_policy/trajectory_staleness/mean",),
    # KL to the reference policy, however the run measures it.
    "kl": ("actor/kl", "actor/ref_kl_k1", "actor/reward_kl_penalty", "actor/kl_loss", "kl/mean"),
    "entropy": ("actor/entropy", "entropy/mean"),
    "grad_norm": ("actor/grad_norm",),
    "tok/s": ("perf/tokens_per_s", "perf/throughput"),
    "s/step": ("timing/step_s", "timing_s/step"),
}
# The subset in the bar's postfix; the last value of each stays shown (validation runs only every few steps).
POSTFIX_LABELS = ("score", "val", "kl", "s/step")


def read_metrics(path: Path, skipped: list[int] | None = None) -> list[dict[str, Any]]:
    """The records of a metrics JSONL file, in file order; lines that are not a JSON object with an
    integer ``step`` (a line cut short by a killed process) are skipped, their 1-based numbers appended to
    ``skipped`` when given (blank lines are not counted)."""
    records = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, 1):
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                record = None
            if isinstance(record, dict) and isinstance(record.get("step"), int):
                records.append(record)
            elif skipped is not None and line.strip():
                skipped.append(number)
    return records


class Tracker:
    """Sends each step's metrics to the chosen backends (module docstring); a context manager.

    Args:
        loggers: backend names (``trainer.logger``), any of console, jsonl, tensorboard, wandb.
        run_dir: folder for the files the backends write; created if missing.
        project, experiment: ``trainer.project_name`` / ``trainer.experiment_name`` (W&B run naming,
            the console bar's label).
        config: the resolved config as plain containers (TensorBoard text, W&B config).
        total_steps: training steps in the run (the bar's total and ETA).

    Raises:
        ValueError: an unknown logger name (the message lists the valid ones).
        ImportError: ``wandb`` requested but not installed (the message says how to fix it).
    """

    def __init__(
        self,
        loggers: list[str],
        run_dir: Path,
        project: str,
        experiment: str,
        config: Mapping[str, Any],
        total_steps: int,
    ) -> None:
        names = [loggers] if isinstance(loggers, str) else list(loggers)
        unknown = [name for name in names if name not in LOGGERS]
        if unknown:
            raise ValueError(f"unknown trainer.logger entries {unknown}; valid loggers: {', '.join(LOGGERS)}")
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._backends: list[_Backend] = []
        self._closer = ExitStack()
        try:
            for name in dict.fromkeys(names):  # de-duplicated, in the order given
                backend = self._open(name, project, experiment, config, total_steps)
                self._closer.callback(backend.close)
                self._backends.append(backend)
        except BaseException:
            self._closer.close()
            raise

    def _open(self, name: str, project: str, experiment: str, config: Mapping[str, Any], total: int) -> _Backend:
        if name == "console":
            return _Console(experiment, total)
        if name == "jsonl":
            return _Jsonl(self.run_dir / METRICS_FILE)
        if name == "tensorboard":
            return _TensorBoard(self.run_dir / "tensorboard", config)
        return _Wandb(self.run_dir, project, experiment, config)

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        """Record ``metrics`` for training step ``step``.

        Values are numbers (floats, ints, NumPy scalars, one-element tensors) or None for "no value this
        step" (e.g. the grad norm of a skipped optimizer step), which is recorded like NaN.

        Raises:
            TypeError: a value is not a number (the message names its key).
            ValueError: a metric is named ``step`` (reserved for the step number).
        """
        if "step" in metrics:
            raise ValueError("'step' is reserved for the step number; rename that metric")
        values = {key: _as_number(key, value) for key, value in metrics.items()}
        for backend in self._backends:
            backend.log(values, step)

    def truncate_after(self, step: int) -> None:
        """Continue a run after ``step``: drop records with a higher step (JSONL lines, TensorBoard
        events) and move the progress bar to ``step``. Call it once at start with the resumed step, or 0
        for a fresh start, which drops every record, step 0's too (no checkpoint is ever of step 0, so
        records of step 0 in the folder are an older run's). W&B keeps its history; it ignores re-logged
        steps with a warning."""
        for backend in self._backends:
            backend.truncate_after(step)

    def close(self) -> None:
        """Flush and close every backend (each one even if another fails); safe to call twice."""
        self._closer.close()

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _as_number(key: str, value: Any) -> float:
    if value is None:
        return math.nan
    try:
        if isinstance(value, (str, bytes)):
            raise TypeError
        return float(value)
    except (TypeError, ValueError) as err:
        raise TypeError(f"metric {key!r} is {type(value).__name__} {value!r}, not a number") from err


class Timer:
    """Wall-clock seconds per phase of one step: ``with timer("gen"): ...`` adds to ``timing/gen_s``.

    Use a fresh Timer per step. Repeated blocks of one name add up; blocks may nest (``with
    timer("step")`` around the phases gives ``timing/step_s``, the step total). The driver waits for its
    workers' results, so the wall time a phase takes on the driver is the phase's time. A block that
    raises still counts its time.
    """

    def __init__(self) -> None:
        self._seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self._seconds[name] = self._seconds.get(name, 0.0) + time.perf_counter() - start

    def total(self, name: str) -> float:
        """Seconds spent in blocks named ``name`` so far (0.0 if none ran)."""
        return self._seconds.get(name, 0.0)

    def metrics(self) -> dict[str, float]:
        """``{"timing/<name>_s": seconds}`` for every phase timed."""
        return {f"timing/{name}_s": seconds for name, seconds in self._seconds.items()}


class _Backend:
    def log(self, metrics: dict[str, float], step: int) -> None:
        raise NotImplementedError

    def truncate_after(self, step: int) -> None:
        """Forget records after ``step``; backends that cannot rewrite history do nothing."""

    def close(self) -> None:
        """Release files and handles."""


def _fmt(value: float) -> str:
    return f"{value:.4g}"


def _is_terminal(stream: Any) -> bool:
    return hasattr(stream, "isatty") and stream.isatty()


class _Console(_Backend):
    def __init__(self, experiment: str, total_steps: int) -> None:
        self._total = total_steps
        self._postfix: dict[str, str] = {}
        # On a pipe or file a redrawn bar is noise; the summary lines carry step, total and ETA there.
        self._bar = tqdm(total=total_steps, desc=experiment, unit="step", dynamic_ncols=True,
                         disable=not _is_terminal(sys.stderr))
        # For the ETA in the summary lines: measured from the first step logged by this process, so the
        # set-up time before it (model loading, validation before training) does not count as a step.
        self._first: tuple[float, int] | None = None

    def log(self, metrics: dict[str, float], step: int) -> None:
        shown = {}
        for label, keys in CONSOLE_KEYS.items():
            key = next((k for k in keys if k in metrics), None)
            if key is not None:
                shown[label] = _fmt(metrics[key])
        self._postfix.update((label, shown[label]) for label in POSTFIX_LABELS if label in shown)
        if step > self._bar.n:
            self._bar.update(step - self._bar.n)
        self._bar.set_postfix_str(" ".join(f"{k}={v}" for k, v in self._postfix.items()), refresh=True)
        parts = [f"step {step}/{self._total}", *(f"{label} {value}" for label, value in shown.items())]
        now = time.monotonic()
        if self._first is None:
            self._first = (now, step)
        elif step > self._first[1]:
            per_step = (now - self._first[0]) / (step - self._first[1])
            parts.append(f"eta {tqdm.format_interval(per_step * max(0, self._total - step))}")
        tqdm.write(" | ".join(parts), file=sys.stdout)

    def truncate_after(self, step: int) -> None:
        # Moved in place rather than reopened, which would leave a stale bar line on the terminal; the
        # rate then counts only the steps this process runs.
        self._bar.reset()
        self._bar.n = self._bar.last_print_n = self._bar.initial = step
        self._bar.refresh()
        self._first = None

    def close(self) -> None:
        self._bar.close()


class _Jsonl(_Backend):
    def __init__(self, path: Path) -> None:
        self.path = path
        _drop_partial_last_line(path)
        self._file = open(path, "a", encoding="utf-8")

    def log(self, metrics: dict[str, float], step: int) -> None:
        record = {"step": step, **{k: v if math.isfinite(v) else None for k, v in metrics.items()}}
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()

    def truncate_after(self, step: int) -> None:
        self._file.close()
        kept = [r for r in read_metrics(self.path) if r["step"] <= step] if step > 0 else []
        tmp = self.path.with_name(f"{self.path.name}.tmp-{os.getpid()}")
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r, allow_nan=False) + "\n" for r in kept)
        os.replace(tmp, self.path)
        self._file = open(self.path, "a", encoding="utf-8")

    def close(self) -> None:
        self._file.close()


def _drop_partial_last_line(path: Path) -> None:
    """Cut a last line without its newline (a killed writer's), so appended records start on a new line."""
    if not path.is_file():
        return
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        with open(path, "r+b") as f:
            f.truncate(data.rfind(b"\n") + 1)


class _TensorBoard(_Backend):
    def __init__(self, log_dir: Path, config: Mapping[str, Any]) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._open = lambda purge_step: SummaryWriter(str(log_dir), purge_step=purge_step)
        self._config_text = "```\n" + json.dumps(config, indent=2, default=str) + "\n```"
        # Opened at the first record, so a truncate_after() at start does not leave an extra event file.
        self._writer: Any = None
        self._purge_step: int | None = None

    def log(self, metrics: dict[str, float], step: int) -> None:
        if self._writer is None:
            self._writer = self._open(self._purge_step)
            self._writer.add_text("config", self._config_text, step)
        for key, value in metrics.items():
            if math.isfinite(value):
                self._writer.add_scalar(key, value, step)
        self._writer.flush()

    def truncate_after(self, step: int) -> None:
        # purge_step makes TensorBoard discard events of steps >= purge_step written before this point.
        self.close()
        self._writer = None
        self._purge_step = step + 1 if step > 0 else 0

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()


class _Wandb(_Backend):
    def __init__(self, run_dir: Path, project: str, experiment: str, config: Mapping[str, Any]) -> None:
        try:
            import wandb
        except ImportError as err:
            raise ImportError(
                "trainer.logger includes 'wandb' but the wandb package is not installed: `pip install wandb`, "
                "or drop 'wandb' from trainer.logger (e.g. trainer.logger=[console,jsonl,tensorboard])"
            ) from err
        id_file = run_dir / "wandb_run_id.txt"
        if id_file.is_file():
            run_id = id_file.read_text().strip()
        else:
            run_id = secrets.token_hex(8)
            id_file.write_text(run_id + "\n")
        self._run = wandb.init(
            project=project, name=experiment, id=run_id, resume="allow", dir=str(run_dir), config=dict(config),
            mode=os.environ.get("WANDB_MODE", "offline"),
        )

    def log(self, metrics: dict[str, float], step: int) -> None:
        self._run.log(metrics, step=step)

    def close(self) -> None:
        self._run.finish()
