"""The fused output layer at TP2 and PP2 (``fused_output_worker.py`` under torchrun, one launch of 2 ranks):
fused vs unfused outputs, loss and gradients for tied and untied embeddings and a soft-capped Gemma 2, with
the bounds of ``test_fused_output.py``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from fused_output_worker import LAYOUTS, MODELS
from test_fused_output import GRAD_TOLERANCE, TOLERANCE

HERE = Path(__file__).resolve().parent


@pytest.mark.multiproc
@pytest.mark.timeout(600)
def test_fused_output_matches_the_unfused_one_at_tp2_and_pp2(tmp_path: Path) -> None:
    out, log = tmp_path / "fused.json", tmp_path / "fused.log"
    env = {**os.environ, "PYTHONPATH": str(HERE.parents[1]), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    with open(log, "w") as handle:
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
                        str(HERE / "fused_output_worker.py"), "--out", str(out)],
                       cwd=HERE.parents[1], env=env, stdout=handle, stderr=subprocess.STDOUT, timeout=540)
    assert out.is_file(), log.read_text()[-6000:]
    results = json.loads(out.read_text())
    failures = []
    for layout in LAYOUTS:
        for model in MODELS:
            r = results[layout][model]
            if not (r["outputs"] <= TOLERANCE and r["loss"] <= TOLERANCE and r["grads"] <= GRAD_TOLERANCE
                    and r["head_grad"] > 1e-3):
                failures.append(f"{layout} {model}: {r}")
    assert not failures, failures
