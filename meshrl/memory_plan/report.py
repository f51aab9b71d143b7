"""``meshrl plan``: the command, and the report it prints."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence

from meshrl.memory_plan.estimate import MemoryPlan, estimate
from meshrl.memory_plan.units import GIB, PlanError, flops_text, gib

# Row order of the report's memory table.
ROWS = ("actor params", "actor grads", "actor optimizer", "actor activations", "actor logits", "ref params",
        "critic params", "critic grads", "critic optimizer", "critic activations", "reward model params",
        "reward model activations", "forward activations", "forward logits", "vLLM weights", "vLLM activations",
        "vLLM KV cache", "runtime overhead")




def render(result: MemoryPlan, recipe: str | None) -> str:
    """The human-readable report: header, per-phase memory table, rollout KV, FLOPs, verdict."""
    m, lay, ro = result.model, result.layout, result.rollout
    unit = "GiB per GPU" if lay["device"] == "cuda" else f"GiB per training process (CPU, {lay['actor_dtype']})"
    flags = [f"TP {lay['tp']} x PP {lay['pp']}" + (f" (VPP {lay['vpp']})" if lay["vpp"] > 1 else "")
             + (f" x CP {lay['cp']}" if lay["cp"] > 1 else "") + f" -> DP {lay['dp']}"]
    flags.append("distributed optimizer" if lay["distributed_optimizer"] else "optimizer replicated over DP")
    flags.append("recompute" if lay["recompute"] else "no recompute")
    if lay["sequence_parallel"]:
        flags.append("sequence parallel")
    if lay["lora"]:
        flags.append(f"LoRA rank {lay['lora']['rank']} ({lay['lora']['trained_parameters'] / 1e6:.1f} M trained, "
                     "base frozen, reference = adapters off)")
    offloads = [k for k, v in lay["offload"].items() if v]
    if offloads:
        flags.append("offload: " + ", ".join(offloads))
    active = f" ({m['active_parameters'] / 1e9:.2f} B active)" if lay["experts"] else ""
    lines = [
        f"meshrl plan{': ' + recipe if recipe else ''}",
        f"  model    {m['path']} ({m['model_type']}, {m['parameters'] / 1e9:.2f} B parameters{active}, "
        f"{m['num_layers']} layers, hidden {m['hidden_size']}, heads {m['num_attention_heads']}/"
        f"{m['num_kv_heads']} KV, vocab {m['vocab_size']})",
        f"  cluster  {lay['nnodes']} node(s) x {lay['gpus_per_node']} = {lay['world']} "
        f"{'GPUs' if lay['device'] == 'cuda' else 'processes'}, limit {gib(result.limit_bytes)} GiB each",
        f"  actor    {'; '.join(flags)}; {lay['train_tokens_per_micro_batch']} tokens per micro-batch"
        f" ({lay['log_prob_tokens_per_micro_batch']} for log-probs); "
        + (f"fused output layer, {lay['fused_output_chunk']}-token chunks" if lay["fused_output_chunk"]
           else "unfused logits"),
    ]
    if lay["experts"]:
        x = lay["experts"]
        lines.append(f"  experts  {x['routed']} routed per layer, top-{x['topk']}; EP {x['ep']} x expert TP "
                     f"{x['etp']}: "
                     f"{x['per_rank']} per rank, {gib(x['bytes_per_gpu'])} GiB of expert weights per "
                     f"{'GPU' if lay['device'] == 'cuda' else 'process'}; all-to-all "
                     f"{gib(x['all_to_all_bytes_per_gpu_per_step'])} GiB sent per "
                     f"{'GPU' if lay['device'] == 'cuda' else 'process'} per step (full-length upper bound)")
    if lay["host_offload_bytes_per_node"]:
        lines.append(f"  host     {gib(lay['host_offload_bytes_per_node'])} GiB per node for offloaded state")
    if lay["critic"]:
        c = lay["critic"]
        lines.append(f"  critic   TP {c['tp']} x PP {c['pp']}" + (f" x CP {c['cp']}" if c["cp"] > 1 else "")
                     + f" -> DP {c['dp']}; "
                     f"{c['tokens_per_micro_batch']} tokens per micro-batch")
    if lay["reward_model"]:
        r = lay["reward_model"]
        lines.append(f"  reward   {r['path']} ({r['parameters'] / 1e9:.2f} B), TP {r['tp']} x PP {r['pp']} -> DP "
                     f"{r['dp']}; {r['tokens_per_micro_batch']} tokens per micro-batch")
    lines.append(f"  rollout  vLLM TP {ro['tp']}; budget {gib(ro['budget_bytes'])} GiB = weights "
                 f"{gib(ro['weights_bytes'])} + activations {gib(ro['activation_bytes'])} + KV cache "
                 f"{gib(max(ro['kv_cache_bytes'], 0))} ({ro['kv_capacity_tokens']:,} tokens = "
                 f"{ro['full_length_sequences']:,} sequences of {ro['max_model_len']})")
    st = result.stage
    if st["actor_pp"] > 1 or (st["critic_pp"] or 1) > 1:
        critic_stage = f", critic stage {st['critic']}/{st['critic_pp']}" if st["critic_pp"] else ""
        lines.append(f"  fullest GPU: policy stage {st['actor']}/{st['actor_pp']}{critic_stage} (stages count from 0)")
    names = [p.name for p in result.phases]
    present = {k for p in result.phases for k in p.items}
    rows = [r for r in ROWS if r in present]
    width = max(len(r) + 2 for r in rows + ["total"])
    col = max(len(n) for n in names) + 2
    lines += ["", f"memory, {unit}:", " " * width + "".join(f"{n:>{col}}" for n in names)]
    for row in rows:
        cells = [p.items.get(row) for p in result.phases]
        lines.append(f"  {row:<{width - 2}}" + "".join(f"{gib(c) if c else '-':>{col}}" for c in cells))
    lines.append(f"  {'total':<{width - 2}}" + "".join(f"{gib(p.total):>{col}}" for p in result.phases))
    f = result.flops
    parts = [f"{k.replace('_', ' ')} {flops_text(v)}" for k, v in f.items() if k not in ("total", "per_gpu") and v]
    lines += ["", f"step FLOPs (full-length upper bound): {flops_text(f['total'])} = {', '.join(parts)};"
                  f" {flops_text(f['per_gpu'])} per {'GPU' if lay['device'] == 'cuda' else 'process'}"]
    peak = result.peak
    if result.fits:
        lines.append(f"fits: peak {gib(peak.total)} GiB ({peak.name}) of {gib(result.limit_bytes)} GiB")
    else:
        lines.append("does NOT fit:")
        lines += [f"  - {p}" for p in result.problems]
        lines.append("turn one of these knobs (biggest lever first):")
        lines += [f"  - {a}" for a in result.advice]
    return "\n".join(lines)


def default_memory_gib(cfg) -> float:
    """The memory limit of one training process without ``--gpu-memory-gib``: on CPU the processes of this node share
    this machine's memory (a CPU run is planned where it runs); on GPU an 80 GiB card (A100 / H100)."""
    if cfg.trainer.device != "cpu":
        return 80.0
    import psutil

    return psutil.virtual_memory().total / GIB / max(1, cfg.trainer.n_gpus_per_node)


def main(argv: Sequence[str] | None = None) -> int:
    """``meshrl plan RECIPE [key=value ...] [--gpu-memory-gib G] [--json]``; exit 0 fits, 1 refused, 2 invalid."""
    from meshrl.runtime import configure_environment

    configure_environment()
    from meshrl.config import ConfigError, load_config
    from meshrl.config.validate import validate_config

    parser = argparse.ArgumentParser(prog="meshrl plan", description="Estimate per-GPU memory and step FLOPs of "
                                     "a recipe's layout, and refuse one that cannot fit.")
    parser.add_argument("recipe", help="recipe name in recipes/ or a YAML path")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, as for meshrl train")
    parser.add_argument("--gpu-memory-gib", type=float, default=None,
                        help="memory of one GPU (default 80); with trainer.device=cpu, of one training process "
                             "(default: this machine's memory / trainer.n_gpus_per_node)")
    parser.add_argument("--json", action="store_true", help="print the estimate as JSON")
    args = parser.parse_intermixed_args(list(sys.argv[1:] if argv is None else argv))
    if args.gpu_memory_gib is not None and args.gpu_memory_gib <= 0:
        parser.error("--gpu-memory-gib must be > 0")
    try:
        cfg = load_config(args.overrides, recipe=args.recipe)
        validate_config(cfg)
        result = estimate(cfg, args.gpu_memory_gib if args.gpu_memory_gib is not None else default_memory_gib(cfg))
    except (ConfigError, PlanError) as exc:
        print(f"meshrl plan: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result.to_dict(), indent=1) if args.json else render(result, args.recipe))
    return 0 if result.fits else 1
