"""Checks shared by the end-to-end tests (import as ``from e2e_checks import ...``: pytest puts this folder on sys.path)."""

import math


def non_finite(metrics: dict) -> dict:
    """The float metrics that are NaN or infinite (empty when all are finite)."""
    return {k: v for k, v in metrics.items() if isinstance(v, float) and not math.isfinite(v)}
