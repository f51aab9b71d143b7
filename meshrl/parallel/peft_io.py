"""LoRA adapters (``meshrl.parallel.lora``) <-> PEFT's format, and the merged weights the engine serves.

PEFT's folder: ``adapter_config.json`` (``peft_type: LORA``, ``r``, ``lora_alpha``, ``target_modules``, ...)
and ``adapter_model.safetensors`` with, per adapted HF module ``model.layers.N.<parent>.<name>``,

    base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight   [r, in]
    base_model.model.model.layers.N.self_attn.q_proj.lora_B.weight   [out, r]

A fused adapter with one A for q/k/v (``shared_a``) is written with a copy of that A for each part, which
PEFT computes identically; loading it back needs those copies equal.

- ``iter_adapter_weights(chunks)``: ``(peft_key, full tensor)`` of every adapter tensor, TP-gathered and
  broadcast from the pipeline stage holding its layer, on every rank of the model-parallel group (which
  must all iterate it, in lockstep, like ``hf_conversion.iter_hf_weights``).
- ``save_adapter`` / ``load_adapter``: the PEFT folder, written by the group's first rank; each rank
  reads only its shard.
- ``iter_merged_weights(chunks, hf_config)``: ``iter_hf_weights`` with ``W + scaling * B @ A`` for
  every adapted weight (computed in fp32 one weight at a time, cast to the weight's dtype): what the rollout
  engine serves.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist

from meshrl.atomic_io import publish_dir
from meshrl.config.lora_keys import HF_PARENT
from meshrl.parallel.lora import HF_TARGETS, SHARED, LoraAdapter, LoraSettings, adapters, full_shape
from meshrl.parallel.model_builder import unwrap

PREFIX = "base_model.model."
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"


def settings_of(chunks: list[torch.nn.Module]) -> LoraSettings:
    settings = getattr(unwrap(chunks[0]), "meshrl_lora", None)
    if settings is None:
        raise ValueError("these model chunks have no LoRA adapters (lora.apply_lora)")
    return settings


def module_path(layer: int, part: str) -> str:
    """HF module path of adapter ``part`` (an HF module name) of global layer ``layer``."""
    return f"model.layers.{layer}.{HF_PARENT[part]}.{part}"


def _keys(num_layers: int, settings: LoraSettings) -> list[tuple[int, str, str]]:
    """(layer, part, "A" | "B") of every adapter tensor of the model, in PEFT's order."""
    return [(layer, part, which) for layer in range(num_layers) for part in HF_TARGETS if part in settings.targets
            for which in ("A", "B")]


def _peft_key(layer: int, part: str, which: str) -> str:
    return f"{PREFIX}{module_path(layer, part)}.lora_{which}.weight"


def _local(chunks: list[torch.nn.Module]) -> dict[tuple[int, str, str], tuple[LoraAdapter, torch.nn.Parameter]]:
    """This rank's adapter tensors by (global layer, part, A | B)."""
    found = {}
    for _, adapter in adapters(chunks):
        for part in adapter.parts:
            found[(adapter.global_layer, part, "A")] = (adapter, adapter.a_of(part))
            found[(adapter.global_layer, part, "B")] = (adapter, adapter.lora_B[part])
    return found


def _split_dim(adapter: LoraAdapter, which: str) -> int | None:
    """The dimension TP splits: a row-parallel layer's A on its input, a column-parallel layer's B on its output."""
    if adapter.tp == 1:
        return None
    if which == "A":
        return 1 if adapter.row_parallel else None
    return None if adapter.row_parallel else 0


@torch.no_grad()
def iter_adapter_weights(chunks: list[torch.nn.Module], grads: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(peft_key, full tensor)`` for every adapter tensor (see the module docstring for the contract);
    with ``grads=True`` their accumulated gradients (DDP ``main_grad``) instead, for checks."""
    from megatron.core import parallel_state

    settings = settings_of(chunks)
    gpt = unwrap(chunks[0])
    local = _local(chunks)
    tp_group = parallel_state.get_tensor_model_parallel_group()
    pp_group = parallel_state.get_pipeline_model_parallel_group()
    pp_ranks = dist.get_process_group_ranks(pp_group)
    owners = [None] * len(pp_ranks)
    dist.all_gather_object(owners, sorted({layer for layer, _, _ in local}), group=pp_group)
    owner_of = {layer: pp_ranks[stage] for stage, layers in enumerate(owners) for layer in layers}
    sample = next(iter(local.values()))[1]
    sample = sample.main_grad if grads else sample
    spec = gpt.meshrl_spec
    for layer, part, which in _keys(spec.num_layers, settings):
        if (layer, part, which) in local:
            adapter, param = local[(layer, part, which)]
            param = param.main_grad if grads else param
            dim = _split_dim(adapter, which)
            if dim is None:
                tensor = param.detach().clone()
            else:
                shards = [torch.empty_like(param) for _ in range(adapter.tp)]
                dist.all_gather(shards, param.detach().contiguous(), group=tp_group)
                tensor = torch.cat(shards, dim=dim)
        else:
            tensor = torch.empty(full_shape(spec, part, which, settings.rank), dtype=sample.dtype,
                                 device=sample.device)
        if len(pp_ranks) > 1:
            dist.broadcast(tensor, src=owner_of[layer], group=pp_group)
        yield _peft_key(layer, part, which), tensor
        del tensor


def adapter_config(settings: LoraSettings, base_model: str | None) -> dict:
    """PEFT's ``LoraConfig`` fields for ``settings`` (``lora_alpha / r`` is the scaling)."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": settings.rank, "lora_alpha": settings.alpha,
            "lora_dropout": settings.dropout, "target_modules": list(settings.targets), "bias": "none",
            "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "inference_mode": True,
            "init_lora_weights": True, "base_model_name_or_path": base_model}


def save_adapter(chunks: list[torch.nn.Module], out_dir: str | os.PathLike,
                 base_model: str | None = None) -> Path | None:
    """Write the adapters as a PEFT folder (atomically; an existing one is replaced); collective over the
    model-parallel group, whose first rank writes. Returns the folder there, None elsewhere."""
    from megatron.core import parallel_state
    from safetensors.torch import save_file

    settings = settings_of(chunks)
    writer = dist.get_rank(parallel_state.get_model_parallel_group()) == 0
    tensors = {key: tensor.cpu() for key, tensor in iter_adapter_weights(chunks)}
    if not writer:
        return None
    out = Path(out_dir)
    tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
    (tmp / CONFIG_FILE).write_text(json.dumps(adapter_config(settings, base_model), indent=2))
    publish_dir(tmp, out, aside=out.with_name(f"{out.name}.tmp-{os.getpid()}-replaced"))
    return out


def check_adapter_config(folder: Path, settings: LoraSettings) -> None:
    """Raise ``ValueError`` naming each field of the folder's config that differs from ``settings``."""
    config = json.loads((folder / CONFIG_FILE).read_text())
    targets = config.get("target_modules")
    targets = sorted(targets) if isinstance(targets, list) else targets
    want = {"peft_type": "LORA", "r": settings.rank, "lora_alpha": settings.alpha,
            "target_modules": sorted(settings.targets)}
    have = {"peft_type": config.get("peft_type"), "r": config.get("r"), "lora_alpha": config.get("lora_alpha"),
            "target_modules": targets}
    wrong = [f"{key}: adapter {have[key]!r}, run {value!r}" for key, value in want.items() if have[key] != value]
    if config.get("use_dora") or config.get("use_rslora"):
        wrong.append("the adapter uses DoRA / rsLoRA, which meshrl does not build")
    if wrong:
        raise ValueError(f"the LoRA adapter in {folder} does not fit this run's LoRA settings ("
                         + "; ".join(wrong) + "): set the run's lora rank / alpha / target_modules to the adapter's")


@torch.no_grad()
def load_adapter(chunks: list[torch.nn.Module], folder: str | os.PathLike) -> None:
    """Copy this rank's shard of the PEFT adapter in ``folder`` into the chunks' adapters."""
    from megatron.core import parallel_state
    from safetensors import safe_open

    folder = Path(folder)
    check_adapter_config(folder, settings_of(chunks))
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    with safe_open(folder / WEIGHTS_FILE, framework="pt") as handle:
        names = set(handle.keys())
        for (layer, part, which), (adapter, param) in _local(chunks).items():
            key = _peft_key(layer, part, which)
            if key not in names:
                raise ValueError(f"the LoRA adapter in {folder} has no {key}")
            tensor = handle.get_tensor(key)
            dim = _split_dim(adapter, which)
            if dim is not None:
                tensor = tensor.chunk(adapter.tp, dim=dim)[tp_rank]
            if tuple(tensor.shape) != tuple(param.shape):
                raise ValueError(f"{key} has shape {tuple(tensor.shape)}, the model's adapter needs "
                                 f"{tuple(param.shape)} (TP shard)")
            # A shared A was already copied from the layer's first part: the others must be copies of it.
            shared_copy = which == "A" and SHARED in adapter.lora_A and part != adapter.parts[0]
            if shared_copy and not torch.equal(tensor.to(param.dtype), param):
                raise ValueError(f"{key} differs from the {adapter.parts[0]} A of the same layer, but this run's "
                                 "fused LoRA shares one A across them: load it with per-module adapters "
                                 "(lora.type=canonical_lora, or the FSDP keys)")
            param.copy_(tensor)


def adapter_pairs(chunks: list[torch.nn.Module]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """HF weight name -> the full (A, B) of its adapter; collective like ``iter_adapter_weights``. Holds the
    adapters only (``r * (in + out)`` per adapted weight), never a weight-sized delta."""
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in iter_adapter_weights(chunks):
        module, which = key[len(PREFIX):].rsplit(".lora_", 1)
        pairs.setdefault(f"{module}.weight", {})[which.split(".")[0]] = tensor
    return {name: (pair["A"], pair["B"]) for name, pair in pairs.items()}


def iter_merged_weights(chunks: list[torch.nn.Module], hf_config) -> Iterator[tuple[str, torch.Tensor]]:
    """``hf_conversion.iter_hf_weights`` with each adapted weight merged, ``W + scaling * B @ A``: the delta is
    formed in fp32 for one weight at a time and added to the stream's fresh buffer in place."""
    from meshrl.parallel.hf_conversion import iter_hf_weights

    scaling = settings_of(chunks).scaling
    pairs = adapter_pairs(chunks)
    for name, tensor in iter_hf_weights(chunks, hf_config):
        pair = pairs.pop(name, None)
        if pair is not None:
            a, b = (t.to(device=tensor.device, dtype=torch.float32) for t in pair)
            delta = torch.mm(b, a).mul_(scaling)
            if tensor.dtype == torch.float32:
                tensor.add_(delta)
            else:
                tensor.copy_(delta.add_(tensor))
            del delta
        yield name, tensor
        del tensor
    if pairs:
        raise ValueError(f"adapted weights missing from the model's HF tensors: {sorted(pairs)[:4]}")
