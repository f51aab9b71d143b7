"""LoRA on mixture-of-experts models against PEFT, under torchrun (2 ranks); one launch, several phases.

    torchrun --nproc-per-node 2 tests/parallel/lora_moe_worker.py --workdir DIR --out DIR/lora_moe.json

PEFT (transformers 5 holds the routed experts as 3-D parameters) writes a random adapter (``init_lora_weights=False``:
B != 0, so every adapter tensor has a gradient) on the attention (and Qwen2-MoE's shared expert) by
``target_modules`` and on every routed expert and the router by ``target_parameters=["mlp.experts.gate_up_proj",
"mlp.experts.down_proj", "mlp.gate.weight"]``. Each phase loads it into meshrl's adapters at EP2 (TP1, two
data-parallel ranks: each runs half the micro-batches, the experts split over the ranks) or TP2 (tokens routed per
TP rank's share, experts split over expert-TP = TP, so the experts' adapters carry expert-TP partial gradients), and
records the largest
differences from PEFT's log-probs and adapter gradients (HF runs every micro-batch in one process), the adapter
saved back from the layout against PEFT's file, and the merged weights against PEFT's ``merge_and_unload`` (per
expert, the checkpoint's names). The EP2 Qwen2-MoE phase then takes an Adam step and saves a distributed
checkpoint; the TP2 Qwen2-MoE phase loads it and must hold the adapters saved in PEFT's format after that step.
Rank 0 writes the results (max over ranks); ``test_lora_moe_multiproc.py`` asserts the bounds.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from lora_mp_worker import run_launch  # noqa: E402
from moe_worker import make_micro_batches  # noqa: E402
from mp_worker import build, hf_model, hf_outputs, my_batches, policy_loss  # noqa: E402

from meshrl.models.tiny import tiny_model_dir, tiny_spec  # noqa: E402
from meshrl.parallel import checkpoint, lora, optimizer, peft_io, schedule, state  # noqa: E402
from meshrl.parallel.forward import OutputRequest  # noqa: E402

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
# (phase, family, layout); meshrl's targets are the attention and MLP names with experts=True
PHASES = [("ep2", "qwen2_moe", dict(expert_parallel=2)), ("tp2", "qwen2_moe", dict(tensor_parallel=2)),
          ("ep2", "qwen3_moe", dict(expert_parallel=2)), ("tp2", "qwen3_moe", dict(tensor_parallel=2))]
# the routed experts' weights and the router's (verl's "router" target)
EXPERT_PARAMETERS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj", "mlp.gate.weight"]
# PEFT's: the attention, the shared expert by its path (PEFT 0.21 reads a bare gate_proj / up_proj / down_proj on a
# transformers 5 MoE model as the routed experts' parameters too, gate and up with separate A's), the experts by
# target_parameters
PEFT_MODULES = {"qwen2_moe": ATTENTION + tuple(f"shared_expert.{name}" for name in MLP), "qwen3_moe": ATTENTION}
RANK, ALPHA = 4, 8
REQUEST = OutputRequest(entropy=True)


def peft_reference(path: Path, family: str, folder: Path) -> dict:
    """PEFT's random adapter saved in ``folder``; its log-probs, adapter gradients and merged weights (routed
    experts' per expert, under the checkpoint's names)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    model = get_peft_model(hf_model(path, critic=False), LoraConfig(
        r=RANK, lora_alpha=ALPHA, target_modules=list(PEFT_MODULES[family]), target_parameters=EXPERT_PARAMETERS,
        init_lora_weights=False))
    log_probs = []
    for mb in make_micro_batches():
        out = hf_outputs(model, mb, critic=False)
        policy_loss(out, mb)[0].backward()
        log_probs.append(out["log_probs"].detach())
    grads = {name.replace(".default", ""): p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    if dist.get_rank() == 0:
        model.save_pretrained(folder)
    dist.barrier()
    merged = {}
    for name, param in model.merge_and_unload().named_parameters():
        if name.endswith("mlp.experts.gate_up_proj"):
            for e, weight in enumerate(param.detach()):
                gate, up = weight.chunk(2)
                merged[f"{name[:-len('gate_up_proj')]}{e}.gate_proj.weight"] = gate
                merged[f"{name[:-len('gate_up_proj')]}{e}.up_proj.weight"] = up
        elif name.endswith("mlp.experts.down_proj"):
            for e, weight in enumerate(param.detach()):
                merged[f"{name[:-len('down_proj')]}{e}.down_proj.weight"] = weight
        else:
            merged[name] = param.detach().clone()
    return {"log_probs": log_probs, "grads": grads, "merged": merged}


def run_phase(name: str, family: str, layout: dict, workdir: Path) -> dict:
    from safetensors.torch import load_file
    from transformers import AutoConfig

    path = tiny_model_dir(tiny_spec(family))
    folder = workdir / f"peft-{family}"
    reference = peft_reference(path, family, folder)
    state.initialize(state.ParallelConfig(**layout))
    try:
        chunks = lora.apply_lora(build(path), lora.LoraSettings(rank=RANK, alpha=ALPHA, targets=ATTENTION + MLP,
                                                                experts=True, router=True))
        peft_io.load_adapter(chunks, folder)
        mine, mine_ref = my_batches(make_micro_batches()), my_batches(reference["log_probs"])
        out = schedule.forward_only(chunks, mine, REQUEST)
        for chunk in chunks:
            chunk.zero_grad_buffer()
        schedule.forward_backward(chunks, mine, policy_loss, REQUEST)
        grads = dict(peft_io.iter_adapter_weights(chunks, grads=True))
        saved = peft_io.save_adapter(chunks, workdir / f"saved-{name}-{family}")
        merged = dict(peft_io.iter_merged_weights(chunks, AutoConfig.from_pretrained(path)))
        stepped = layout_checkpoint(name, family, chunks, workdir)
    finally:
        state.destroy()
    result = {
        "log_probs": max(float((o["log_probs"] - r).abs().max())
                         for o, r in zip(out, mine_ref)),
        "grad_names_mismatch": len(set(grads) ^ set(reference["grads"])),
        "grads": max(float((grads[k] - reference["grads"][k]).abs().max()) for k in grads),
        "grad_scale": min(float(g.abs().max()) for g in reference["grads"].values()),
        "merged_names_mismatch": len(set(merged) ^ set(reference["merged"])),
        "merged": max(float((t - reference["merged"][k]).abs().max()) for k, t in merged.items()),
        "expert_adapters": sum(1 for _, adapter in lora.adapters(chunks) if adapter.expert is not None),
        "router_adapters": sum(1 for _, adapter in lora.adapters(chunks) if adapter.replicated),
    }
    if stepped is not None:
        result["checkpoint"] = stepped
    if saved is not None:
        theirs, mine_saved = load_file(folder / peft_io.WEIGHTS_FILE), load_file(saved / peft_io.WEIGHTS_FILE)
        result["saved_names_mismatch"] = len(set(theirs) ^ set(mine_saved))
        result["saved"] = max(float((mine_saved[k] - theirs[k]).abs().max()) for k in mine_saved)
        config = json.loads((saved / peft_io.CONFIG_FILE).read_text())
        result["saved_target_parameters"] = int(sorted(config["target_parameters"]) == sorted(EXPERT_PARAMETERS))
    return result


def layout_checkpoint(name: str, family: str, chunks, workdir: Path) -> float | None:
    """EP2 Qwen2-MoE: one Adam step, then the checkpoint (model and Adam state) and the PEFT adapter after it. TP2
    Qwen2-MoE: the largest difference between the adapters loaded from that checkpoint and the saved PEFT ones."""
    from safetensors.torch import load_file

    if family != "qwen2_moe":
        return None
    folder = workdir / "checkpoint-moe"
    if name == "ep2":
        opt, _ = optimizer.build_optimizer(chunks, optimizer.OptimizerConfig(lr=1e-2, weight_decay=0.0))
        optimizer.train_step(chunks, opt, None, my_batches(make_micro_batches()), policy_loss, REQUEST)
        checkpoint.save_checkpoint(folder, 1, chunks, opt)
        peft_io.save_adapter(chunks, workdir / "after-step-moe")
        return None
    # the model alone: megatron chains an expert optimizer beside the dense one at EP > 1 only, so Adam's state
    # resumes at layouts of the same expert parallelism (tests/parallel/test_moe_parallel.py)
    checkpoint.load_checkpoint(folder, chunks)
    expected = load_file(workdir / "after-step-moe" / peft_io.WEIGHTS_FILE)
    loaded = dict(peft_io.iter_adapter_weights(chunks))
    assert set(loaded) == set(expected)
    return max(float((loaded[k] - expected[k]).abs().max()) for k in loaded)


def main() -> None:
    run_launch(lambda workdir: {f"{name}-{family}": run_phase(name, family, layout, workdir)
                                for name, family, layout in PHASES})


if __name__ == "__main__":
    main()
