"""A run's curves on one PNG: ``meshrl plot RUN_DIR [--out FILE]`` or :func:`plot_run`.

Reads ``metrics.jsonl`` (the ``jsonl`` logger's file) and draws one panel per metric group, in the
order a person checks a run: score / accuracy (train and validation), response length, KL, entropy,
clip fraction, grad norm, learning rate, time per phase (stacked, with the step total as a line),
tokens/s, dynamic-batch samples and tokens per micro-batch; then every other key grouped by its prefix
before '/'. Groups with no data are skipped; a null or non-finite value leaves a gap, marked by a red
cross on the step axis; a ``<x>/mean`` with ``<x>/min`` / ``<x>/max`` is drawn as a line in a shaded
min–max band (``<x>/std``: a ±std band). Lines sharing a step (e.g. validation logged on its own) are merged.
"""

from __future__ import annotations

import argparse
import logging
import math
import re
import sys
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from meshrl.trainer.startup import PREFIX as STARTUP
from meshrl.trainer.tracking import METRICS_FILE, read_metrics

logger = logging.getLogger(__name__)

SCORE = "score / accuracy"
LENGTH = "response length"
KL = "KL"
ENTROPY = "entropy"
CLIPFRAC = "clip fraction"
GRAD_NORM = "grad norm"
LR = "learning rate"
TIMING = "time per phase (s)"
THROUGHPUT = "tokens/s"
DB_SAMPLES = "dynamic batch: samples / micro-batch"
DB_TOKENS = "dynamic batch: tokens / micro-batch"
# Display order of the named panels; other groups follow alphabetically.
NAMED_PANELS = (SCORE, LENGTH, KL, ENTROPY, CLIPFRAC, GRAD_NORM, LR, TIMING, THROUGHPUT, DB_SAMPLES, DB_TOKENS)

_TIMING_PREFIXES = ("timing", "timing_s")
_STEP_TOTALS = ("timing/step_s", "timing_s/step")
_MAX_LINES = 10  # per panel, so legends stay readable
_BAND = re.compile(r"(.+?)[/_](mean|min|max|std)")


def panel_for(key: str) -> str:
    """The panel a metric key is drawn in: a named panel, or its prefix before '/' ("other" for none)."""
    prefix = key.split("/", 1)[0] if "/" in key else "other"
    words = set(re.split(r"[/_\-@.]", key.lower()))
    # Timing keys first: "timing/kl_s" is a phase, not a KL value.
    if prefix in _TIMING_PREFIXES:
        return TIMING
    if prefix == "dynamic_batch" and "samples" in words:
        return DB_SAMPLES
    if prefix == "dynamic_batch" and "tokens" in words:
        return DB_TOKENS
    if "tokens_per_s" in key or "throughput" in words:
        return THROUGHPUT
    if words & {"score", "acc", "accuracy"}:
        return SCORE
    if "response_length" in key:
        return LENGTH
    if "kl" in words:
        return KL
    if "entropy" in words:
        return ENTROPY
    if "clipfrac" in words or "clip_frac" in key:
        return CLIPFRAC
    if "grad_norm" in key:
        return GRAD_NORM
    if "lr" in words or "learning_rate" in key:
        return LR
    return prefix


def collect_series(records: Sequence[dict[str, Any]]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """``{key: (steps, values)}`` from metric records, merged by step (a later record wins per key).

    Null and non-finite values become NaN; keys that never hold a finite number are left out, and so are the
    start-up's (``startup/*``: one number per run, not a curve).
    """
    by_step: dict[int, dict[str, Any]] = defaultdict(dict)
    for record in records:
        by_step[record["step"]].update(record)
    steps = sorted(by_step)
    keys = sorted({k for values in by_step.values() for k in values if k != "step" and not k.startswith(STARTUP)})
    series = {}
    for key in keys:
        points = [(s, _as_float(by_step[s][key])) for s in steps if key in by_step[s]]
        x = np.array([s for s, _ in points], dtype=np.int64)
        y = np.array([v for _, v in points], dtype=np.float64)
        if np.isfinite(y).any():
            series[key] = (x, y)
    return series


def _as_float(value: Any) -> float:
    if isinstance(value, (int, float)) and math.isfinite(value):
        return float(value)
    return math.nan


def plot_metrics(records: Sequence[dict[str, Any]], out: Path, title: str = "") -> list[str]:
    """Draw ``records`` (metric dicts with a ``step``) into the PNG ``out``; returns the panel titles
    drawn, in order (empty when there is no data: the image then says so)."""
    # Imported here so MPLCONFIGDIR from meshrl.runtime.configure_environment() applies, and so the
    # CLI's other commands do not pay for matplotlib. No pyplot: no global backend is switched.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    series = collect_series(records)
    groups: dict[str, list[str]] = defaultdict(list)
    for key in series:
        groups[panel_for(key)].append(key)
    panels = [p for p in NAMED_PANELS if p in groups] + sorted(p for p in groups if p not in NAMED_PANELS)

    ncols = min(3, max(1, len(panels)))
    nrows = max(1, math.ceil(len(panels) / ncols))
    fig = Figure(figsize=(5.2 * ncols, 3.4 * nrows), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    for ax, panel in zip(axes, panels):
        if panel == TIMING:
            _draw_timing(ax, {k: series[k] for k in groups[panel]})
        else:
            _draw_lines(ax, {k: series[k] for k in groups[panel]})
        ax.set_title(panel, fontsize=10)
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    for ax in axes[len(panels):]:
        ax.set_visible(False)
    if not panels:
        axes[0].set_visible(True)
        axes[0].axis("off")
        axes[0].text(0.5, 0.5, "no metrics logged yet", ha="center", va="center")
    if title:
        fig.suptitle(title, fontsize=11)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    return panels


def _draw_lines(ax: Any, series: dict[str, tuple[np.ndarray, np.ndarray]]) -> None:
    stats_of: dict[str, dict[str, str]] = defaultdict(dict)
    for key in series:
        match = _BAND.fullmatch(key)
        if match:
            stats_of[match.group(1)][match.group(2)] = key
    # (label, key of the line, its stats when drawn with a band)
    lines: list[tuple[str, str, dict[str, str] | None]] = []
    in_band: set[str] = set()
    for base, stats in stats_of.items():
        if "mean" in stats and len(stats) > 1:
            extent = "–".join(k for k in ("min", "max") if k in stats) or "±std"
            lines.append((f"{base} (mean, {extent})", stats["mean"], stats))
            in_band.update(stats.values())
    lines += [(key, key, None) for key in series if key not in in_band]
    lines.sort()
    for label, key, stats in lines[:_MAX_LINES]:
        x, y = series[key]
        # Steps where the key was absent are not points, so sparse series (validation) stay connected;
        # a logged null/NaN/inf is a point, drawn as a gap plus a red cross on the axis.
        bad = ~np.isfinite(y)
        marker = "o" if len(x) <= 40 else None  # so single validation points show
        (line,) = ax.plot(x, np.where(bad, np.nan, y), label=label, linewidth=1.3, marker=marker, markersize=3)
        if bad.any():
            ax.plot(x[bad], np.full(bad.sum(), 0.02), "x", color="red", markersize=5,
                    transform=ax.get_xaxis_transform())
        if stats is not None:
            steps, low, high = _band(series, stats)
            ax.fill_between(steps, low, high, color=line.get_color(), alpha=0.15, linewidth=0)
    if len(lines) > _MAX_LINES:
        ax.text(0.99, 0.01, f"+{len(lines) - _MAX_LINES} more keys", transform=ax.transAxes, ha="right", va="bottom",
                fontsize=7)
    ax.legend(fontsize=7, loc="best")


def _band(series: dict[str, tuple[np.ndarray, np.ndarray]], stats: dict[str, str]) -> tuple[np.ndarray, ...]:
    """(steps, low, high) of the shaded band around ``stats["mean"]``: min–max if logged, else mean ± std."""
    x, mean = series[stats["mean"]]

    def at_mean_steps(stat: str) -> np.ndarray:
        if stat not in stats:
            return mean
        by_step = dict(zip(*series[stats[stat]]))
        return np.array([by_step.get(s, np.nan) for s in x])

    if "min" in stats or "max" in stats:
        low, high = at_mean_steps("min"), at_mean_steps("max")
    else:
        std = at_mean_steps("std")
        low, high = mean - std, mean + std
    ok = np.isfinite(low) & np.isfinite(high)
    return x[ok], low[ok], high[ok]


def _draw_timing(ax: Any, series: dict[str, tuple[np.ndarray, np.ndarray]]) -> None:
    total_key = next((k for k in _STEP_TOTALS if k in series), None)
    phases = sorted(k for k in series if k != total_key)
    if phases:
        steps = np.unique(np.concatenate([series[k][0] for k in phases]))
        stacked = []
        for key in phases:
            x, y = series[key]
            row = np.zeros(len(steps))
            row[np.searchsorted(steps, x)] = np.nan_to_num(y, nan=0.0, posinf=0.0, neginf=0.0)
            stacked.append(row)
        ax.stackplot(steps, *stacked, labels=[_phase_name(k) for k in phases], alpha=0.8)
    if total_key is not None:
        x, y = series[total_key]
        ok = np.isfinite(y)
        ax.plot(x[ok], y[ok], color="black", linestyle="--", linewidth=1.2, label="step total")
    ax.legend(fontsize=7, loc="upper left")


def _phase_name(key: str) -> str:
    return key.split("/", 1)[1].removesuffix("_s")


def plot_run(run_dir: Path, out: Path | None = None) -> Path:
    """Draw ``<run_dir>/metrics.jsonl`` into ``out`` (default ``<run_dir>/metrics.png``) and return it.

    ``run_dir`` may also be the JSONL file itself. The panels drawn are logged at INFO level.

    Raises:
        FileNotFoundError: no metrics file (the message says to enable the ``jsonl`` logger).
    """
    out, panels = _render(_metrics_file(Path(run_dir)), out)
    logger.info("wrote %s with %d panels: %s", out, len(panels), ", ".join(panels) or "none (no data)")
    return out


def plot_finished_run(run_dir: Path) -> str:
    """Draw a finished run's curves when it logged ``metrics.jsonl``; returns the line to print about them.

    A run whose ``trainer.logger`` has no ``jsonl`` (verl's usual ``['console','wandb']``) has nothing
    to draw here: the line says so, and nothing is raised, so a run that trained ends successfully.
    """
    source = Path(run_dir) / METRICS_FILE
    if not source.is_file():
        return f"curves: none drawn (no {METRICS_FILE}: add 'jsonl' to trainer.logger to get them)"
    return f"metrics: {source}; curves: {plot_run(run_dir)}"


def main(argv: Sequence[str] | None = None) -> int:
    """``meshrl plot RUN_DIR [--out FILE]``: draw a run's metrics; prints the PNG path and its panels."""
    from meshrl.runtime import configure_environment

    parser = argparse.ArgumentParser(prog="meshrl plot", description="Draw a run's metrics.jsonl as a PNG grid.")
    parser.add_argument("run_dir", type=Path, help="the run folder holding metrics.jsonl (or the file itself)")
    parser.add_argument("--out", type=Path, default=None, help="PNG to write (default: RUN_DIR/metrics.png)")
    args = parser.parse_args(argv)
    try:
        source = _metrics_file(args.run_dir)
    except FileNotFoundError as err:
        parser.error(str(err))
    configure_environment()
    out, panels = _render(source, args.out)
    print(f"wrote {out}")
    print("panels: " + (", ".join(panels) if panels else "none (the file holds no numeric metrics)"))
    return 0


def _metrics_file(run_dir: Path) -> Path:
    source = run_dir if run_dir.is_file() else run_dir / METRICS_FILE
    if not source.is_file():
        raise FileNotFoundError(f"no {METRICS_FILE} in {run_dir}; runs write it when trainer.logger includes 'jsonl'")
    return source


def _render(source: Path, out: Path | None) -> tuple[Path, list[str]]:
    out = Path(out) if out is not None else source.with_name("metrics.png")
    skipped: list[int] = []
    records = read_metrics(source, skipped)
    if skipped:  # drawn without them, and said: a gap in the curves has this cause
        shown = ", ".join(map(str, skipped[:10])) + (f" and {len(skipped) - 10} more" if len(skipped) > 10 else "")
        print(f"meshrl plot: {source}: {len(skipped)} line(s) left out, not a JSON object with an integer 'step' "
              f"(line {shown}); a run killed while writing leaves its last line cut", file=sys.stderr)
    steps = [r["step"] for r in records]
    title = f"{source.parent.name}: steps {min(steps)}–{max(steps)}" if steps else source.parent.name
    return out, plot_metrics(records, out, title)
