"""LoRA on a mixture-of-experts policy on one CUDA device (issue 37): meshrl's adapters on the attention and every
routed expert against PEFT's on the same random weights, then the update's speed and memory with LoRA against full
fine-tuning.

The model is Qwen3-30B-A3B's layer shape (hidden 2048, 32 query / 4 KV heads of 128, 128 experts of width 768, top-8,
normalised top-k weights) with ``--layers`` layers and a 32k vocabulary, randomly initialised (std 0.02, as published
inits), written once as an HF folder. One process, world size 1 (NCCL), TP1 / EP1: megatron's expert layer on CUDA.

- ``parity`` (fp32, TF32 off): PEFT's random adapter (``init_lora_weights=False``: B != 0) with
  ``target_modules=[q,k,v,o]_proj`` and ``target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]``
  on the transformers model, loaded into meshrl's adapters (``experts=True``): the largest differences of per-token
  log-probs and of every adapter gradient of the policy-gradient loss ``sum(logp * adv) / tokens``, each beside the
  largest reference value.
- ``update`` (bf16, megatron's mixed precision, Adam): ``--rows`` x ``--seq`` tokens in micro-batches of
  ``--micro-rows`` rows, one warm-up update then ``--repeats`` timed ones (CUDA-synchronised), for full fine-tuning
  and for LoRA (rank ``--rank`` on the same targets; ``lora_per_part``: the adapters computing each part's delta
  apart and adding it, as before the one-``addmm`` path): tokens/s, the forward/backward passes' share, trained
  parameters, memory allocated and its peak once built (the model, adapters, optimizer) and over the updates.

    python -m bench.gpu_moe_lora --out DIR [--layers 2 --rows 16 --seq 1024 --micro-rows 4 --repeats 3 --rank 32]
    python -m bench.gpu_moe_lora --out /tmp/x --device cpu --shape tiny --rows 4 --seq 64 --repeats 1  # a CPU try

Needs megatron-core, omegaconf and peft (carried as wheels to the GPU machines). Writes DIR/gpu_moe_lora.json and
DIR/gpu_moe_lora.png, and prints a summary.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

SHAPE = dict(hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
             num_experts_per_tok=8, moe_intermediate_size=768, intermediate_size=6144, norm_topk_prob=True,
             vocab_size=32768, tie_word_embeddings=False, rope_theta=1e6, rms_norm_eps=1e-6,
             max_position_embeddings=4096, decoder_sparse_step=1, mlp_only_layers=[])
# ``--shape tiny``: the same code on a few-MiB model, to try the script on a CPU (``--device cpu``) before a GPU run
TINY = {**SHAPE, **dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8,
                        num_experts_per_tok=2, moe_intermediate_size=64, intermediate_size=256, vocab_size=1024)}
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
EXPERT_PARAMETERS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def model_dir(args) -> Path:
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    target = Path(args.work) / f"qwen3-moe-{args.shape}-{args.layers}l-random"
    if (target / "config.json").is_file():
        return target
    torch.manual_seed(0)
    shape = TINY if args.shape == "tiny" else SHAPE
    with torch.device(args.device):
        model = AutoModelForCausalLM.from_config(Qwen3MoeConfig(num_hidden_layers=args.layers, **shape),
                                                 dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:
                param.normal_(0.0, 0.02)
    model.save_pretrained(target, safe_serialization=True)
    return target


def micro_batches(args, vocab: int, rows: int, seq: int, seed: int) -> list[dict]:
    """Full rows (no padding), a loss on every token but each row's first, random advantages."""
    g = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(rows // args.micro_rows):
        ids = torch.randint(0, vocab, (args.micro_rows, seq), generator=g)
        mask = torch.ones(args.micro_rows, seq)
        mask[:, 0] = 0
        batches.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": mask,
                        "adv": torch.randn(args.micro_rows, seq, generator=g)})
    total = float(sum(mb["loss_mask"].sum() for mb in batches))
    for mb in batches:
        mb["n_global"] = total
    return batches


def policy_loss(outputs: dict, mb: dict):
    m = mb["loss_mask"]
    return (outputs["log_probs"] * mb["adv"] * m).sum() / mb["n_global"], {"tokens": m.sum()}


def section_parity(args, path: Path) -> dict:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from meshrl.parallel import lora, peft_io, schedule, state
    from meshrl.parallel.forward import OutputRequest
    from meshrl.parallel.hf_conversion import load_hf_weights
    from meshrl.parallel.model_builder import build_model

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    hf_config = AutoConfig.from_pretrained(path)
    batches = micro_batches(args, hf_config.vocab_size, 4, 256, seed=1)
    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(args.device), LoraConfig(
        r=args.rank, lora_alpha=2 * args.rank, target_modules=ATTENTION, target_parameters=EXPERT_PARAMETERS,
        init_lora_weights=False))
    reference = []
    for mb in batches:
        ids = mb["input_ids"].to(args.device)
        logp = torch.log_softmax(model(input_ids=ids).logits[:, :-1].float(), -1)
        lp = torch.zeros(ids.shape, device=args.device)
        lp[:, 1:] = logp.gather(-1, ids[:, 1:, None])[..., 0]
        policy_loss({"log_probs": lp}, {k: v.to(args.device) if torch.is_tensor(v) else v
                                        for k, v in mb.items()})[0].backward()
        reference.append(lp.detach().cpu())
    grads = {n.replace(".default", ""): p.grad.cpu() for n, p in model.named_parameters() if p.grad is not None}
    folder = Path(args.work) / "peft-adapter"
    model.save_pretrained(folder)
    del model, logp
    empty_cache(args)

    state.initialize(state.ParallelConfig())
    chunks = build_model(hf_config, dtype=torch.float32)
    load_hf_weights(chunks, path, hf_config)
    chunks = lora.apply_lora(chunks, lora.LoraSettings(rank=args.rank, alpha=2 * args.rank,
                                                       targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                                "up_proj", "down_proj"), experts=True))
    peft_io.load_adapter(chunks, folder)
    request = OutputRequest()
    out = schedule.forward_only(chunks, batches, request)
    for chunk in chunks:
        chunk.zero_grad_buffer()
    schedule.forward_backward(chunks, batches, policy_loss, request)
    mine = {k: v.cpu() for k, v in peft_io.iter_adapter_weights(chunks, grads=True)}
    experts = sum(1 for _, adapter in lora.adapters(chunks) if adapter.expert is not None)
    state.destroy()
    del chunks
    empty_cache(args)
    expert_keys = [k for k in grads if ".mlp.experts." in k]
    return {
        "log_prob_max_abs_diff": max(float((o["log_probs"].cpu() - r)[:, 1:].abs().max())
                                     for o, r in zip(out, reference)),
        "log_prob_max_abs": max(float(r.abs().max()) for r in reference),
        "grad_names_mismatch": len(set(mine) ^ set(grads)),
        "grad_max_abs_diff": max(float((mine[k] - grads[k]).abs().max()) for k in grads),
        "expert_grad_max_abs_diff": max(float((mine[k] - grads[k]).abs().max()) for k in expert_keys),
        "grad_max_abs": max(float(g.abs().max()) for g in grads.values()),
        "expert_adapters": experts, "tokens": sum(int(mb["loss_mask"].sum()) for mb in batches),
    }


def section_update(args, path: Path, use_lora: bool) -> dict:
    from transformers import AutoConfig

    from meshrl.parallel import lora, optimizer, schedule, state
    from meshrl.parallel.forward import OutputRequest
    from meshrl.parallel.hf_conversion import load_hf_weights
    from meshrl.parallel.model_builder import build_model

    hf_config = AutoConfig.from_pretrained(path)
    state.initialize(state.ParallelConfig())
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    chunks = build_model(hf_config, dtype=torch.bfloat16)
    load_hf_weights(chunks, path, hf_config)
    if use_lora:
        chunks = lora.apply_lora(chunks, lora.LoraSettings(rank=args.rank, alpha=2 * args.rank, targets=(
            "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"), experts=True))
    opt, _ = optimizer.build_optimizer(chunks, optimizer.OptimizerConfig(lr=1e-5, weight_decay=0.0))
    trained = sum(p.numel() for chunk in chunks for p in chunk.parameters() if p.requires_grad)
    built = memory(args)  # (held, peak) after the model, its adapters and the optimizer are built
    batches = micro_batches(args, hf_config.vocab_size, args.rows, args.seq, seed=2)
    seconds, losses = [], []
    for _ in range(args.repeats + 1):
        synchronize(args)
        start = time.perf_counter()
        result = optimizer.train_step(chunks, opt, None, batches, policy_loss, OutputRequest())
        synchronize(args)
        seconds.append(time.perf_counter() - start)
        losses.append(float(result["loss"]))
    updates = memory(args)
    for chunk in chunks:  # the forward/backward passes alone, without the optimizer's step
        chunk.zero_grad_buffer()
    synchronize(args)
    start = time.perf_counter()
    schedule.forward_backward(chunks, batches, policy_loss, OutputRequest())
    synchronize(args)
    passes_s = time.perf_counter() - start
    state.destroy()
    del chunks, opt
    empty_cache(args)
    timed = seconds[1:]
    return {"trained_parameters": trained, "first_s": seconds[0], "seconds": timed, "passes_s": passes_s,
            "tokens_per_s": args.rows * args.seq / statistics.median(timed), "built_held_gib": built[0],
            "built_peak_gib": built[1], "held_gib": updates[0], "peak_memory_gib": updates[1], "losses": losses}


def memory(args) -> tuple[float, float]:
    """(GiB allocated now, peak GiB since the last call), the peak counter reset."""
    if args.device != "cuda":
        return float("nan"), float("nan")
    held, peak = torch.cuda.memory_allocated() / 2**30, torch.cuda.max_memory_allocated() / 2**30
    torch.cuda.reset_peak_memory_stats()
    return held, peak


def synchronize(args) -> None:
    if args.device == "cuda":
        torch.cuda.synchronize()


def empty_cache(args) -> None:
    if args.device == "cuda":
        torch.cuda.empty_cache()


def plot(result: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in ("full", "lora", "lora_per_part") if result.get(n, {}).get("ok")]
    if not names:
        return
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.2))
    axes[0].bar(names, [result[n]["tokens_per_s"] for n in names], color=["#888", "#3a7", "#7a3"][:len(names)])
    axes[0].set_title("update tokens/s (bf16)")
    axes[1].bar(names, [result[n]["peak_memory_gib"] for n in names], color=["#888", "#3a7", "#7a3"][:len(names)])
    axes[1].set_title("peak memory over the updates (GiB)")
    fig.suptitle(f"Qwen3-MoE ({result['shape']} layer shape) x {result['layers']} layers, {result['device']}",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def run_section(args) -> None:
    """Each section in a fresh process: its memory figures count its own tensors only."""
    path = model_dir(args)
    try:
        if args.section == "lora_per_part":  # the adapters' earlier path, for the comparison: per-part deltas
            from meshrl.parallel.lora import LoraAdapter

            LoraAdapter.added_to = lambda self, out, x: out + self.delta(x)
        section = section_parity(args, path) if args.section == "parity" else \
            section_update(args, path, args.section != "full")
        result = {"ok": True, **section}
    except Exception as error:  # recorded, so that one failing section does not hide the others
        import traceback

        result = {"ok": False, "error": repr(error), "traceback": traceback.format_exc()[-3000:]}
        print(result["traceback"], flush=True)
    Path(args.section_out).write_text(json.dumps(result, indent=1, default=str))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--work", default="/tmp/meshrl-gpu-moe-lora")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--micro-rows", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sections", default="parity,full,lora")
    parser.add_argument("--shape", choices=("qwen3-30b-a3b", "tiny"), default="qwen3-30b-a3b")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--section", help=argparse.SUPPRESS)
    parser.add_argument("--section-out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench.gpu_moe_lora needs a CUDA device (--device cpu --shape tiny tries it on a CPU)")
    from meshrl.runtime import configure_environment

    configure_environment()
    if args.section:  # one section in this process (the driver below starts one process per section)
        run_section(args)
        return
    Path(args.work).mkdir(parents=True, exist_ok=True)
    model_dir(args)  # written once, before the sections read it
    result: dict = {"command": "python -m bench.gpu_moe_lora " + " ".join(sys.argv[1:]), "layers": args.layers,
                    "shape": args.shape, "torch": torch.__version__,
                    "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu"}
    for name in args.sections.split(","):
        out = Path(args.work) / f"{name}.json"
        out.unlink(missing_ok=True)
        start = time.perf_counter()
        child = subprocess.run([sys.executable, "-m", "bench.gpu_moe_lora", *sys.argv[1:], "--section", name,
                                "--section-out", str(out)], cwd=Path(__file__).resolve().parents[1])
        result[name] = (json.loads(out.read_text()) if out.is_file()
                        else {"ok": False, "error": f"exit {child.returncode}"})
        result[name]["wall_s"] = time.perf_counter() - start
        print(f"[gpu_moe_lora] {name}: {json.dumps({k: v for k, v in result[name].items() if k != 'traceback'})}",
              flush=True)
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "gpu_moe_lora.json").write_text(json.dumps(result, indent=1, default=str))
    plot(result, Path(args.out) / "gpu_moe_lora.png")
    if result.get("full", {}).get("ok") and result.get("lora", {}).get("ok"):
        print(f"LoRA / full: tokens/s {result['lora']['tokens_per_s'] / result['full']['tokens_per_s']:.2f}x, "
              f"peak memory {result['lora']['peak_memory_gib'] / result['full']['peak_memory_gib']:.2f}x")


if __name__ == "__main__":
    main()
