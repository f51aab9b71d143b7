"""The policy worker with LoRA, in process (``lora_worker_checks.py`` in a fresh process, 25–50 s on 2 shared cores):
asserts on its measurements."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("lora_worker") / "results.json"
    env = {**os.environ, "PYTHONPATH": str(HERE.parents[1]), "OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1"}
    run = subprocess.run([sys.executable, str(HERE / "lora_worker_checks.py"), "--out", str(out)], env=env,
                         capture_output=True, text=True, timeout=400)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    return json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.timeout(450)
def test_lora_policy_worker(results: dict) -> None:
    r = results
    # the optimizer holds the 28 adapter tensors of the tiny Llama (2 layers x 7 modules x A, B), nothing else;
    # no reference model is built
    assert (r["optimizer_params"], r["optimizer_params_not_adapters"], r["adapters_outside_optimizer"]) == (28, 0, 0)
    assert not r["separate_reference"]
    # step 1: B = 0, so the reference (adapters off) is the policy exactly, and the engine samples from it
    assert r["step1_ref_vs_old"] == 0.0 and r["step1_engine_gap"] < 1e-4
    # updates move every adapter tensor and no base tensor; the reference stays the base model
    assert r["base_tensors_changed"] == 0 and r["adapter_tensors_unchanged"] == 0
    assert r["policy_moved"] > 0.1 and r["ref_after_updates_vs_step1"] == 0.0
    # the merged sync: the engine's log-probs are the trained policy's (fp32; measured 1.9e-6)
    assert r["after_sync_engine_gap"] < 1e-4
    # checkpoint: adapters and Adam's state restored exactly, the PEFT adapter beside them; the resumed engine
    # serves the restored policy
    assert r["moved_before_load"] > 0 and r["checkpoint_weights"] == 0.0 and r["checkpoint_adam"] == 0.0
    assert r["peft_files"] == ["adapter_config.json", "adapter_model.safetensors"]
    assert r["after_resume_engine_gap"] < 1e-4
