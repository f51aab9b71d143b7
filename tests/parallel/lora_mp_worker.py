"""LoRA at TP2 and PP2 against PEFT on the HF model, under torchrun (2 ranks); one launch, several phases.

    torchrun --nproc-per-node 2 tests/parallel/lora_mp_worker.py --workdir DIR --out DIR/lora.json

PEFT writes a random adapter (``init_lora_weights=False``: B != 0, so every adapter tensor has a gradient);
each phase loads it into meshrl's adapters at its layout, and records the largest differences from PEFT's
log-probs and adapter gradients (policy loss of ``mp_worker``), the adapter saved back from the layout
against PEFT's file, and the merged weights against PEFT's ``merge_and_unload``; ``tp2sp`` is the TP2 Llama
phase under megatron's sequence parallelism. The TP2 Llama phase then takes
an optimizer step and saves a distributed checkpoint (model and Adam state); the PP2 phase loads it and must hold
the adapters the TP2 phase saved in PEFT's format after its step. Rank 0 writes the results
(max over ranks) at the end; ``test_lora_multiproc.py`` asserts the bounds.
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from mp_worker import build, hf_model, hf_outputs, make_micro_batches, policy_loss  # noqa: E402

from meshrl.models.tiny import TinySpec, tiny_model_dir  # noqa: E402
from meshrl.parallel import checkpoint, lora, optimizer, peft_io, schedule, state  # noqa: E402
from meshrl.parallel.forward import OutputRequest  # noqa: E402

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MODELS = {"llama": TinySpec(), "qwen2": TinySpec(arch="qwen2", hidden_size=256, tie_word_embeddings=False)}
PHASES = [("tp2", "llama", dict(tensor_parallel=2), ALL), ("pp2", "llama", dict(pipeline_parallel=2), ALL),
          ("tp2", "qwen2", dict(tensor_parallel=2), ("q_proj", "v_proj", "gate_proj", "down_proj")),
          ("tp2sp", "llama", dict(tensor_parallel=2), ALL)]
# the model's own options per phase: tp2sp runs megatron's sequence parallelism
BUILD = {"tp2sp": dict(sequence_parallel=True)}
RANK, ALPHA = 4, 8
REQUEST = OutputRequest(entropy=True)


def peft_reference(path: Path, targets: tuple[str, ...], folder: Path) -> dict:
    """PEFT's random adapter saved in ``folder``; its log-probs, adapter gradients and merged weights."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    model = get_peft_model(hf_model(path, critic=False), LoraConfig(
        r=RANK, lora_alpha=ALPHA, target_modules=list(targets), init_lora_weights=False))
    batches = make_micro_batches()
    log_probs = []
    for mb in batches:
        out = hf_outputs(model, mb, critic=False)
        policy_loss(out, mb)[0].backward()
        log_probs.append(out["log_probs"].detach())
    grads = {name.replace(".default", ""): p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    if dist.get_rank() == 0:
        model.save_pretrained(folder)
    dist.barrier()
    merged = {name: p.detach().clone() for name, p in model.merge_and_unload().named_parameters()}
    return {"log_probs": log_probs, "grads": grads, "merged": merged}


def run_phase(name: str, family: str, layout: dict, targets: tuple[str, ...], workdir: Path) -> dict:
    from safetensors.torch import load_file
    from transformers import AutoConfig

    path = tiny_model_dir(MODELS[family])
    folder = workdir / f"peft-{family}"
    reference = peft_reference(path, targets, folder)
    state.initialize(state.ParallelConfig(**layout))
    try:
        chunks = lora.apply_lora(build(path, **BUILD.get(name, {})),
                                 lora.LoraSettings(rank=RANK, alpha=ALPHA, targets=targets))
        peft_io.load_adapter(chunks, folder)
        out = schedule.forward_only(chunks, make_micro_batches(), REQUEST)
        for chunk in chunks:
            chunk.zero_grad_buffer()
        schedule.forward_backward(chunks, make_micro_batches(), policy_loss, REQUEST)
        grads = dict(peft_io.iter_adapter_weights(chunks, grads=True))
        saved = peft_io.save_adapter(chunks, workdir / f"saved-{name}-{family}")
        merged = dict(peft_io.iter_merged_weights(chunks, AutoConfig.from_pretrained(path)))
        stepped = layout_checkpoint(name, family, chunks, workdir)
    finally:
        state.destroy()
    result = {
        "log_probs": max(float((o["log_probs"] - r).abs().max()) for o, r in zip(out, reference["log_probs"])),
        "grad_names_mismatch": len(set(grads) ^ set(reference["grads"])),
        "grads": max(float((grads[k] - reference["grads"][k]).abs().max()) for k in grads),
        "grad_scale": min(float(g.abs().max()) for g in reference["grads"].values()),
        "merged": max(float((t - reference["merged"][k]).abs().max()) for k, t in merged.items()),
    }
    if stepped is not None:
        result["checkpoint"] = stepped
    if saved is not None:
        theirs, mine = load_file(folder / peft_io.WEIGHTS_FILE), load_file(saved / peft_io.WEIGHTS_FILE)
        result["saved_names_mismatch"] = len(set(theirs) ^ set(mine))
        result["saved"] = max(float((mine[k] - theirs[k]).abs().max()) for k in mine)
    return result


def layout_checkpoint(name: str, family: str, chunks, workdir: Path) -> float | None:
    """TP2 Llama: one Adam step, then the checkpoint and the PEFT adapter after it. PP2 Llama: the largest
    difference between the adapters loaded from that checkpoint (with the optimizer) and the saved PEFT ones."""
    from safetensors.torch import load_file

    if family != "llama" or name not in ("tp2", "pp2"):
        return None
    opt, _ = optimizer.build_optimizer(chunks, optimizer.OptimizerConfig(lr=1e-2, weight_decay=0.0))
    folder = workdir / "checkpoint"
    if name == "tp2":
        optimizer.train_step(chunks, opt, None, make_micro_batches(), policy_loss, REQUEST)
        checkpoint.save_checkpoint(folder, 1, chunks, opt)
        peft_io.save_adapter(chunks, workdir / "after-step")
        return None
    checkpoint.load_checkpoint(folder, chunks, opt)
    expected = load_file(workdir / "after-step" / peft_io.WEIGHTS_FILE)
    loaded = dict(peft_io.iter_adapter_weights(chunks))
    assert set(loaded) == set(expected)
    return max(float((loaded[k] - expected[k]).abs().max()) for k in loaded)


def run_launch(run_phases) -> None:
    """One torchrun rank: ``run_phases(workdir)`` -> {phase: {key: number}}; rank 0 writes each number's max over
    the ranks to ``--out``."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--workdir", required=True, type=Path)
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    mine = run_phases(args.workdir)
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    if dist.get_rank() == 0:
        merged = {phase: {key: max(ranks[phase][key] for ranks in gathered if key in ranks[phase])
                          for key in set().union(*(ranks[phase] for ranks in gathered))} for phase in mine}
        args.out.write_text(json.dumps(merged, indent=1))
    dist.destroy_process_group()


def main() -> None:
    run_launch(lambda workdir: {f"{name}-{family}": run_phase(name, family, layout, targets, workdir)
                                for name, family, layout, targets in PHASES})


if __name__ == "__main__":
    main()
