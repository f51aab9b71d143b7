"""Colocated vLLM engines inside an existing torch.distributed world (gloo), one launch, several phases.

    python tests/rollout/colocated_worker.py --world 2 --port PORT --out DIR/result.json [--megatron]

Every rank first initialises a gloo world of ``--world`` ranks, as Megatron does in a training
worker, then:

- ``tp1``: creates an in-process engine (inference TP 1, replica = rank) and checks that it generates
  like HF, that ranks agree when their replica seeds agree and differ otherwise, that a weight sync
  works on every rank, and that the world's own collectives keep working;
- ``megatron_tp2`` / ``megatron_pp2`` (with ``--megatron``, world 2; ``megatron_tp2pp2`` with world
  4): builds the model with meshrl.parallel at that training layout, perturbs it, streams
  ``iter_hf_weights`` straight into each rank's TP-1 engine, and compares the engine's greedy tokens
  with an HF model holding the exported weights;
- ``tp2`` (world 2): shuts the TP-1 engines down (the world must survive), then builds one engine with
  inference TP 2 over both ranks (external launcher), syncs it and checks both ranks sample the same
  tokens.

Rank 0 writes every rank's measurements as JSON; tests/rollout/test_vllm_colocated.py asserts on them.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

PROMPTS = [[1, 9690, 198, 2683, 359], [5, 6, 7], list(range(300, 330))]
STEPS = 10


def hf_greedy(model, prompt: list[int]) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(STEPS):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def perturb(model, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.02 * torch.randn(param.shape, generator=generator))


def tokens(completions) -> list[list[int]]:
    return [c.token_ids for c in completions]


def gather(value):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def world_sum(value: float) -> float:
    tensor = torch.tensor([value])
    dist.all_reduce(tensor)
    return float(tensor)


def phase_tp1(model_dir: Path, results: dict):
    from transformers import AutoModelForCausalLM

    from meshrl.rollout import EngineConfig, SamplingConfig, create_engine

    rank = dist.get_rank()
    engine = create_engine(model_dir, EngineConfig(kv_cache_memory_bytes=128 << 20, max_model_len=256,
                                                   max_num_seqs=16))
    results["tp1.dp_rank"] = engine.dp_rank
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    greedy = SamplingConfig(temperature=0, max_response_length=STEPS, ignore_eos=True)
    results["tp1.greedy_matches_hf"] = tokens(engine.generate(PROMPTS, greedy)) == [hf_greedy(reference, p)
                                                                                  for p in PROMPTS]
    # Replica seed = seed + dp_rank: equal seeds on both ranks -> same replica seed -> same tokens.
    same_replica = tokens(engine.generate(PROMPTS, SamplingConfig(n=2, max_response_length=STEPS, seed=10 - rank)))
    other_replica = tokens(engine.generate(PROMPTS, SamplingConfig(n=2, max_response_length=STEPS, seed=10)))
    same, other = gather(same_replica), gather(other_replica)
    results["tp1.same_replica_seed_agrees"] = all(s == same[0] for s in same)
    results["tp1.other_replica_differs"] = other[0] != other[1]
    results["tp1.world_sum_after_generate"] = world_sum(rank + 1.0)

    perturb(reference, seed=3)
    stats = engine.load_weights(reference.named_parameters(), bucket_bytes=1 << 20)
    results["tp1.sync_buckets"] = stats.buckets
    results["tp1.greedy_matches_hf_after_sync"] = tokens(engine.generate(PROMPTS, greedy)) == [
        hf_greedy(reference, p) for p in PROMPTS]
    return engine


def phase_megatron(model_dir: Path, engine, results: dict, name: str, **layout) -> None:
    """Training layout ``layout`` -> iter_hf_weights -> this rank's TP-1 engine."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from meshrl.parallel import hf_conversion, model_builder, state
    from meshrl.rollout import SamplingConfig

    state.initialize(state.ParallelConfig(**layout))
    try:
        hf_config = AutoConfig.from_pretrained(model_dir)
        chunks = model_builder.build_model(hf_config)
        hf_conversion.load_hf_weights(chunks, model_dir)
        with torch.no_grad():
            for chunk in chunks:
                for index, (pname, param) in enumerate(chunk.named_parameters()):
                    # A different change on every TP shard, so a resharding slip would show; replicated
                    # tensors change alike on every TP rank, as an optimizer step keeps them.
                    split = getattr(param, "tensor_model_parallel", False)
                    seed = 1000 * index + (state.tp_rank() if split else 0) + 100_000 * state.pp_rank()
                    param.add_(0.02 * torch.randn(param.shape, generator=torch.Generator().manual_seed(seed)))
        exported = {n: t.clone() for n, t in hf_conversion.iter_hf_weights(chunks, hf_config)}
        stats = engine.load_weights(hf_conversion.iter_hf_weights(chunks, hf_config), bucket_bytes=1 << 20)
        reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        missing, unexpected = reference.load_state_dict(exported, strict=False)
        results[f"{name}.unexpected_names"] = list(unexpected)
        results[f"{name}.tensors"] = stats.tensors
        greedy = SamplingConfig(temperature=0, max_response_length=STEPS, ignore_eos=True)
        results[f"{name}.greedy_matches_exported"] = tokens(engine.generate(PROMPTS, greedy)) == [
            hf_greedy(reference, p) for p in PROMPTS]
        checksum = round(sum(float(t.double().sum()) for t in exported.values()), 6)
        results[f"{name}.ranks_agree_on_weights"] = len(set(gather(checksum))) == 1
    finally:
        state.destroy()


def phase_tp2(model_dir: Path, results: dict) -> None:
    from transformers import AutoModelForCausalLM

    from meshrl.rollout import EngineConfig, SamplingConfig, create_engine

    engine = create_engine(model_dir, EngineConfig(tensor_model_parallel_size=2, kv_cache_memory_bytes=128 << 20,
                                                   max_model_len=256, max_num_seqs=16))
    try:
        results["tp2.dp_rank"] = engine.dp_rank
        reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        perturb(reference, seed=4)
        engine.load_weights(reference.named_parameters(), bucket_bytes=1 << 20)
        greedy = SamplingConfig(temperature=0, max_response_length=STEPS, ignore_eos=True)
        results["tp2.greedy_matches_hf_after_sync"] = tokens(engine.generate(PROMPTS, greedy)) == [
            hf_greedy(reference, p) for p in PROMPTS]
        sampled = gather(tokens(engine.generate(PROMPTS, SamplingConfig(n=2, max_response_length=STEPS, seed=1))))
        results["tp2.ranks_sample_the_same"] = sampled[0] == sampled[1]
    finally:
        engine.shutdown()
    results["tp2.world_sum_after_shutdown"] = world_sum(dist.get_rank() + 1.0)


def run(rank: int, args: argparse.Namespace) -> None:
    from meshrl.runtime import configure_environment

    configure_environment()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=rank,
                            world_size=args.world, timeout=timedelta(seconds=120))
    from meshrl.models.tiny import TinySpec, tiny_model_dir

    model_dir = tiny_model_dir(TinySpec())
    results: dict = {}
    try:
        engine = phase_tp1(model_dir, results)
        if args.megatron and args.world == 2:
            phase_megatron(model_dir, engine, results, "megatron_tp2", tensor_parallel=2)
            phase_megatron(model_dir, engine, results, "megatron_pp2", pipeline_parallel=2)
        elif args.megatron and args.world == 4:
            phase_megatron(model_dir, engine, results, "megatron_tp2pp2", tensor_parallel=2, pipeline_parallel=2)
        engine.shutdown()
        results["tp1.world_alive_after_shutdown"] = dist.is_initialized()
        results["tp1.world_sum_after_shutdown"] = world_sum(rank + 1.0)
        if args.world == 2:
            phase_tp2(model_dir, results)
    except Exception:
        results["error"] = f"rank {rank}: {traceback.format_exc()}"
    everything = gather(results) if "error" not in results else [results]
    if rank == 0 or "error" in results:
        Path(args.out).with_suffix(f".rank{rank}.json").write_text(json.dumps(everything, indent=1))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--megatron", action="store_true")
    args = parser.parse_args()
    import torch.multiprocessing as mp

    mp.spawn(run, args=(args,), nprocs=args.world, join=True)


if __name__ == "__main__":
    main()
