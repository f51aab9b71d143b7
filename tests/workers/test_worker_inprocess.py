"""The policy worker driven in-process (``worker_checks.py``, one fresh process, ~10 s): asserts on its results."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("worker_checks") / "results.json"
    env = {**os.environ, "PYTHONPATH": str(HERE.parents[1]), "OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1"}
    run = subprocess.run([sys.executable, str(HERE / "worker_checks.py"), "--out", str(out)], env=env,
                         capture_output=True, text=True, timeout=540)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    return json.loads(out.read_text())


def test_on_policy_update_equals_the_update_on_recomputed_log_probs(results):
    r = results["on_policy"]
    assert r["recompute_returns_nothing"] and r["returned_shape_ok"]
    # logπ_θ.detach() in place of the recomputed logπ_old: the same loss and gradient (bitwise here;
    # fp32 rounding is all that could differ)
    assert r["loss_diff"] <= 1e-6 * abs(r["pg_loss"]) + 1e-7
    assert r["grad_diff"] <= 1e-6 * r["grad_max_abs"]
    assert r["grad_norm_diff"] <= 1e-6
    # the log-probs handed back are the policy's before the step, zero outside the responses
    assert r["returned_vs_recomputed"] <= 1e-6
    assert r["returned_outside_mask"] == 0.0
