"""GPU checks and figures on one CUDA device (issues 7 and 9): meshrl's real code on a random model of a
real shape (default Qwen2.5-1.5B), since no checkpoint can reach the GPU machines.

Sections, each in its own process (each starts torch.distributed / megatron state afresh), results merged
into one JSON:

- ``machine``: device, versions, Transformer Engine present or not; measured bf16 matmul FLOP/s
  (8192³ ``torch.mm``, median of 10 CUDA-event-timed products on random data) and device copy bandwidth.
- ``parity``: the Megatron policy (TP1, NCCL, no CPU compatibility layer) against HF transformers on the
  same weights, fp32 with TF32 off: per-token log-probs and entropy, max |diff|; then the same in bf16.
- ``rl_step``: ``ActorRolloutRefWorker`` (the trainer's worker, in-process, no Ray) with the transformers
  (``hf``) rollout engine, bf16, GRPO, ``--prompts`` × ``--n`` responses of exactly ``--response``
  tokens (``ignore_eos``: a random model's EOS would make lengths arbitrary): per-phase wall time
  (generate, old log-probs, update, weight sync) over ``--steps`` steps after one warm-up step, and the
  update's MFU. Micro-batches are packed THD rows (``use_remove_padding``, the default);
  ``rl_step_padded`` runs the same with padded rows (``use_remove_padding=False``).
- ``update_mfu``: the worker's actor update alone on synthetic batches of longer sequences (token-budget
  micro-batches), MFU = model FLOPs / time / FLOP/s, peak device memory; with the defaults (the fused output
  layer, ``model.use_fused_kernels=True``, eager layers). ``update_unfused`` runs the same with
  ``use_fused_kernels=False`` (the ``[response tokens, V]`` fp32 logits of each micro-batch exist, and are kept
  for backward), ``update_chunk4096`` with the fused layer's chunks of 4096 tokens instead of 512, and
  ``update_compiled`` with ``actor.use_torch_compile=True`` (norms, SwiGLU and rotary through inductor's Triton
  kernels): issue 24's before/after, each in its own process. Each records its first update's
  wall time (allocator warm-up, and the compilation where there is one) and that update's loss and grad norm
  (the same weights and batch in every variant, so they must agree to bf16 rounding).
- ``offload``: the policy's parameters, gradients and optimizer state to host memory and back: device
  memory freed, values bit-identical after the restore.
- ``profile``: one forward and one forward+backward of a micro-batch through the Megatron policy under
  ``torch.profiler`` (the kernels that take the time), beside the same forward of the HF model.
- ``checkpoint``: a distributed checkpoint (model, optimizer, scheduler) saved and loaded on CUDA;
  the loaded weights equal the saved ones.

MFU: model FLOPs (``bench.machine.transformer_flops``, PaLM's convention: 6·N + 12·layers·hidden·S per
trained token, N every stored parameter, the tied embedding once) divided by time and by (a) the matmul
rate measured in ``machine`` and (b) the datasheet's dense bf16 peak (989.4 TFLOP/s for an H100 SXM
and an H200).

    python -m bench.gpu --out DIR [--sections ...] [--prompts 32 --n 4 --prompt-len 128 --response 512]

Needs megatron-core and omegaconf beside torch and transformers (carried as wheels to the GPU machines).
Writes DIR/gpu.json and prints a summary table last.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

SECTIONS = ("machine", "parity", "rl_step", "rl_step_padded", "update_mfu", "update_unfused", "update_chunk4096",
            "update_compiled", "offload", "checkpoint", "profile")
# The update sections (module docstring): each variant's plot label and config overrides.
UPDATE_VARIANTS = {
    "update_mfu": ("fused output (default)", ()),
    "update_unfused": ("unfused output", ("actor_rollout_ref.model.use_fused_kernels=False",)),
    "update_chunk4096": ("fused, 4096-token chunks", ("actor_rollout_ref.model.fused_kernel_options.chunk_size=4096",)),
    "update_compiled": ("fused + compiled", ("actor_rollout_ref.actor.use_torch_compile=True",)),
}
DATASHEET_BF16_FLOPS = {"H100": 989.4e12, "H200": 989.4e12}
# Qwen2.5-1.5B's published config (shapes only; weights are random here).
QWEN25_1_5B = dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                   num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True, rope_theta=1e6,
                   rms_norm_eps=1e-6, max_position_embeddings=32768, eos_token_id=151645, bos_token_id=151643)


def cuda_timed(fn, repeats: int = 1) -> list[float]:
    """Seconds of each of ``repeats`` calls of ``fn``, synchronised before and after each."""
    out = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - start)
    return out


def datasheet_peak() -> float | None:
    name = torch.cuda.get_device_name()
    return next((v for k, v in DATASHEET_BF16_FLOPS.items() if k in name), None)


# ------------------------------------------------------------------------------------------- sections
def section_machine(args) -> dict:
    import megatron.core
    import transformers

    from meshrl.parallel.model_builder import transformer_engine_available

    n = 8192
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        torch.mm(a, b)
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.mm(a, b)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    src = torch.randn(1 << 30, device="cuda", dtype=torch.float32)  # 4 GiB
    dst = torch.empty_like(src)
    dst.copy_(src)
    copy_s = statistics.median(cuda_timed(lambda: dst.copy_(src), 5))
    props = torch.cuda.get_device_properties(0)
    return {"device": torch.cuda.get_device_name(), "memory_gib": props.total_memory / 2**30,
            "multiprocessors": props.multi_processor_count, "torch": torch.__version__,
            "cuda": torch.version.cuda, "transformers": transformers.__version__,
            "megatron_core": megatron.core.__version__, "transformer_engine": transformer_engine_available(),
            "torch_varlen_attention": importlib.util.find_spec("torch.nn.attention.varlen") is not None,
            "matmul_bf16_flops": 2 * n**3 / statistics.median(times),
            "copy_bytes_per_s": 2 * src.numel() * 4 / copy_s, "datasheet_bf16_flops": datasheet_peak()}


def random_model_dir(args) -> Path:
    """A randomly initialised HF model of the chosen shape (bf16 safetensors), built once per machine."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    target = Path(args.work) / "qwen2.5-1.5b-random"
    if (target / "config.json").is_file():
        return target
    config = Qwen2Config(use_sliding_window=False, **QWEN25_1_5B)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():  # the published init scale (std 0.02), so logits look like a real model's
        for name, param in model.named_parameters():
            if param.dim() >= 2:
                param.normal_(0.0, 0.02)
            elif name.endswith("bias"):
                param.normal_(0.0, 0.02)
    model.generation_config.eos_token_id = config.eos_token_id
    tmp = target.with_name(target.name + ".tmp")
    model.save_pretrained(tmp, safe_serialization=True)
    if args.tokenizer:  # the worker reads pad/eos ids from a tokenizer; any will do for random token ids
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(args.tokenizer).save_pretrained(tmp)
    os.replace(tmp, target)
    return target


def section_parity(args) -> dict:
    """Megatron (TP1, CUDA) vs HF per-token log-probs and entropy on one random batch."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from meshrl.parallel import state
    from meshrl.parallel.forward import OutputRequest
    from meshrl.parallel.hf_conversion import load_hf_weights
    from meshrl.parallel.model_builder import build_forward_only_model
    from meshrl.parallel.schedule import forward_only

    model_dir = random_model_dir(args)
    hf_config = AutoConfig.from_pretrained(model_dir)
    state.initialize(state.ParallelConfig())
    g = torch.Generator().manual_seed(1)
    batch, seq = 4, 512
    ids = torch.randint(0, hf_config.vocab_size, (batch, seq), generator=g)
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[1, 400:] = 0  # right padding
    mask[2, :100] = 0  # left padding
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        chunks = build_forward_only_model(hf_config, dtype=dtype)
        load_hf_weights(chunks, model_dir, hf_config)
        mine = forward_only(chunks, [{"input_ids": ids, "attention_mask": mask}],
                            OutputRequest(log_probs=True, entropy=True))[0]
        del chunks
        torch.cuda.empty_cache()
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).cuda().eval()
        with torch.no_grad():
            position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
            logits = hf(input_ids=ids.cuda(), attention_mask=mask.cuda(),
                        position_ids=position_ids.cuda()).logits.float()
        logp = torch.log_softmax(logits[:, :-1], -1)
        ref_lp = torch.zeros(batch, seq)
        ref_ent = torch.zeros(batch, seq)
        ref_lp[:, 1:] = logp.gather(-1, ids[:, 1:, None].cuda())[..., 0].cpu()
        ref_ent[:, 1:] = (-(logp.exp() * logp).sum(-1)).cpu()
        del hf, logits, logp
        torch.cuda.empty_cache()
        # Positions with a prediction: a valid token whose predecessor in the row is valid too.
        scored = (mask[:, 1:] * mask[:, :-1]).bool()
        valid = torch.zeros_like(mask, dtype=torch.bool)
        valid[:, 1:] = scored
        name = "fp32" if dtype == torch.float32 else "bf16"
        out[name] = {"log_prob_max_abs_diff": float((mine["log_probs"].cpu() - ref_lp)[valid].abs().max()),
                     "entropy_max_abs_diff": float((mine["entropy"].cpu() - ref_ent)[valid].abs().max()),
                     "log_prob_mean_abs": float(ref_lp[valid].abs().mean()), "tokens": int(valid.sum())}
    state.destroy()
    return out


def make_worker(args, overrides: list[str]):
    """The trainer's policy worker, in-process at world size 1 on this GPU; (worker, model folder, config)."""
    from omegaconf import OmegaConf

    from meshrl.config import load_config
    from meshrl.config.validate import validate_config
    from meshrl.workers.actor_rollout_ref import ActorRolloutRefWorker

    model_dir = random_model_dir(args)
    cfg = load_config([
        f"actor_rollout_ref.model.path={model_dir}", "trainer.device=cuda", "trainer.n_gpus_per_node=1",
        "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.name=hf",
        "actor_rollout_ref.rollout.ignore_eos=True",
        f"actor_rollout_ref.rollout.n={args.n}", f"data.train_batch_size={args.prompts}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={args.prompts}", f"data.max_prompt_length={args.prompt_len}",
        f"data.max_response_length={args.response}", "actor_rollout_ref.actor.megatron.dtype=bfloat16",
        "actor_rollout_ref.actor.use_dynamic_bsz=True",
        f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={args.token_budget}",
        "actor_rollout_ref.actor.use_kl_loss=False", "algorithm.use_kl_in_reward=False",
        "actor_rollout_ref.actor.optim.lr=1e-6", *overrides])
    worker = ActorRolloutRefWorker(0, 1, OmegaConf.to_container(cfg.actor_rollout_ref, resolve=True),
                                   str(model_dir), validate_config(cfg))
    worker.setup(worker.address())
    return worker, model_dir, cfg


def prompts_batch(args, vocab: int, seed: int):
    from meshrl.protocol import Batch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (args.prompts, args.prompt_len), generator=g)
    return Batch(tensors={"uid": torch.arange(args.prompts)}, non_tensors={"prompt_ids": [r.tolist() for r in ids]})


def section_rl_step_padded(args) -> dict:
    return section_rl_step(args, ["actor_rollout_ref.model.use_remove_padding=False"])


def section_rl_step(args, overrides: list[str] = ()) -> dict:
    """Per-phase time of RL steps through the worker's own calls, in the trainer's order."""
    from bench.machine import model_shape, transformer_flops
    from meshrl.algorithms import GlobalNorm
    from meshrl.trainer.advantage import compute_advantages, compute_token_rewards, outcome_to_token_scores

    worker, model_dir, cfg = make_worker(args, list(overrides))
    shape = model_shape(model_dir)
    algo = cfg.algorithm
    steps = []
    for step in range(args.steps + 1):  # step 0 warms up (allocator, kernels)
        phases: dict[str, float] = {}
        torch.cuda.reset_peak_memory_stats()

        def phase(name, fn):
            torch.cuda.synchronize()
            start = time.perf_counter()
            result = fn()
            torch.cuda.synchronize()
            phases[name] = time.perf_counter() - start
            return result

        prompts = prompts_batch(args, worker.hf_config.vocab_size, step)
        batch = phase("generate", lambda: worker.generate(prompts, "train"))
        # Random rewards: the step's cost does not depend on their values.
        scores = torch.rand(len(batch), generator=torch.Generator().manual_seed(step)).round()
        batch.set("token_level_scores", outcome_to_token_scores(scores, batch["response_mask"]))
        batch = batch.union(phase("old_log_prob", lambda: worker.compute_log_probs(batch, "actor")))
        compute_token_rewards(batch, algo, None, worker.plan.kl_in_reward)
        compute_advantages(batch, algo, worker.plan.adv_estimator)
        norm = GlobalNorm.from_mask(batch["response_mask"], max_len=args.response)
        metrics, _ = phase("update", lambda: worker.update([(batch, norm)]))
        phase("sync", worker.sync_weights)
        lengths = [len(p) + int(m.sum()) for p, m in zip(batch["prompt_ids"], batch["response_mask"])]
        generated = int(batch["response_mask"].sum())
        steps.append({"phases_s": phases, "step_s": sum(phases.values()), "sequences": len(batch),
                      "generated_tokens": generated, "trained_tokens": sum(lengths),
                      # the worker runs the vocabulary projection for response tokens only
                      "update_flops": transformer_flops(lengths, shape, backward=True, output_tokens=generated),
                      "log_prob_flops": transformer_flops(lengths, shape, backward=False, output_tokens=generated),
                      "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30,
                      "grad_norm": metrics["actor/grad_norm"], "loss": metrics["actor/loss"],
                      "micro_batches": metrics.get("dynamic_batch/num_micro_batches")})
    timed = steps[1:]
    median = {name: statistics.median(s["phases_s"][name] for s in timed) for name in timed[0]["phases_s"]}
    first = timed[0]
    return {
        "config": {"prompts": args.prompts, "n": args.n, "prompt_len": args.prompt_len, "response": args.response,
                   "token_budget": args.token_budget, "engine": "hf (transformers generate, bf16)",
                   "packed": worker.remove_padding,
                   "actor": "megatron-core TP1, bf16 params, fp32 grads/main params/Adam", "steps_timed": len(timed)},
        "params": shape.params, "steps": steps, "median_phases_s": median,
        "median_step_s": statistics.median(s["step_s"] for s in timed),
        "generation_tokens_per_s": first["generated_tokens"] / median["generate"],
        "update_tokens_per_s": first["trained_tokens"] / median["update"],
        "update_achieved_flops": first["update_flops"] / median["update"],
        "log_prob_achieved_flops": first["log_prob_flops"] / median["old_log_prob"],
        "sync_gb_per_s": 2 * shape.params / 1e9 / median["sync"],
    }


def section_update_mfu(args, overrides: tuple[str, ...] = ()) -> dict:
    """The worker's actor update alone, on synthetic batches of ``seq``-token sequences, with ``overrides``."""
    from bench.machine import model_shape, transformer_flops
    from meshrl.algorithms import GlobalNorm
    from meshrl.config.run_plan import build_run_plan
    from meshrl.protocol import Batch

    worker, model_dir, cfg = make_worker(args, list(overrides))
    shape = model_shape(model_dir)
    results = []
    for rows, seq, budget in args.mfu_shapes:
        prompt = seq // 4
        response = seq - prompt
        g = torch.Generator().manual_seed(seq)
        vocab = worker.hf_config.vocab_size
        mask = torch.ones(rows, response)
        batch = Batch(tensors={"responses": torch.randint(0, vocab, (rows, response), generator=g),
                               "response_mask": mask, "advantages": torch.randn(rows, 1, generator=g) * mask},
                      non_tensors={"prompt_ids": [torch.randint(0, vocab, (prompt,), generator=g).tolist()
                                                  for _ in range(rows)]})
        worker.response_length = response
        cfg.actor_rollout_ref.actor.ppo_max_token_len_per_gpu = budget
        worker.plan = build_run_plan(cfg)  # the worker's micro-batching comes from the run plan
        norm = GlobalNorm.from_mask(mask, max_len=response)
        torch.cuda.reset_peak_memory_stats()
        metrics: list[dict] = []  # each update's; the first is compared across variants
        try:
            seconds = cuda_timed(lambda: metrics.append(worker.update([(batch, norm)], on_policy=True)[0]),
                                 args.mfu_repeats + 1)
        except torch.OutOfMemoryError as error:
            results.append({"rows": rows, "seq": seq, "token_budget": budget, "error": repr(error)[:300]})
            torch.cuda.empty_cache()
            continue
        flops = transformer_flops([seq] * rows, shape, backward=True, output_tokens=rows * response)
        warmup_s, seconds = seconds[0], seconds[1:]
        best, median = min(seconds), statistics.median(seconds)
        results.append({"rows": rows, "seq": seq, "token_budget": budget, "seconds": seconds, "first_s": warmup_s,
                        "first_loss": metrics[0]["actor/loss"], "first_grad_norm": metrics[0]["actor/grad_norm"],
                        "tokens_per_s": rows * seq / median, "achieved_flops_median": flops / median,
                        "achieved_flops_best": flops / best,
                        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30})
    return {"params": shape.params, "packed": worker.remove_padding, "overrides": list(overrides), "shapes": results}


def section_offload(args) -> dict:
    from meshrl.parallel.offload import HostBuffers, offload

    from meshrl.algorithms import GlobalNorm
    from meshrl.protocol import Batch

    worker, _, _ = make_worker(args, [])
    # One update so that gradients and Adam state exist.
    rows, response = 8, 64
    mask = torch.ones(rows, response)
    batch = Batch(tensors={"responses": torch.randint(0, 1000, (rows, response)), "response_mask": mask,
                           "advantages": torch.randn(rows, 1) * mask},
                  non_tensors={"prompt_ids": [list(range(1, 33))] * rows})
    worker.response_length = response
    worker.update([(batch, GlobalNorm.from_mask(mask, max_len=response))], on_policy=True)
    before = {n: p.detach().clone().cpu() for c in worker.policy for n, p in c.named_parameters()}
    grads_before = {n: p.main_grad.detach().clone().cpu() for c in worker.policy for n, p in c.named_parameters()}
    allocated = torch.cuda.memory_allocated()
    pool = HostBuffers()  # as the worker does: pinned once, reused by every later offload
    rounds = []
    for _ in range(2):
        torch.cuda.synchronize()
        start = time.perf_counter()
        held = offload(worker.policy, worker.optimizer, params=True, grads=True, optimizer_state=True, buffers=pool)
        torch.cuda.synchronize()
        offload_s = time.perf_counter() - start
        during, moved = torch.cuda.memory_allocated(), held.nbytes
        start = time.perf_counter()
        held.restore()
        rounds.append({"offload_s": offload_s, "restore_s": time.perf_counter() - start, "offloaded_gib": moved / 2**30,
                       "allocated_offloaded_gib": during / 2**30})
    after = {n: p.detach().cpu() for c in worker.policy for n, p in c.named_parameters()}
    grads_after = {n: p.main_grad.detach().cpu() for c in worker.policy for n, p in c.named_parameters()}
    return {"allocated_before_gib": allocated / 2**30, "rounds": rounds,
            "allocated_restored_gib": torch.cuda.memory_allocated() / 2**30,
            "params_identical": all(torch.equal(before[n], after[n]) for n in before),
            "grads_identical": all(torch.equal(grads_before[n], grads_after[n]) for n in grads_before)}


def section_checkpoint(args) -> dict:
    from meshrl.parallel.checkpoint import load_checkpoint, save_checkpoint

    worker, _, _ = make_worker(args, [])
    root = Path(args.work) / "ckpt"
    before = {n: p.detach().clone() for c in worker.policy for n, p in c.named_parameters()}
    start = time.perf_counter()
    folder = save_checkpoint(root, 1, worker.policy, worker.optimizer, worker.scheduler)
    save_s = time.perf_counter() - start
    with torch.no_grad():
        for c in worker.policy:
            for p in c.parameters():
                p.zero_()
    start = time.perf_counter()
    load_checkpoint(folder, worker.policy, worker.optimizer, worker.scheduler)
    load_s = time.perf_counter() - start
    diff = max(float((p.detach() - before[n]).abs().max()) for c in worker.policy for n, p in c.named_parameters())
    return {"save_s": save_s, "load_s": load_s, "max_abs_diff_after_load": diff,
            "files": sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())[:20]}


def profile_worker_calls(worker, rows: int, prompt: int, response: int) -> dict:
    """Wall time, summed GPU kernel time and the top Python functions (cProfile, cumulative) of the
    worker's ``compute_log_probs`` and ``update`` on an RL-shaped batch: what the model's kernels do not
    explain is host-side overhead."""
    import cProfile
    import io
    import pstats

    from torch.profiler import ProfilerActivity, profile

    from meshrl.algorithms import GlobalNorm
    from meshrl.protocol import Batch

    g = torch.Generator().manual_seed(2)
    vocab = worker.hf_config.vocab_size
    lengths = torch.randint(response // 4, response + 1, (rows,), generator=g)
    mask = (torch.arange(response) < lengths[:, None]).float()
    batch = Batch(tensors={"responses": torch.randint(0, vocab, (rows, response), generator=g), "response_mask": mask,
                           "advantages": torch.randn(rows, 1, generator=g) * mask},
                  non_tensors={"prompt_ids": [torch.randint(0, vocab, (prompt,), generator=g).tolist()
                                              for _ in range(rows)]})
    worker.response_length = response
    norm = GlobalNorm.from_mask(mask, max_len=response)
    calls = {"compute_log_probs": lambda: worker.compute_log_probs(batch, "actor"),
             "update": lambda: worker.update([(batch, norm)], on_policy=True)}
    out = {}
    for name, fn in calls.items():
        fn()
        wall = cuda_timed(fn, 1)[0]
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        gpu_s = sum(e.self_device_time_total for e in prof.key_averages()) / 1e6
        profiler = cProfile.Profile()
        profiler.enable()
        fn()
        torch.cuda.synchronize()
        profiler.disable()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(30)
        out[name] = {"wall_s": wall, "gpu_kernel_s": gpu_s, "cprofile": text.getvalue()[-6000:],
                     "alloc_retries": torch.cuda.memory_stats().get("num_alloc_retries")}
        print(f"== worker.{name}: wall {wall:.2f} s, GPU kernels {gpu_s:.2f} s\n{text.getvalue()[-6000:]}", flush=True)
    return out


def section_profile(args) -> dict:
    """Where a micro-batch's time goes: the top CUDA kernels of the Megatron forward and forward+backward,
    and the same forward through HF transformers for scale."""
    from torch.profiler import ProfilerActivity, profile
    from transformers import AutoModelForCausalLM

    from bench.machine import model_shape, transformer_flops
    from meshrl.parallel.forward import OutputRequest
    from meshrl.parallel.schedule import forward_backward, forward_only

    worker, model_dir, _ = make_worker(args, [])
    shape = model_shape(model_dir)
    rows, seq = 12, 640
    g = torch.Generator().manual_seed(0)
    micro = {"input_ids": torch.randint(0, worker.hf_config.vocab_size, (rows, seq), generator=g),
             "attention_mask": torch.ones(rows, seq, dtype=torch.long)}
    request = OutputRequest(log_probs=True)

    def loss_fn(outputs, micro_batch):
        return -outputs["log_probs"].sum() / outputs["log_probs"].numel(), {}

    runs = {"forward": lambda: forward_only(worker.policy, [micro], request),
            "forward_backward": lambda: forward_backward(worker.policy, [micro], loss_fn, request)}
    out = {"rows": rows, "seq": seq}
    for name, fn in runs.items():
        fn()
        seconds = statistics.median(cuda_timed(fn, 3))
        flops = transformer_flops([seq] * rows, shape, backward=name != "forward")
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70)
        out[name] = {"seconds": seconds, "achieved_flops": flops / seconds, "top_kernels": table}
        print(f"== {name}: {seconds:.3f} s, {flops / seconds / 1e12:.0f} TFLOP/s\n{table}", flush=True)
    out["worker"] = profile_worker_calls(worker, rows=128, prompt=128, response=512)
    worker.engine.shutdown()
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()
    ids = micro["input_ids"].cuda()

    def hf_forward():
        with torch.no_grad():
            logits = hf(input_ids=ids).logits
            torch.log_softmax(logits.float(), -1)

    hf_forward()
    seconds = statistics.median(cuda_timed(hf_forward, 3))
    out["hf_forward"] = {"seconds": seconds,
                         "achieved_flops": transformer_flops([seq] * rows, shape, backward=False) / seconds}
    return out


# ------------------------------------------------------------------------------------------- driver
def run_section(name: str, args) -> None:
    from meshrl.runtime import configure_environment

    configure_environment()
    try:
        if name in UPDATE_VARIANTS:
            result = {"ok": True, **section_update_mfu(args, UPDATE_VARIANTS[name][1])}
        else:
            result = {"ok": True, **globals()[f"section_{name}"](args)}
    except Exception as error:  # recorded, so that one failing check does not hide the others
        result = {"ok": False, "error": repr(error), "traceback": traceback.format_exc()}
    Path(args.section_out).write_text(json.dumps(result, indent=1, default=str))


def summary(result: dict) -> list[str]:
    m = result.get("machine", {})
    peak = m.get("matmul_bf16_flops") or float("nan")
    sheet = m.get("datasheet_bf16_flops") or float("nan")
    lines = [f"device {m.get('device')}  torch {m.get('torch')}  megatron-core {m.get('megatron_core')}  "
             f"TE {m.get('transformer_engine')}",
             f"bf16 matmul {peak / 1e12:.0f} TFLOP/s measured, copy "
             f"{m.get('copy_bytes_per_s', float('nan')) / 1e12:.2f} TB/s"]
    for name in SECTIONS[1:]:
        if name not in result:  # not asked for in this run
            continue
        section = result[name]
        if not section.get("ok"):
            lines.append(f"{name}: FAILED {section.get('error', 'not run')}")
            continue
        if name == "parity":
            lines.append("parity " + "  ".join(f"{k}: logp {v['log_prob_max_abs_diff']:.2e} ent "
                                               f"{v['entropy_max_abs_diff']:.2e}" for k, v in section.items()
                                               if isinstance(v, dict)))
        elif name in ("rl_step", "rl_step_padded"):
            ph = section["median_phases_s"]
            mfu = section["update_achieved_flops"]
            lines.append(f"{name} {section['median_step_s']:.2f} s: " + "  ".join(f"{k} {v:.2f}" for k, v in ph.items())
                         + f"  | gen {section['generation_tokens_per_s']:.0f} tok/s, update MFU "
                         f"{mfu / peak:.3f} of measured / {mfu / sheet:.3f} of datasheet")
        elif name in UPDATE_VARIANTS:
            for s in section["shapes"]:
                if "error" in s:
                    lines.append(f"{name} {s['rows']}x{s['seq']} budget {s['token_budget']}: {s['error'][:80]}")
                    continue
                lines.append(f"{name} {s['rows']}x{s['seq']} budget {s['token_budget']}: "
                             f"{s['tokens_per_s']:.0f} tok/s, "
                             f"MFU {s['achieved_flops_median'] / peak:.3f} measured / "
                             f"{s['achieved_flops_median'] / sheet:.3f} datasheet, "
                             f"peak mem {s['peak_memory_gib']:.1f} GiB; first update {s['first_s']:.1f} s, loss "
                             f"{s['first_loss']:.6g}, grad norm {s['first_grad_norm']:.6g}")
        elif name == "offload":
            lines.append("offload " + "; ".join(f"{r['offloaded_gib']:.1f} GiB out {r['offload_s']:.2f} s, back "
                                                 f"{r['restore_s']:.2f} s" for r in section["rounds"])
                         + f"; allocated {section['allocated_before_gib']:.1f} -> "
                         f"{section['rounds'][0]['allocated_offloaded_gib']:.1f} -> "
                         f"{section['allocated_restored_gib']:.1f} GiB;"
                         f" identical params {section['params_identical']} grads {section['grads_identical']}")
        elif name == "profile":
            lines.append("profile " + "  ".join(f"{k} {section[k]['seconds']:.3f} s "
                                                f"{section[k]['achieved_flops'] / 1e12:.0f} "
                                                f"TFLOP/s" for k in ("forward", "forward_backward", "hf_forward")))
        elif name == "checkpoint":
            lines.append(f"checkpoint save {section['save_s']:.1f} s load {section['load_s']:.1f} s, "
                         f"max diff after load {section['max_abs_diff_after_load']:.1e}")
    return lines


def plot(result: dict, path: Path) -> None:
    """Per-phase time of the RL step (packed and padded rows), and the actor update's MFU and peak memory in
    each update variant (fused / unfused output layer, compiled layers), side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    peak = result.get("machine", {}).get("matmul_bf16_flops")
    runs = [name for name in ("rl_step", "rl_step_padded") if result.get(name, {}).get("ok")]
    if runs:
        fig, (left, middle, right) = plt.subplots(1, 3, figsize=(17, 4.5))
    else:  # a run of the update sections alone
        fig, (middle, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    phases = ("generate", "old_log_prob", "update", "sync")
    colors = ("#3b7dd8", "#9a9a9a", "#d8843b", "#4caf50")
    for index, name in enumerate(runs):
        bottom = 0.0
        for phase, color in zip(phases, colors):
            value = result[name]["median_phases_s"][phase]
            left.bar(index, value, bottom=bottom, color=color, label=phase if index == 0 else None)
            bottom += value
        left.text(index, bottom, f"{bottom:.1f} s", ha="center", va="bottom", fontsize=9)
    if runs:
        left.set_xticks(range(len(runs)), [n.replace("rl_step", "RL step").replace("_padded", " (padded rows)")
                                           for n in runs])
        left.set_ylabel("seconds per step (median)")
        left.set_title("RL step phases, HF engine + Megatron TP1, bf16", fontsize=10)
        left.legend(fontsize=8)
    variants = [name for name in UPDATE_VARIANTS if result.get(name, {}).get("ok")]
    shapes = sorted({(s["rows"], s["seq"], s["token_budget"]) for name in variants for s in result[name]["shapes"]
                     if "error" not in s})
    width = 0.8 / max(1, len(variants))
    for offset, name in enumerate(variants):
        by_shape = {(s["rows"], s["seq"], s["token_budget"]): s for s in result[name]["shapes"] if "error" not in s}
        xs = [i + offset * width for i, key in enumerate(shapes) if key in by_shape]
        label = UPDATE_VARIANTS[name][0]
        if peak:
            bars = middle.bar(xs, [by_shape[k]["achieved_flops_median"] / peak for k in shapes if k in by_shape],
                              width, label=label)
            middle.bar_label(bars, fmt="%.2f", fontsize=7)
        bars = right.bar(xs, [by_shape[k]["peak_memory_gib"] for k in shapes if k in by_shape], width, label=label)
        right.bar_label(bars, fmt="%.1f", fontsize=7)
    ticks = [i + width * (len(variants) - 1) / 2 for i in range(len(shapes))]
    names = [f"{r}x{q}\nbudget {b}" for r, q, b in shapes]
    middle.set_xticks(ticks, names, fontsize=8)
    right.set_xticks(ticks, names, fontsize=8)
    middle.set_ylabel("fraction of measured bf16 matmul FLOP/s")
    middle.set_title("actor update MFU (median)", fontsize=10)
    right.set_ylabel("GiB")
    right.set_title("actor update peak device memory", fontsize=10)
    middle.legend(fontsize=8, loc="lower center")
    m = result.get("machine", {})
    fig.suptitle(f"{m.get('device', 'GPU')}: random Qwen2.5-1.5B shape, meshrl worker in-process "
                 f"(TE {'on' if m.get('transformer_engine') else 'off'})", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def parse_shapes(text: str) -> list[tuple[int, int, int]]:
    """``ROWSxSEQ@BUDGET,...`` → [(rows, seq, budget)]."""
    shapes = []
    for item in text.split(","):
        size, budget = item.split("@")
        rows, seq = size.split("x")
        shapes.append((int(rows), int(seq), int(budget)))
    return shapes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--work", default="/tmp/meshrl-gpu-bench", help="model and checkpoint scratch folder")
    parser.add_argument("--tokenizer", default=None, help="a tokenizer folder copied into the random model")
    parser.add_argument("--sections", default=",".join(SECTIONS))
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--response", type=int, default=512)
    parser.add_argument("--token-budget", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--mfu-shapes", type=parse_shapes,
                        default=parse_shapes("64x1024@4096,64x1024@8192,32x2048@8192"))
    parser.add_argument("--mfu-repeats", type=int, default=3)
    parser.add_argument("--section", help=argparse.SUPPRESS)
    parser.add_argument("--section-out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.section:
        run_section(args.section, args)
        return
    if not torch.cuda.is_available():
        sys.exit("bench.gpu needs a CUDA device")
    Path(args.work).mkdir(parents=True, exist_ok=True)
    result: dict = {"command": "python -m bench.gpu " + " ".join(sys.argv[1:])}
    for name in args.sections.split(","):
        out = Path(args.work) / f"{name}.json"
        start = time.perf_counter()
        child = subprocess.run([sys.executable, "-m", "bench.gpu", *sys.argv[1:], "--section", name,
                                "--section-out", str(out)], cwd=Path(__file__).resolve().parents[1])
        result[name] = (json.loads(out.read_text()) if out.is_file()
                        else {"ok": False, "error": f"exit {child.returncode}"})
        result[name]["wall_s"] = time.perf_counter() - start
        print(f"[bench.gpu] {name}: {'ok' if result[name].get('ok') else 'FAILED'} in {result[name]['wall_s']:.0f} s",
              flush=True)
        if not result[name].get("ok") and "traceback" in result[name]:
            print(result[name]["traceback"][-3000:], flush=True)
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "gpu.json").write_text(json.dumps(result, indent=1, default=str))
    plot(result, Path(args.out) / "gpu.png")
    print("\n".join(summary(result)))


if __name__ == "__main__":
    main()
