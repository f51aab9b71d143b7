"""The fused output layer against the unfused one on whole models, run under torchrun at TP2 and PP2.

    torchrun --nproc-per-node 2 tests/parallel/fused_output_worker.py --out DIR/fused.json

For a tiny Llama with tied and with untied embeddings, and a tiny Gemma 2 (final logit soft-cap), both
passes of ``meshrl.parallel.schedule`` (forward-only outputs; forward + backward: loss and every parameter's
gradient) run unfused and fused (chunks of 4 tokens, so every micro-batch spans several), packed with
response-only outputs (the workers' layout) and in rows with every position, at T = 0.7. Rank 0 writes
the measurements (the max over ranks: each PP stage compares its own parameters) per layout.
``test_fused_output_multiproc.py`` launches it and asserts the bounds; ``test_fused_output.py`` runs
:func:`compare` at TP1 in its own process.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from meshrl.models.tiny import TinySpec, tiny_model_dir, tiny_spec  # noqa: E402
from meshrl.parallel import hf_conversion, model_builder, schedule, state  # noqa: E402
from meshrl.parallel.forward import OutputRequest  # noqa: E402

MODELS = {"llama_tied": TinySpec(tie_word_embeddings=True), "llama_untied": TinySpec(tie_word_embeddings=False),
          "gemma2_softcap": tiny_spec("gemma2")}
LAYOUTS = {"tp2": dict(tensor_parallel=2), "pp2": dict(pipeline_parallel=2)}
CHUNK = 4
TEMPERATURE = 0.7


def micro_batches() -> list[dict]:
    """Two micro-batches with left padding, a hole and right padding; loss and outputs on each row's tail."""
    g = torch.Generator().manual_seed(3)
    batches = []
    for rows, width in ((3, 12), (2, 9)):
        mask = torch.ones(rows, width, dtype=torch.long)
        mask[0, :3] = 0
        mask[-1, width - 2:] = 0
        mask[1, 4:6] = 0
        batches.append({"input_ids": torch.randint(0, 49152, (rows, width), generator=g), "attention_mask": mask,
                        "adv": torch.randn(rows, width, generator=g),
                        "loss_mask": (mask * (torch.arange(width) >= 5)).float()})
    total = sum(float(mb["loss_mask"].sum()) for mb in batches)
    return [{**mb, "n_tokens": total} for mb in batches]


def loss_fn(outputs: dict, mb: dict):
    m = mb["loss_mask"]
    return ((outputs["log_probs"] * mb["adv"] + 0.1 * outputs["entropy"]) * m).sum() / mb["n_tokens"], {}


def compare(path: Path) -> dict:
    """Fused vs unfused passes of the model at ``path`` (module docstring). Returns ``outputs`` (max
    |difference| over log-probs, entropy and Σπ², divided by max(1, their scale)), ``loss`` (|difference|),
    ``grads`` (max |difference| over every parameter's gradient) and ``grad_scale`` (their max |value|),
    ``head_grad`` (the scale of the fused pass's output-weight gradient on a last stage, 1 elsewhere: it
    must not be 0), ``squares`` (the largest Σπ² of the unfused pass: it must not be 0)."""
    from transformers import AutoConfig

    # fp32 wherever it runs (a GPU's default is bf16): the bounds are fp32 rounding's.
    chunks = model_builder.build_model(AutoConfig.from_pretrained(path), dtype=torch.float32)
    hf_conversion.load_hf_weights(chunks, path)
    batches = micro_batches()
    result = {"outputs": 0.0, "loss": 0.0, "grads": 0.0, "grad_scale": 0.0, "head_grad": 1.0, "squares": 0.0}
    for remove_padding, selected in ((True, True), (False, False)):
        mbs = [{**mb, "output_mask": mb["loss_mask"]} if selected else mb for mb in batches]
        runs = []
        for chunk_size in (None, CHUNK):
            request = OutputRequest(entropy=True, temperature=TEMPERATURE, remove_padding=remove_padding,
                                    fused_chunk_size=chunk_size)
            # forward-only, as the old-log-prob pass asks for it: Σπ² too (verl's calculate_sum_pi_squared)
            outputs = schedule.forward_only(chunks, mbs, dataclasses.replace(request, sum_pi_squared=True))
            for model in chunks:
                model.zero_grad_buffer()
            loss = schedule.forward_backward(chunks, mbs, loss_fn, request).loss
            runs.append((outputs, loss, {n: p.main_grad.clone() for n, p in chunks[0].named_parameters()}))
        (out_a, loss_a, grads_a), (out_b, loss_b, grads_b) = runs
        for a, b in zip(out_a, out_b):
            result["squares"] = max(result["squares"], float(a["sum_pi_squared"].max()))
            for key in ("log_probs", "entropy", "sum_pi_squared"):
                scale = max(1.0, float(a[key].abs().max()))
                result["outputs"] = max(result["outputs"], float((a[key] - b[key]).abs().max()) / scale)
        result["loss"] = max(result["loss"], abs(loss_a - loss_b))
        assert set(grads_a) == set(grads_b)
        result["grads"] = max(result["grads"], *(float((grads_b[n] - grads_a[n]).abs().max()) for n in grads_a))
        result["grad_scale"] = max(result["grad_scale"], *(float(grads_a[n].abs().max()) for n in grads_a))
        model = model_builder.unwrap(chunks[0])
        if model.post_process:
            head = "output_layer.weight" if not model.share_embeddings_and_output_weights or not model.pre_process \
                else "embedding.word_embeddings.weight"
            result["head_grad"] = min(result["head_grad"], float(grads_b[f"module.{head}"].abs().max()))
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    paths = {name: Path(tiny_model_dir(spec)) for name, spec in MODELS.items()}
    results: dict[str, dict] = {}
    for layout, parallel in LAYOUTS.items():
        state.initialize(state.ParallelConfig(timeout_s=120.0, **parallel))
        mine = {name: compare(path) for name, path in paths.items()}
        state.destroy()
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        results[layout] = {name: {key: (min if key == "head_grad" else max)(rank[name][key] for rank in gathered)
                                  for key in mine[name]} for name in mine}
    if dist.get_rank() == 0:
        args.out.write_text(json.dumps(results, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
