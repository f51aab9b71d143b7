"""LoRA on mixture-of-experts models at EP2 and TP2 against PEFT (CPU/gloo, one 2-rank torchrun launch of
``lora_moe_worker.py``, ~22 s on 2 cores): tiny Qwen2-MoE (with its shared expert) and Qwen3-MoE, adapters on the
attention, the shared expert, every routed expert and the router (PEFT's ``target_parameters`` on transformers 5's
3-D expert weights and the router's weight), loaded from PEFT's random adapter: PEFT's log-probs and adapter
gradients, its tensors saved back, its ``merge_and_unload`` weights per expert, and a distributed checkpoint saved
at EP2 after an Adam step loaded at TP2 (experts split over expert-TP ranks).

Measured: log-probs <= 1.9e-6, adapter gradients <= 2.5e-6 (the smallest tensor's largest entry 6e-3); saved,
merged and checkpointed tensors exact. Without the expert-TP sum of the experts' replicated factors
(``layers.ETP_PARTIAL_GRAD``) the TP2 gradients are off by 1.4e-2.
"""

from __future__ import annotations

import pytest
from torchrun_launch import launch

PHASES = ("ep2-qwen2_moe", "tp2-qwen2_moe", "ep2-qwen3_moe", "tp2-qwen3_moe")


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    workdir = tmp_path_factory.mktemp("lora-moe")
    return launch("lora_moe_worker.py", 2, workdir, "lora_moe", 240, "--workdir", str(workdir))


@pytest.mark.multiproc
@pytest.mark.timeout(300)
@pytest.mark.parametrize("phase", PHASES)
def test_lora_on_moe_at_ep2_tp2_matches_peft(results: dict, phase: str) -> None:
    values = results.get(phase)
    assert values is not None, f"phase {phase} produced no results; launch log tail:\n{results['_log']}"
    # every routed expert is adapted: 8 experts x 2 layers x (linear_fc1, linear_fc2), half of them per EP rank
    assert values["expert_adapters"] == (16 if phase.startswith("ep2") else 32)
    assert values["router_adapters"] == 2  # one router per layer, whole on every rank
    assert values["grad_names_mismatch"] == 0 and values["saved_names_mismatch"] == 0
    assert values["merged_names_mismatch"] == 0 and values["saved_target_parameters"] == 1
    assert values["grad_scale"] > 1e-3  # every adapter tensor has a gradient worth comparing
    assert values["log_probs"] <= 1e-5
    assert values["grads"] <= 1e-5
    assert values["saved"] == 0.0
    assert values["merged"] <= 1e-6
    if phase == "tp2-qwen2_moe":  # loads the checkpoint the EP2 phase saved after an Adam step
        assert values["checkpoint"] == 0.0
