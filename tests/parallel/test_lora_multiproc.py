"""LoRA at TP2 and PP2 (CPU/gloo, one 2-rank torchrun launch of ``lora_mp_worker.py``, ~25 s on 2 cores):
meshrl's adapters loaded from PEFT's random adapter give PEFT's log-probs and adapter gradients (the
single-rank reference), save back PEFT's tensors, and merge to PEFT's ``merge_and_unload`` weights; a
distributed checkpoint saved at TP2 after an Adam step loads at PP2 with the adapters of that step. The TP2 Llama
checks run again under megatron's sequence parallelism (``tp2sp``), against the same PEFT reference and bounds.

Measured: log-probs <= 2.9e-6, adapter gradients <= 2.0e-6 (largest gradient entries 1e-2), saved and
merged tensors exact.
"""

from __future__ import annotations

import pytest
from torchrun_launch import launch

PHASES = ("tp2-llama", "pp2-llama", "tp2-qwen2", "tp2sp-llama")  # tp2sp: with sequence parallelism


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    workdir = tmp_path_factory.mktemp("lora-mp")
    return launch("lora_mp_worker.py", 2, workdir, "lora", 240, "--workdir", str(workdir))


@pytest.mark.multiproc
@pytest.mark.timeout(300)
@pytest.mark.parametrize("phase", PHASES)
def test_lora_at_tp2_pp2_matches_peft(results: dict, phase: str) -> None:
    values = results.get(phase)
    assert values is not None, f"phase {phase} produced no results; launch log tail:\n{results['_log']}"
    assert values["grad_names_mismatch"] == 0 and values["saved_names_mismatch"] == 0
    assert values["grad_scale"] > 1e-3  # every adapter tensor has a gradient worth comparing
    assert values["log_probs"] <= 1e-5
    assert values["grads"] <= 1e-5
    assert values["saved"] == 0.0
    assert values["merged"] <= 1e-6
    if phase == "pp2-llama":  # loads the checkpoint the TP2 phase saved after an Adam step
        assert values["checkpoint"] == 0.0
