"""Checks shared by the end-to-end tests (import as ``from e2e_checks import ...``: pytest puts this folder on
sys.path)."""

import math
from collections.abc import Iterable
from pathlib import Path

import pytest

from meshrl.trainer.tracking import METRICS_FILE, read_metrics


def non_finite(metrics: dict) -> dict:
    """The float metrics that are NaN or infinite (empty when all are finite)."""
    return {k: v for k, v in metrics.items() if isinstance(v, float) and not math.isfinite(v)}


def steps_of(run_dir: Path) -> dict[int, dict]:
    """A run folder's logged metrics by step (a step's several records merged)."""
    steps: dict[int, dict] = {}
    for record in read_metrics(Path(run_dir) / METRICS_FILE):
        steps.setdefault(record["step"], {}).update(record)
    return steps


def with_extended(names: Iterable[str], extended: set[str]) -> list:
    """``names`` as parametrize values, those in ``extended`` marked ``extended`` (``make test-extended``)."""
    return [pytest.param(name, marks=[pytest.mark.extended] if name in extended else []) for name in names]
