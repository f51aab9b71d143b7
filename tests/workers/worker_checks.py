"""In-process checks of the policy worker, without Ray: one ``ActorRolloutRefWorker`` at world size 1
(gloo) with the transformers rollout engine on the tiny Llama, called directly on a hand-made batch.

Run as a script, in a fresh process (it starts torch.distributed and megatron's global state); it
writes one JSON of measurements that ``test_worker_inprocess.py`` asserts on:

    python tests/workers/worker_checks.py --out results.json

Updates are compared on the same weights: each one's gradients are read from the DDP grad buffers
(``main_grad``, which the optimizer step leaves in place; the gradient clip is set out of reach) and
the weights are put back before the next one.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

WIDTH = 12  # response length R


def make_worker(overrides: list[str]):
    from omegaconf import OmegaConf

    from meshrl.config import load_config
    from meshrl.models.resolve import resolve_model_path
    from meshrl.config.validate import validate_config
    from meshrl.workers.actor_rollout_ref import ActorRolloutRefWorker

    cfg = load_config(["actor_rollout_ref.rollout.name=hf", "actor_rollout_ref.actor.use_kl_loss=True",
                       "actor_rollout_ref.actor.optim.clip_grad=1e9", "actor_rollout_ref.actor.optim.lr=1e-3",
                       f"data.max_response_length={WIDTH}", *overrides], recipe="cpu_tiny_grpo")
    model_dir = resolve_model_path(cfg.actor_rollout_ref.model.path)
    worker = ActorRolloutRefWorker(0, 1, OmegaConf.to_container(cfg.actor_rollout_ref, resolve=True),
                                   str(model_dir), validate_config(cfg))
    worker.setup(worker.address())
    worker.cfg = cfg  # the checks' copy of the run's config (the worker reads its section and the plan only)
    return worker


def make_batch(rows: int = 6, seed: int = 0):
    """Random prompts and responses of varied lengths, advantages constant per response (GRPO-like)."""
    from meshrl.protocol import Batch

    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(10, 5000, (int(n),), generator=g).tolist()
               for n in torch.randint(3, 9, (rows,), generator=g)]
    lengths = torch.randint(2, WIDTH + 1, (rows,), generator=g)
    mask = (torch.arange(WIDTH) < lengths[:, None]).float()
    return Batch(tensors={"responses": torch.randint(10, 5000, (rows, WIDTH), generator=g), "response_mask": mask,
                          "advantages": torch.randn(rows, 1, generator=g) * mask},
                 non_tensors={"prompt_ids": prompts})


def weights(worker) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for chunk in worker.policy for name, p in chunk.named_parameters()}


def grads(worker) -> dict[str, torch.Tensor]:
    return {name: p.main_grad.detach().clone() for chunk in worker.policy for name, p in chunk.named_parameters()}


def restore(worker, weights: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for chunk in worker.policy:
            for name, p in chunk.named_parameters():
                p.copy_(weights[name])


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def max_abs(a: dict[str, torch.Tensor]) -> float:
    return max(float(v.float().abs().max()) for v in a.values())


def update(worker, batch, on_policy: bool = False):
    """(metrics, returned log-probs, gradients) of one update on ``batch``, weights put back after."""
    from meshrl.algorithms import GlobalNorm

    before = weights(worker)
    metrics, log_probs = worker.update([(batch, GlobalNorm.from_mask(batch["response_mask"], max_len=WIDTH))],
                                       on_policy=on_policy)
    grad = grads(worker)
    restore(worker, before)
    return metrics, log_probs, grad


def check_on_policy(worker) -> dict:
    """The on-policy update (logπ_θ.detach() as logπ_old) against the one fed the recomputed log-probs."""
    batch = make_batch()
    old = worker.compute_log_probs(batch, model="actor")
    ref = worker.compute_log_probs(batch, model="ref")
    batch = batch.union(ref)
    full, none, g_full = update(worker, batch.union(old))
    skip, seen, g_skip = update(worker, batch, on_policy=True)
    mask = batch["response_mask"].bool()
    return {
        "recompute_returns_nothing": none is None,
        "loss_diff": abs(full["actor/loss"] - skip["actor/loss"]),
        "pg_loss": skip["actor/pg_loss"],
        "grad_max_abs": max_abs(g_full),
        "grad_diff": max_diff(g_full, g_skip),
        "grad_norm_diff": abs(full["actor/grad_norm"] - skip["actor/grad_norm"]),
        "returned_vs_recomputed": float((seen["old_log_probs"] - old["old_log_probs"])[mask].abs().max()),
        "returned_outside_mask": float(seen["old_log_probs"][~mask].abs().max()),
        "returned_shape_ok": tuple(seen["old_log_probs"].shape) == tuple(batch["response_mask"].shape),
    }


def check_sum_pi_squared(worker) -> dict:
    """actor.calculate_sum_pi_squared (the run plan's sum_pi_squared): the policy's old-log-prob pass also returns
    Σ_v π_v² per response token, fused and unfused alike, without changing the log-probs; the reference's does not."""
    import dataclasses

    batch = make_batch(seed=7)
    planned = worker.plan
    plain = worker.compute_log_probs(batch, model="actor")
    runs = {}
    for fused in (planned.fused_chunk_size, None):
        worker.plan = dataclasses.replace(planned, sum_pi_squared=True, fused_chunk_size=fused)
        runs[fused is not None] = worker.compute_log_probs(batch, model="actor")
    ref = worker.compute_log_probs(batch, model="ref")
    worker.plan = planned
    mask = batch["response_mask"].bool()
    squares = runs[True]["sum_pi_squared"]
    token_p = runs[True]["old_log_probs"].exp()
    return {"off_by_default": "sum_pi_squared" not in plain and "sum_pi_squared" not in ref,
            "shape_ok": tuple(squares.shape) == tuple(mask.shape) and squares.dtype == torch.float32,
            "outside_mask": float(squares[~mask].abs().max()),
            "min": float(squares[mask].min()), "max": float(squares[mask].max()),
            # π(token)² <= Σ_v π_v² <= 1
            "below_token_p_squared": float((token_p[mask] ** 2 - squares[mask]).max()),
            "fused_vs_unfused": float((runs[True]["sum_pi_squared"] - runs[False]["sum_pi_squared"]).abs().max()),
            "log_probs_changed": float((runs[True]["old_log_probs"] - plain["old_log_probs"]).abs().max())}


def check_version_weights(worker) -> dict:
    """The fully async trainer's pi_old at a version's later local steps (keep_version_weights): the pass on the kept
    weights gives the log-probs of the weights as they were kept, after the policy moved on, and leaves the policy's
    own weights in place, bit for bit."""
    batch = make_batch(seed=11)
    before = weights(worker)
    kept_lp = worker.compute_log_probs(batch, model="actor")["old_log_probs"]
    worker.keep_version_weights()
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():  # the version's first local step's update, in effect
        for chunk in worker.policy:
            for p in chunk.parameters():
                p.add_(0.02 * torch.randn(p.shape, generator=generator).to(p.dtype))
    moved = weights(worker)
    moved_lp = worker.compute_log_probs(batch, model="actor")["old_log_probs"]
    version_lp = worker.compute_log_probs(batch, model="version")["old_log_probs"]
    after = weights(worker)
    restore(worker, before)
    mask = batch["response_mask"].bool()
    return {"version_vs_kept": float((version_lp - kept_lp)[mask].abs().max()),
            "moved_vs_kept": float((moved_lp - kept_lp)[mask].abs().max()),
            "weights_put_back": max_diff(after, moved)}


def check_precision(worker) -> dict:
    """Parameter, gradient and optimizer dtypes; log-probs against an fp32 model with the same
    checkpoint (through the same code path, in the reference's place); one update."""
    from meshrl.algorithms import GlobalNorm
    from meshrl.parallel.hf_conversion import load_hf_weights
    from meshrl.parallel.model_builder import build_forward_only_model
    from meshrl.parallel.optimizer import _inner_optimizers
    from meshrl.protocol import Batch

    batch = make_batch(rows=8, seed=1)
    mask = batch["response_mask"].bool()
    actor = worker.compute_log_probs(batch, model="actor")["old_log_probs"]
    ref = worker.compute_log_probs(batch, model="ref")["ref_log_probs"]
    # An fp32 model with the checkpoint's weights, run through the same code path in the ref's place.
    reference, worker.ref = worker.ref, build_forward_only_model(worker.hf_config, dtype=torch.float32)
    load_hf_weights(worker.ref, worker.model_dir, worker.hf_config)
    fp32 = worker.compute_log_probs(batch, model="ref")["ref_log_probs"]
    worker.ref = reference
    diff = (actor - fp32)[mask].abs()
    inner, = _inner_optimizers(worker.optimizer)
    main_params = [p for group in getattr(inner, "fp32_from_float16_groups", []) for p in group]
    before = weights(worker)
    metrics, _ = worker.update([(batch.union(Batch(tensors={"old_log_probs": actor, "ref_log_probs": ref})),
                                 GlobalNorm.from_mask(batch["response_mask"], max_len=WIDTH))])
    grad = grads(worker)
    state = [t for s in inner.optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0]
    return {
        "optimizer": type(inner).__name__,
        "param_dtypes": sorted({str(p.dtype) for chunk in worker.policy for p in chunk.parameters()}),
        "ref_param_dtypes": sorted({str(p.dtype) for chunk in worker.ref for p in chunk.parameters()}),
        "grad_dtypes": sorted({str(g.dtype) for g in grad.values()}),
        "main_param_dtypes": sorted({str(p.dtype) for p in main_params}),
        "main_params": len(main_params),
        "adam_state_dtypes": sorted({str(t.dtype) for t in state}),
        "log_prob_dtype": str(actor.dtype),
        "log_prob_vs_fp32_max": float(diff.max()),
        "log_prob_vs_fp32_mean": float(diff.mean()),
        "ref_vs_actor": float((actor - ref)[mask].abs().max()),
        "loss": metrics["actor/loss"],
        "grad_norm": metrics["actor/grad_norm"],
        "loss_scale": float(inner.get_loss_scale()),
        "weights_moved": max_diff(before, weights(worker)),
    }


def check_fixed_micro_batches(worker) -> dict:
    """use_dynamic_bsz=False: micro-batches of k sequences, against the token-budget split of the same batch."""
    from omegaconf import OmegaConf

    from meshrl.config.run_plan import build_run_plan

    rows, k, k_log_prob = 10, 4, 3
    batch = make_batch(rows=rows, seed=3)
    batch = batch.union(worker.compute_log_probs(batch, model="ref"))
    budget = worker.compute_log_probs(batch, model="actor")["old_log_probs"]
    dynamic, _, g_dynamic = update(worker, batch, on_policy=True)
    planned = worker.plan
    for key, value in (("actor.use_dynamic_bsz", False), ("actor.ppo_micro_batch_size_per_gpu", k),
                       ("rollout.log_prob_micro_batch_size_per_gpu", k_log_prob)):
        OmegaConf.update(worker.cfg, f"actor_rollout_ref.{key}", value)
    worker.plan = build_run_plan(worker.cfg)  # the worker reads its micro-batching from the run plan
    counted, log_prob_plan = with_plan(lambda: worker.compute_log_probs(batch, model="actor")["old_log_probs"])
    fixed, _, g_fixed = update(worker, batch, on_policy=True)
    OmegaConf.update(worker.cfg, "actor_rollout_ref.actor.use_dynamic_bsz", True)
    worker.plan = planned
    return {
        "rows": rows, "k": k,
        "micro_batches": fixed["dynamic_batch/num_micro_batches"],
        "samples_max": fixed["dynamic_batch/samples_max"],
        "dynamic_micro_batches": dynamic["dynamic_batch/num_micro_batches"],
        "loss_diff": abs(fixed["actor/loss"] - dynamic["actor/loss"]), "loss": dynamic["actor/loss"],
        "grad_max_abs": max_abs(g_dynamic), "grad_diff": max_diff(g_dynamic, g_fixed),
        "log_prob_diff": float((counted - budget).abs().max()),
        "log_prob_k": k_log_prob, "log_prob_micro_batches": log_prob_plan.num_micro_batches,
    }


def runs_with(worker, batch, attribute: str, values: tuple, record, **held) -> dict:
    """For each of ``values`` of the worker's ``attribute`` in turn (the ``held`` attributes set meanwhile; all put
    back after): the old log-probs of ``batch``, the loss and gradient of an on-policy update on it, and ``record``
    of every model input built meanwhile (``schedule.model_inputs``), by value."""
    from meshrl.parallel import schedule

    real, recorded = schedule.model_inputs, []

    def spy(*args, **kwargs):
        inputs = real(*args, **kwargs)
        recorded.append(record(inputs))
        return inputs

    saved = {name: getattr(worker, name) for name in (attribute, *held)}
    schedule.model_inputs = spy
    runs = {}
    try:
        for name, value in held.items():
            setattr(worker, name, value)
        for value in values:
            setattr(worker, attribute, value)
            log_probs = worker.compute_log_probs(batch, model="actor")["old_log_probs"]
            metrics, _, grad = update(worker, batch, on_policy=True)
            runs[value] = (log_probs, metrics["actor/loss"], grad, list(recorded))
            recorded.clear()
    finally:
        schedule.model_inputs = real
        for name, value in saved.items():
            setattr(worker, name, value)
    return runs


def differences(run, reference) -> dict:
    """How two of ``runs_with``'s runs differ: log-probs, loss and gradient (and the reference's scales)."""
    (lp, loss, grad, _), (lp_ref, loss_ref, grad_ref, _) = run, reference
    return {"log_prob_diff": float((lp - lp_ref).abs().max()), "loss_diff": abs(loss - loss_ref), "loss": loss_ref,
            "grad_diff": max_diff(grad, grad_ref), "grad_max_abs": max_abs(grad_ref)}


def check_remove_padding(worker) -> dict:
    """``actor_rollout_ref.model.use_remove_padding`` (default True) reaches the forward, which then runs
    packed THD micro-batches; their log-probs, loss and gradient against the row layout's."""
    batch = make_batch(rows=8, seed=4)
    batch = batch.union(worker.compute_log_probs(batch, model="ref"))
    configured = worker.remove_padding
    # the shared-prompt layout is packed whatever remove_padding says: held off
    runs = runs_with(worker, batch, "remove_padding", (configured, False),
                     lambda inputs: inputs.packed_seq_params is not None, shared_prompts=False)
    layout_p, layout_r = runs[True][3], runs[False][3]
    return {"configured": configured, "packed_forwards": sum(layout_p), "forwards": len(layout_p),
            "row_forwards_packed": sum(layout_r), **differences(runs[True], runs[False])}


def check_shared_prompts(worker) -> dict:
    """``actor.use_prefix_grouper`` unset: on for this model; on a GRPO-like batch (3 responses per prompt) the
    old-log-prob and reference passes and the update compute fewer tokens, with the log-probs, loss and gradient of
    every row with its own prompt."""
    batch = make_batch(rows=9, seed=5)
    batch.set("prompt_ids", [batch["prompt_ids"][3 * (row // 3)] for row in range(9)])
    batch = batch.union(worker.compute_log_probs(batch, model="ref"))
    configured = worker.shared_prompts
    runs = runs_with(worker, batch, "shared_prompts", (True, False), lambda inputs: int(inputs.input_ids.numel()))
    return {"configured": configured, "tokens_shared": sum(runs[True][3]), "tokens_unshared": sum(runs[False][3]),
            **differences(runs[True], runs[False])}


def with_plan(call):
    """(``call()``, the micro-batch plan the worker made inside it)."""
    from meshrl.workers import engine

    split, plans = engine.split_micro_batches, []

    def recording(*args, **kwargs):
        out = split(*args, **kwargs)
        plans.append(out[0])
        return out

    engine.split_micro_batches = recording
    try:
        return call(), plans[0]
    finally:
        engine.split_micro_batches = split


def check_lr_schedule(worker, rl_steps: int = 4) -> dict:
    """verl's optimizer keys (cosine after a warm-up ratio, min_lr_ratio) on an update of several
    mini-batches and epochs per RL step: the learning rate of every optimizer step, by RL step."""
    from omegaconf import OmegaConf

    from meshrl.algorithms import GlobalNorm
    from meshrl.parallel.optimizer import build_optimizer
    from meshrl.workers.model_setup import optimizer_config

    optim = OmegaConf.create({**OmegaConf.to_container(worker.cfg.actor_rollout_ref.actor.optim),
                              "lr": 1e-3, "lr_warmup_steps_ratio": 0.25, "warmup_style": "cosine",
                              "min_lr_ratio": 0.1, "total_training_steps": rl_steps, "clip_grad": 1e9})
    saved = (worker.optimizer, worker.scheduler, weights(worker))
    worker.optimizer, worker.scheduler = build_optimizer(worker.policy, optimizer_config(optim, False))
    worker.train_engine.optimizer, worker.train_engine.scheduler = worker.optimizer, worker.scheduler
    seen, step = [], worker.optimizer.step_with_ready_grads

    def recording_step(*args, **kwargs):  # what applies an update (meshrl.parallel.optimizer.optimizer_step)
        seen[-1].append(worker.optimizer.param_groups[0]["lr"])
        return step(*args, **kwargs)

    worker.optimizer.step_with_ready_grads = recording_step
    batch = make_batch(rows=8, seed=5)
    batch = batch.union(worker.compute_log_probs(batch, model="actor")).union(
        worker.compute_log_probs(batch, model="ref"))
    halves = [batch.take(list(range(0, 4))), batch.take(list(range(4, 8)))]
    logged = []
    for _ in range(rl_steps):
        seen.append([])
        # two mini-batches × two epochs: four optimizer steps in one RL step
        updates = [(half, GlobalNorm.from_mask(half["response_mask"], max_len=WIDTH)) for half in halves] * 2
        metrics, _ = worker.update(updates)
        logged.append(metrics["actor/lr"])
    worker.optimizer, worker.scheduler, before = saved
    worker.train_engine.optimizer, worker.train_engine.scheduler = worker.optimizer, worker.scheduler
    restore(worker, before)
    return {"lr": 1e-3, "min_lr_ratio": 0.1, "warmup_ratio": 0.25, "total": rl_steps,
            "per_optimizer_step": seen, "logged": logged}


def check_checkpoint(worker, folder: Path) -> dict:
    """Save, take another update, load: params and the optimizer's main params are the saved ones."""
    from meshrl.parallel.optimizer import _inner_optimizers

    inner, = _inner_optimizers(worker.optimizer)

    def main_params() -> list[torch.Tensor]:
        return [p.detach().clone() for group in getattr(inner, "fp32_from_float16_groups", []) for p in group]

    worker.save_checkpoint(str(folder), 1)
    saved, saved_main = weights(worker), main_params()
    batch = make_batch(rows=4, seed=2)
    batch = batch.union(worker.compute_log_probs(batch, model="ref"))
    update(worker, batch, on_policy=True)  # moves Adam's state and, below, the weights
    with torch.no_grad():
        for chunk in worker.policy:
            for p in chunk.parameters():
                p.add_(0.5)
    worker.load_checkpoint(str(folder))
    loaded_main = main_params()
    return {"weights": max_diff(saved, weights(worker)),
            "main_params": (max(float((a - b).abs().max()) for a, b in zip(saved_main, loaded_main))
                            if saved_main else 0.0)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--dtype", default="float32", help="actor_rollout_ref.actor.megatron.dtype")
    args = parser.parse_args()
    from meshrl.runtime import configure_environment

    configure_environment()
    torch.set_num_threads(1)
    worker = make_worker([f"actor_rollout_ref.actor.megatron.dtype={args.dtype}"])
    results = {"on_policy": check_on_policy(worker), "sum_pi_squared": check_sum_pi_squared(worker),
               "version_weights": check_version_weights(worker),
               "precision": check_precision(worker),
               "fixed_micro_batches": check_fixed_micro_batches(worker),
               "remove_padding": check_remove_padding(worker),
               "shared_prompts": check_shared_prompts(worker),
               "lr_schedule": check_lr_schedule(worker),
               "checkpoint": check_checkpoint(worker, args.out.parent / f"ckpt-{args.dtype}")}
    worker.shutdown_engine()
    args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
