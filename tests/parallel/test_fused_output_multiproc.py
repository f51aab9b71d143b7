"""The fused output layer at TP2 and PP2 (``fused_output_worker.py`` under torchrun, one launch of 2 ranks):
fused vs unfused outputs, loss and gradients for tied and untied embeddings and a soft-capped Gemma 2, with
the bounds of ``test_fused_output.py``."""

from __future__ import annotations

from pathlib import Path

import pytest
from fused_output_worker import LAYOUTS, MODELS
from test_fused_output import GRAD_TOLERANCE, TOLERANCE
from torchrun_launch import launch


@pytest.mark.multiproc
@pytest.mark.timeout(600)
def test_fused_output_matches_the_unfused_one_at_tp2_and_pp2(tmp_path: Path) -> None:
    results = launch("fused_output_worker.py", 2, tmp_path, "fused", 540)
    assert set(results) != {"_log"}, results["_log"]  # the launch wrote its results
    failures = []
    for layout in LAYOUTS:
        for model in MODELS:
            r = results[layout][model]
            if not (r["outputs"] <= TOLERANCE and r["loss"] <= TOLERANCE and r["grads"] <= GRAD_TOLERANCE
                    and r["head_grad"] > 1e-3):
                failures.append(f"{layout} {model}: {r}")
    assert not failures, failures
