"""Multi-process checks of mixture-of-experts models (``tiny:qwen2_moe`` / ``qwen3_moe`` / ``mixtral`` /
``deepseek_v3``) against
their transformers classes, run under torchrun; one launch runs every layout:

    torchrun --nproc-per-node 4 tests/parallel/moe_worker.py --workdir DIR --out DIR/moe.json

Layouts on 4 ranks: EP2 (TP1, DP4: two expert-parallel groups), EP2 x TP2 (tokens routed per TP rank's share;
experts split over expert TP = TP, megatron's and verl's default) and EP2 x PP2. Each records, per family:
log-probs and entropies of the forward pass, then loss and every gradient of one packed forward-backward,
against HF fp32 on all micro-batches in one process (so a gradient equals a single-rank run's), and the
weights read back out of the megatron layout (HF -> megatron -> HF) against the checkpoint. Rank 0 writes the
merged results at the end (numbers: max over ranks). ``tests/parallel/test_moe_parallel.py`` launches it.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from mp_worker import OPT, build, hf_model, hf_outputs, hf_tensors, merge, policy_loss  # noqa: E402

from meshrl.models.tiny import tiny_model_dir, tiny_spec  # noqa: E402
from meshrl.parallel import (checkpoint, hf_conversion, model_builder, optimizer, router_replay, schedule,  # noqa: E402
                             state)
from meshrl.parallel.forward import OutputRequest  # noqa: E402

MOE_FAMILIES = ("qwen2_moe", "qwen3_moe", "mixtral", "deepseek_v3")
# the families routing by a softmax, for which hf_reference writes the load-balancing and z-losses out
SOFTMAX_FAMILIES = ("qwen2_moe", "qwen3_moe", "mixtral")
REPLAY_FAMILY = "qwen2_moe"
SP_FAMILY = "qwen2_moe"  # also runs sequence-parallel at the TP2 layout (recorded as ``qwen2_moe_sp``)
TIMEOUT_S = 60.0
# (name, layout, families, with the load-balancing and z-losses, the distributed checkpoint: save / load / refuse /
# None)
PHASES = [("ep2", dict(expert_parallel=2), ("qwen2_moe", "deepseek_v3"), True, "save"),
          ("ep2tp2", dict(expert_parallel=2, tensor_parallel=2), ("qwen2_moe", "deepseek_v3"), False, "load"),
          ("ep2pp2", dict(expert_parallel=2, pipeline_parallel=2), ("qwen2_moe", "deepseek_v3"), False, "load"),
          ("ep4", dict(expert_parallel=4), (), False, "load"),
          ("ep1", {}, (), False, "refuse")]
# `make test-extended` (``--extended``): Qwen3-MoE and Mixtral at EP2 x TP2. They differ from Qwen2-MoE inside a
# layer only (no shared expert and q/k norms; Mixtral's names), which the in-process checks cover for every family;
# their experts shard across EP and TP as Qwen2-MoE's do.
EXTENDED_PHASES = [("ep2tp2", dict(expert_parallel=2, tensor_parallel=2), ("qwen3_moe", "mixtral"), False, None)]


def make_micro_batches(seed: int = 0) -> list[dict]:
    """Four micro-batches of different sizes and lengths (padding on either side), so that every layout's
    data-parallel ranks run as many as each other (the ranks of an expert-parallel group exchange tokens in
    every one)."""
    g = torch.Generator().manual_seed(seed)
    batches = []
    for b, s in [(2, 10), (3, 7), (2, 13), (1, 9)]:
        ids = torch.randint(0, 49152, (b, s), generator=g)
        batches.append({"input_ids": ids, "attention_mask": torch.ones(b, s, dtype=torch.long)})
    batches[0]["attention_mask"][1, 6:] = 0
    batches[1]["attention_mask"][0, :2] = 0
    batches[2]["attention_mask"][1, :5] = 0
    total = 0.0
    for mb in batches:
        mask = mb["attention_mask"].clone().float()
        mask[torch.arange(mask.shape[0]), mb["attention_mask"].argmax(1)] = 0  # no loss on each row's first token
        mb["loss_mask"] = mask
        mb["adv"] = torch.randn(mb["input_ids"].shape, generator=g)
        total += float(mask.sum())
    for mb in batches:
        mb["n_global"] = total
    return batches


# verl's keys (megatron.override_transformer_config) turning on the load-balancing loss and the z-loss
AUX_LOSSES = dict(moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.05, moe_z_loss_coeff=0.01)


def router_losses(logits: torch.Tensor, topk: int) -> torch.Tensor:
    """One layer's load-balancing loss (the switch loss, megatron's normalisation) plus z-loss on one micro-batch's
    router logits ``[T, E]``, written out from their definitions."""
    tokens, experts = logits.shape
    probs = torch.softmax(logits, dim=-1)
    routed = torch.zeros_like(probs).scatter(1, probs.topk(topk, dim=-1).indices, 1.0).sum(0)
    balance = experts * AUX_LOSSES["moe_aux_loss_coeff"] / (topk * tokens**2) * (probs.sum(0) * routed).sum()
    return balance + AUX_LOSSES["moe_z_loss_coeff"] * (torch.logsumexp(logits, dim=-1) ** 2).mean()


def hf_reference(path: Path, batches: list[dict], aux: bool = False, routes: list[torch.Tensor] | None = None
                 ) -> tuple[list[dict], float, dict, list[torch.Tensor]]:
    """HF's outputs, total loss, gradients under the checkpoint's names (transformers keeps the experts of
    a layer fused in memory; ``revert_weight_conversion`` names them per expert as its checkpoints do) and the
    experts its routers chose (per micro-batch ``[b, s, L, k]``). With ``aux`` each micro-batch adds its layers'
    ``router_losses`` over its valid tokens divided by the number of micro-batches: their mean over micro-batches
    (and, split over DP ranks, over those). With ``routes`` (per micro-batch ``[b, s, L, k]``) each router sends a
    token to those experts unless they are ``NATIVE``, its weights the softmax of its own logits at them
    (renormalised with ``norm_topk_prob`` and always for Mixtral), or for DeepSeek-V3 their sigmoid renormalised
    and scaled by ``routed_scaling_factor``: router replay written out on HF's router. ``L`` counts every decoder
    layer; a dense layer's routes are ``NATIVE``."""
    from transformers.core_model_loading import revert_weight_conversion

    model = hf_model(path, critic=False)
    # (decoder layer, router): "model.layers.{i}.mlp.gate"
    routers = [(int(name.split(".")[2]), m) for name, m in model.named_modules() if name.endswith("mlp.gate")]
    captured: list[torch.Tensor] = []
    chosen: list[dict[int, torch.Tensor]] = []
    current: list[torch.Tensor] = []  # this micro-batch's forced routes, flattened [b * s, L, k]

    def route(layer: int, module, args, output):
        logits, weights, indices = output
        captured.append(logits)
        chosen[-1][layer] = indices.detach()
        if not current:
            return output
        forced = current[0][:, layer].long()
        indices = torch.where((forced >= 0).all(dim=1, keepdim=True), forced, indices)
        if hasattr(module, "e_score_correction_bias"):  # DeepSeek-V3: the sigmoid scores, without the bias
            weights = logits.sigmoid().gather(1, indices)
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * module.routed_scaling_factor
            return logits, weights.to(logits.dtype), indices
        weights = torch.softmax(logits, dim=-1, dtype=torch.float).gather(1, indices)
        if getattr(module, "norm_topk_prob", True):  # Mixtral's router always renormalises
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return logits, weights.to(logits.dtype), indices

    for layer, router in routers:
        router.register_forward_hook(functools.partial(route, layer))
    outputs, total = [], 0.0
    for index, mb in enumerate(batches):
        captured.clear()
        chosen.append({})
        current[:] = [] if routes is None else [routes[index].reshape(-1, *routes[index].shape[2:])]
        out = hf_outputs(model, mb, critic=False)
        loss, _ = policy_loss(out, mb)
        if aux:
            valid = mb["attention_mask"].reshape(-1).bool()
            for logits in captured:
                loss = loss + router_losses(logits[valid], model.config.num_experts_per_tok) / len(batches)
        loss.backward()
        total += float(loss)
        outputs.append({k: v.detach() for k, v in out.items()})
    # every layer routes, but DeepSeek-V3's first_k_dense_replace dense ones
    assert len(captured) == len(routers) == model.config.num_hidden_layers - getattr(model.config,
                                                                                    "first_k_dense_replace", 0)
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    shape = [tuple(mb["input_ids"].shape) for mb in batches]
    natives = []
    for layers, size in zip(chosen, shape):
        native = torch.full((*size, model.config.num_hidden_layers, model.config.num_experts_per_tok),
                            router_replay.NATIVE, dtype=torch.long)
        for layer, indices in layers.items():
            native[:, :, layer] = indices.view(*size, -1)
        natives.append(native)
    return outputs, total, revert_weight_conversion(model, grads), natives


def _train_pass(chunks, batches: list[dict], path: Path, ref_loss: float, ref_grads: dict) -> dict:
    """Loss and every gradient of one packed forward-backward against HF's."""
    for chunk in chunks:
        chunk.zero_grad_buffer()
    passed = schedule.forward_backward(chunks, batches, policy_loss, OutputRequest(entropy=True, remove_padding=True))
    grads = hf_tensors(chunks, path, grads=True)
    return {"loss": abs(passed.loss - ref_loss), "grad_names_mismatch": len(set(ref_grads) ^ set(grads)),
            "grads": max(float((grads[k] - ref_grads[k]).abs().max()) for k in ref_grads if k in grads)}


def check_family(path: Path, aux: bool = False, replay: bool = True, sequence_parallel: bool = False) -> dict:
    """Outputs, loss, gradients and export against HF; with ``aux`` also the loss and gradients with verl's
    load-balancing and z-loss keys set (``aux_*``; at TP 1, where the packed micro-batches hold exactly the
    valid tokens the reference routes), and how far those losses move the gradients (``aux_effect``); with
    ``sequence_parallel`` the model runs megatron's sequence parallelism (its MoE layer on each TP rank's sequence
    shard instead of meshrl's TP-split one)."""
    batches = make_micro_batches()
    ref_out, ref_loss, ref_grads, ref_routes = hf_reference(path, batches)
    dp, rank = state.dp_size(), state.dp_rank()
    mine, mine_ref = batches[rank::dp], ref_out[rank::dp]
    chunks = build(path, sequence_parallel=sequence_parallel)
    result = {"sequence_parallel": int(model_builder.model_config(chunks).sequence_parallel)}
    for remove_padding in (False, True):
        out = schedule.forward_only(chunks, mine, OutputRequest(entropy=True, remove_padding=remove_padding))
        tag = "packed_" if remove_padding else ""
        for key in ("log_probs", "entropy"):
            result[tag + key] = max(float((o[key] - r[key]).abs().max()) for o, r in zip(out, mine_ref))
    # before the training pass: megatron moves DeepSeek-V3's expert bias (a buffer) at the end of it
    original = hf_conversion.HFCheckpointReader(path)
    weights = hf_tensors(chunks, path)
    result["export_mismatches"] = (len(set(original.file_of) ^ set(weights))
                                   + sum(not torch.equal(original.read(n), weights[n]) for n in weights))
    result.update(_train_pass(chunks, mine, path, ref_loss, ref_grads))
    if model_builder.unwrap(chunks[0]).meshrl_spec.moe_expert_bias:
        # megatron moved each expert's bias by +-moe_router_bias_update_rate (1e-3) after the pass, towards balanced
        # loads (0 for an expert at exactly the mean), and the export carries it
        moved = hf_tensors(chunks, path)
        result["expert_bias_step"] = max(abs(float((moved[n] - original.read(n)).abs().max()) - 1e-3)
                                         for n in moved if n.endswith("e_score_correction_bias"))
    result["planned_parameters"] = abs(planned_parameters(path) - sum(
        p.numel() for chunk in chunks for p in model_builder.unwrap(chunk).parameters()))
    if aux:
        _, _, aux_grads, _ = hf_reference(path, batches, aux=True)
        # the pass's loss is the policy loss: the router losses enter through their gradients only
        passed = _train_pass(build(path, **AUX_LOSSES), mine, path, ref_loss, aux_grads)
        result.update({f"aux_{key}": value for key, value in passed.items()})
        result["aux_effect"] = max(float((aux_grads[k] - ref_grads[k]).abs().max()) for k in ref_grads)
    if replay:
        result.update(check_replay(path, chunks, batches, ref_out, ref_routes[rank::dp]))
    return result


def planned_parameters(path: Path) -> int:
    """``meshrl plan``'s count of this rank's parameters (its stage, its experts' shards) at the current layout."""
    from megatron.core import parallel_state as ps
    from transformers import AutoConfig

    from meshrl.memory_plan import stage_parameters

    return stage_parameters(model_builder.model_spec(AutoConfig.from_pretrained(path)),
                            tp=ps.get_tensor_model_parallel_world_size(),
                            pp=ps.get_pipeline_model_parallel_world_size(),
                            stage=ps.get_pipeline_model_parallel_rank(), ep=ps.get_expert_model_parallel_world_size(),
                            etp=ps.get_expert_tensor_parallel_world_size())


def forced_routes(batches: list[dict], num_layers: int, experts: int, topk: int, seed: int = 1) -> list[torch.Tensor]:
    """Per micro-batch ``[b, s, L, k]``: random distinct experts for every valid token and layer (far from what the
    routers would choose), ``NATIVE`` on padding and on every row's last valid token (routed as usual)."""
    g = torch.Generator().manual_seed(seed)
    routes = []
    for mb in batches:
        b, s = mb["input_ids"].shape
        forced = torch.rand((b, s, num_layers, experts), generator=g).argsort(dim=-1)[..., :topk]
        mask = mb["attention_mask"].bool()
        forced[~mask] = router_replay.NATIVE
        last = s - 1 - mask.flip(1).long().argmax(1)
        forced[torch.arange(b), last] = router_replay.NATIVE
        routes.append(forced)
    return routes


def check_replay(path: Path, chunks, batches: list[dict], native_out: list[dict], native_routes: list) -> dict:
    """Router replay against HF's router forced to the same experts: the routes recorded in a forward pass are
    HF's own choices (``replay_recorded_mismatches``: valid tokens x layers that differ); with random forced routes,
    log-probs and entropies (rows and packed) and one packed forward-backward's loss and gradients match HF forced
    (``replay_*``; ``replay_recompute_*`` with full activation recompute), and the forcing moved the log-probs
    (``replay_effect``, so the checks bite)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    routes = forced_routes(batches, config.num_hidden_layers, config.num_local_experts
                           if hasattr(config, "num_local_experts") else config.num_experts,
                           config.num_experts_per_tok)
    ref_out, ref_loss, ref_grads, _ = hf_reference(path, batches, routes=routes)
    dp, rank = state.dp_size(), state.dp_rank()
    mine, mine_ref, mine_native = batches[rank::dp], ref_out[rank::dp], native_out[rank::dp]
    router_replay.install(chunks)
    with router_replay.recording(chunks) as record:
        schedule.forward_only(chunks, mine, OutputRequest(remove_padding=True))
        recorded = record.gather(mine)
    result = {"replay_recorded_mismatches": sum(
        int((got.long().sort(-1).values != want.sort(-1).values).any(-1)[mb["attention_mask"].bool()].sum())
        for got, want, mb in zip(recorded, native_routes, mine))}
    forced = [{**mb, router_replay.ROUTES: r} for mb, r in zip(mine, routes[rank::dp])]
    for remove_padding in (False, True):
        out = schedule.forward_only(chunks, forced, OutputRequest(entropy=True, remove_padding=remove_padding))
        tag = "replay_packed_" if remove_padding else "replay_"
        for key in ("log_probs", "entropy"):
            result[tag + key] = max(float((o[key] - r[key]).abs().max()) for o, r in zip(out, mine_ref))
    result["replay_effect"] = min(float((r["log_probs"] - n["log_probs"]).abs().max())
                                  for r, n in zip(mine_ref, mine_native))
    result.update({f"replay_{k}": v for k, v in _train_pass(chunks, forced, path, ref_loss, ref_grads).items()})
    # full activation recompute: the backward runs every layer again, outside the forward step
    recomputing = build(path, recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1,
                        sequence_parallel=model_builder.model_config(chunks).sequence_parallel)
    router_replay.install(recomputing)
    passed = _train_pass(recomputing, forced, path, ref_loss, ref_grads)
    result.update({f"replay_recompute_{k}": v for k, v in passed.items()})
    return result


def _train(chunks, opt, sched, batches: list[dict]) -> None:
    """One optimizer step on this DP rank's share of ``batches`` (the same global gradient at every layout)."""
    mine = batches[state.dp_rank()::state.dp_size()]
    optimizer.train_step(chunks, opt, sched, mine, policy_loss, OutputRequest(entropy=True, remove_padding=True))


def check_checkpoint_save(path: Path, workdir: Path) -> dict:
    """Two updates, a distributed checkpoint (experts sharded by EP rank), a third update whose weights the layouts
    that load the checkpoint must reproduce."""
    from safetensors.torch import save_file

    batches = make_micro_batches()
    chunks = build(path)
    opt, sched = optimizer.build_optimizer(chunks, OPT)
    for _ in range(2):
        _train(chunks, opt, sched, batches)
    checkpoint.save_checkpoint(workdir / "ckpt", 2, chunks, opt, sched)
    _train(chunks, opt, sched, batches)
    weights = hf_tensors(chunks, path)
    if dist.get_rank() == 0:
        save_file({k: v.contiguous() for k, v in weights.items()}, str(workdir / "step3.safetensors"))
    dist.barrier()
    moved = hf_conversion.HFCheckpointReader(path)
    return {"moved": max(float((weights[k] - moved.read(k)).abs().max()) for k in weights)}


def check_checkpoint_load(path: Path, workdir: Path) -> dict:
    """The checkpoint saved at EP2 loaded at this layout (model, optimizer, schedule), then update 3."""
    from safetensors.torch import load_file

    chunks = build(path)
    opt, sched = optimizer.build_optimizer(chunks, OPT)
    loaded = checkpoint.load_checkpoint(workdir / "ckpt", chunks, opt, sched)
    _train(chunks, opt, sched, make_micro_batches())
    weights, reference = hf_tensors(chunks, path), load_file(str(workdir / "step3.safetensors"))
    return {"weights": max(float((weights[k] - reference[k]).abs().max()) for k in reference), "step": loaded["step"]}


def check_checkpoint_refused(path: Path, workdir: Path) -> dict:
    """The checkpoint saved at EP2 (a chained optimizer: the experts' apart) offered to this EP1 layout's single
    optimizer: refused naming both sizes before anything loads; the model's weights alone still load."""
    chunks = build(path)
    opt, sched = optimizer.build_optimizer(chunks, OPT)
    try:
        checkpoint.load_checkpoint(workdir / "ckpt", chunks, opt, sched)
    except ValueError as error:
        message = str(error)
    else:
        message = ""
    weights_only = checkpoint.load_checkpoint(workdir / "ckpt", chunks)
    return {"refused": int("expert_model_parallel_size=2" in message and "expert_model_parallel_size=1" in message
                           and "2 megatron optimizer(s)" in message), "weights_step": weights_only["step"]}


def run_phase(layout: dict, families: tuple[str, ...], aux: bool, ckpt: str | None, workdir: Path) -> dict:
    state.initialize(state.ParallelConfig(timeout_s=TIMEOUT_S, **layout))
    values: dict[str, object] = {}
    for model_type in families:
        start = time.monotonic()
        try:
            # replay's layout-dependent parts (TP shares, pipeline stages) with one family; every family in process
            found = check_family(tiny_model_dir(tiny_spec(model_type)), aux and model_type in SOFTMAX_FAMILIES,
                                 replay=model_type == REPLAY_FAMILY)
            values.update({f"{model_type}.{k}": v for k, v in found.items()})
        except Exception:  # recorded, reported by pytest
            values[f"{model_type}.error"] = f"rank {dist.get_rank()}: {traceback.format_exc()}"
        print(f"[rank {dist.get_rank()}] {model_type}: {time.monotonic() - start:.1f}s", file=sys.stderr, flush=True)
    if layout.get("tensor_parallel", 1) > 1 and SP_FAMILY in families:  # megatron's sequence parallelism, once
        try:
            found = check_family(tiny_model_dir(tiny_spec(SP_FAMILY)), sequence_parallel=True)
            values.update({f"{SP_FAMILY}_sp.{k}": v for k, v in found.items()})
        except Exception:  # recorded, reported by pytest
            values[f"{SP_FAMILY}_sp.error"] = f"rank {dist.get_rank()}: {traceback.format_exc()}"
    if ckpt is not None:  # Qwen2-MoE's checkpoint: saved at EP2, loaded at other expert layouts
        check = {"save": check_checkpoint_save, "load": check_checkpoint_load, "refuse": check_checkpoint_refused}[ckpt]
        try:
            found = check(tiny_model_dir(tiny_spec("qwen2_moe")), workdir)
            values.update({f"checkpoint.{k}": v for k, v in found.items()})
        except Exception:  # recorded, reported by pytest
            values["checkpoint.error"] = f"rank {dist.get_rank()}: {traceback.format_exc()}"
    state.destroy()
    return values


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--workdir", required=True, type=Path)
    parser.add_argument("--extended", action="store_true", help="run EXTENDED_PHASES instead of PHASES")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=TIMEOUT_S))
    phases = EXTENDED_PHASES if args.extended else PHASES
    if dist.get_rank() == 0:
        for model_type in {family for _, _, families, *_ in phases for family in families}:
            tiny_model_dir(tiny_spec(model_type))
    dist.barrier()
    mine = {name: run_phase(layout, families, aux, ckpt, args.workdir) for name, layout, families, aux, ckpt in phases}
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    if dist.get_rank() == 0:
        args.out.write_text(json.dumps({name: merge([ranks[name] for ranks in every]) for name in mine}, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
