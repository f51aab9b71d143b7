"""LoRA adapters (``meshrl.parallel.lora``) <-> PEFT's format, and the merged weights the engine serves.

PEFT's folder: ``adapter_config.json`` (``peft_type: LORA``, ``r``, ``lora_alpha``, ``target_modules``, ...)
and ``adapter_model.safetensors`` with, per adapted HF module ``model.layers.N.<module>.<name>`` (a
vision-language model's language model is ``model.language_model``, and its vision tower is excluded),

    base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight   [r, in]
    base_model.model.model.layers.N.self_attn.q_proj.lora_B.weight   [out, r]

A fused adapter with one A for q/k/v (``shared_a``) is written with a copy of that A for each part, which
PEFT computes identically; loading it back needs those copies equal. A shared expert's adapters are those of its
HF module (``mlp.shared_expert.gate_proj``).

Routed experts (transformers 5 holds them as 3-D parameters ``mlp.experts.gate_up_proj [E, 2I, H]`` and
``down_proj [E, H, I]``) are written as PEFT's ``target_parameters`` adapters: for each, ``lora_A [r*E, in]`` with
expert e's A in rows ``e*r .. e*r+r`` and ``lora_B [out, r*E]`` with expert e's B in columns ``e, e+E, ...``
(PEFT's ``ParamWrapper`` reshapes them to ``[E, r, in]`` and ``[out, r, E]``), ``gate_up_proj``'s B rows being
``[B_gate; B_up]``. PEFT nests the wrappers in the module's parameter order, so with both targeted ``gate_up_proj``'s
keys read ``mlp.experts.base_layer.lora_A.weight`` and ``down_proj``'s ``mlp.experts.lora_A.weight``.

- ``iter_adapter_weights(chunks)``: ``(peft_key, full tensor)`` of every adapter tensor, TP-gathered, broadcast
  from the expert-parallel rank holding a routed expert's and from the pipeline stage holding its layer, on every
  rank of the model-parallel group and (with expert parallelism) of the expert-parallel group, which must all
  iterate it, in lockstep, like ``hf_conversion.iter_hf_weights``.
- ``save_adapter`` / ``load_adapter``: the PEFT folder, written by the group's first rank; each rank
  reads only its shard.
- ``iter_merged_weights(chunks, hf_config)``: ``iter_hf_weights`` with ``W + scaling * B @ A`` for
  every adapted weight (a routed expert's per expert, under the checkpoint's own names), computed in fp32 one
  weight at a time, cast to the weight's dtype: what the rollout engine serves.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Iterator, NamedTuple

import torch
import torch.distributed as dist

from meshrl.atomic_io import publish_dir
from meshrl.config.lora_keys import EXPERT_PARAMETERS, ROUTER_PARAMETER
from meshrl.parallel.lora import EXPERTS_MODULE, HF_TARGETS, SHARED, LoraAdapter, LoraSettings, adapters
from meshrl.parallel.model_builder import unwrap

PREFIX = "base_model.model."
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
# PEFT's expert parameters, in the HF module's parameter order, and the HF parts each holds
EXPERT_PARAMS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
MODULE_ORDER = ("self_attn", "mlp")  # within a layer; a shared expert's module sorts after mlp, the experts last


class Key(NamedTuple):
    """One adapter tensor of one HF module: its layer, HF module (``self_attn``, ``mlp``, ``mlp.shared_expert``,
    ``mlp.experts``), routed expert (-1: none), HF part and ``A`` | ``B``. Tuples sort in PEFT's order."""

    layer: int
    module: str
    expert: int
    part: str
    which: str

    @property
    def sort_key(self) -> tuple:
        module = MODULE_ORDER.index(self.module) if self.module in MODULE_ORDER else 2 + (self.module == EXPERTS_MODULE)
        part = HF_TARGETS.index(self.part) if self.part in HF_TARGETS else len(HF_TARGETS)  # the router's last
        return self.layer, module, self.expert, part, self.which


def settings_of(chunks: list[torch.nn.Module]) -> LoraSettings:
    settings = getattr(unwrap(chunks[0]), "meshrl_lora", None)
    if settings is None:
        raise ValueError("these model chunks have no LoRA adapters (lora.apply_lora)")
    return settings


def _layers(chunks: list[torch.nn.Module]) -> str:
    """The start of PEFT's key of an adapter in decoder layer N: ``{_layers}.N.<module>...`` (the language model's
    module path: a vision-language model's sits under ``model.language_model``)."""
    return f"{PREFIX}{unwrap(chunks[0]).meshrl_spec.lm_module_prefix}layers"


def _peft_key(key: Key, layers: str) -> str:
    return f"{layers}.{key.layer}.{key.module}.{key.part}.lora_{key.which}.weight"


def _expert_peft_key(layers: str, layer: int, param: str, which: str, params: tuple[str, ...]) -> str:
    """PEFT's key of routed-expert parameter ``param`` among the targeted ``params`` (nesting: module docstring)."""
    nesting = "base_layer." * (len(params) - 1 - params.index(param))
    return f"{layers}.{layer}.{EXPERTS_MODULE}.{nesting}lora_{which}.weight"


def expert_params(settings: LoraSettings) -> tuple[str, ...]:
    """The routed experts' parameters ``settings`` adapts (PEFT's ``target_parameters`` names, module order)."""
    if not settings.experts:
        return ()
    return tuple(name for name, parts in EXPERT_PARAMS.items() if parts[0] in settings.targets)


def target_parameters(settings: LoraSettings) -> list[str]:
    """PEFT's ``target_parameters`` of an MoE model's adapters: the routed experts' and the router's weight."""
    return sorted([f"{EXPERTS_MODULE}.{name}" for name in expert_params(settings)]
                  + ([ROUTER_PARAMETER] if settings.router else []))


def _parameter_name(name: str) -> str:
    """PEFT writes a matched parameter in full (``mlp.experts.down_proj``) and short (``down_proj``): the full one."""
    for full in (*EXPERT_PARAMETERS, ROUTER_PARAMETER):
        if full == name or full.endswith(f".{name}") and name != "weight":
            return full
    return name


def _local(chunks: list[torch.nn.Module]) -> dict[Key, tuple[LoraAdapter, torch.nn.Parameter]]:
    """This rank's adapter tensors by key (a shared A under each of its parts)."""
    found = {}
    for _, adapter in adapters(chunks):
        expert = -1 if adapter.expert is None else adapter.expert
        for part in adapter.parts:
            found[Key(adapter.global_layer, adapter.hf_module, expert, part, "A")] = (adapter, adapter.a_of(part))
            found[Key(adapter.global_layer, adapter.hf_module, expert, part, "B")] = (adapter, adapter.lora_B[part])
    return found


def _split_dim(adapter: LoraAdapter, which: str) -> int | None:
    """The dimension TP splits: a row-parallel layer's A on its input, a column-parallel layer's B on its output."""
    if adapter.tp == 1:
        return None
    if which == "A":
        return 1 if adapter.row_parallel else None
    return None if adapter.row_parallel else 0


def _full_shape(adapter: LoraAdapter, param: torch.Tensor, which: str) -> tuple[int, ...]:
    dim = _split_dim(adapter, which)
    shape = list(param.shape)
    if dim is not None:
        shape[dim] *= adapter.tp
    return tuple(shape)


@torch.no_grad()
def _iter_tensors(chunks: list[torch.nn.Module], grads: bool = False) -> Iterator[tuple[Key, torch.Tensor]]:
    """``(key, full tensor)`` of every adapter tensor of the model, in ``Key.sort_key`` order (collective: see
    ``iter_adapter_weights``)."""
    from megatron.core import parallel_state

    local = _local(chunks)
    pp_group = parallel_state.get_pipeline_model_parallel_group()
    ep_group = parallel_state.get_expert_model_parallel_group()
    pp_ranks, ep_ranks = dist.get_process_group_ranks(pp_group), dist.get_process_group_ranks(ep_group)
    # every key's full shape and owner (PP stage, EP rank): gathered over the stages, then over the EP ranks
    mine = {key: _full_shape(adapter, param, key.which) for key, (adapter, param) in local.items()}
    by_stage: list = [None] * len(pp_ranks)
    dist.all_gather_object(by_stage, mine, group=pp_group)
    stages = {key: (stage, shape) for stage, keys in enumerate(by_stage) for key, shape in keys.items()}
    by_ep: list = [None] * len(ep_ranks)
    if len(ep_ranks) > 1:
        dist.all_gather_object(by_ep, stages, group=ep_group)
    else:
        by_ep = [stages]
    owners = {key: (stage, ep, shape) for ep, keys in enumerate(by_ep) for key, (stage, shape) in keys.items()
              if key.expert >= 0 or ep == 0}
    my_pp = parallel_state.get_pipeline_model_parallel_rank()
    sample = next(iter(local.values()))[1]
    sample = sample.main_grad if grads else sample
    for key in sorted(owners, key=lambda k: k.sort_key):
        stage, ep, shape = owners[key]
        if key in local:
            adapter, param = local[key]
            param = param.main_grad if grads else param
            dim = _split_dim(adapter, key.which)
            if dim is None:
                tensor = param.detach().clone()
            else:
                shards = [torch.empty_like(param) for _ in range(adapter.tp)]
                dist.all_gather(shards, param.detach().contiguous(), group=adapter.tp_group)
                tensor = torch.cat(shards, dim=dim)
        else:
            tensor = torch.empty(shape, dtype=sample.dtype, device=sample.device)
        if key.expert >= 0 and len(ep_ranks) > 1 and stage == my_pp:
            dist.broadcast(tensor, src=ep_ranks[ep], group=ep_group)
        if len(pp_ranks) > 1:
            dist.broadcast(tensor, src=pp_ranks[stage], group=pp_group)
        yield key, tensor
        del tensor


def _expert_tensors(layers: str, layer: int, found: dict[Key, torch.Tensor], params: tuple[str, ...]
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    """PEFT's ``(key, tensor)`` of one layer's routed-expert adapters from each expert's A and B."""
    experts = sorted({key.expert for key in found})
    for param in params:
        parts = EXPERT_PARAMS[param]
        a = torch.cat([found[Key(layer, EXPERTS_MODULE, e, parts[0], "A")] for e in experts])
        b = torch.stack([torch.cat([found[Key(layer, EXPERTS_MODULE, e, part, "B")] for part in parts])
                         for e in experts], dim=-1)  # [out, r, E]
        yield _expert_peft_key(layers, layer, param, "A", params), a
        yield _expert_peft_key(layers, layer, param, "B", params), b.reshape(b.shape[0], -1)


def iter_adapter_weights(chunks: list[torch.nn.Module], grads: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(peft_key, full tensor)`` for every adapter tensor (see the module docstring for the contract);
    with ``grads=True`` their accumulated gradients (DDP ``main_grad``) instead, for checks. A layer's routed
    experts are yielded as PEFT's two parameters once all of them have been gathered."""
    params, layers = expert_params(settings_of(chunks)), _layers(chunks)
    experts: dict[Key, torch.Tensor] = {}
    for key, tensor in _iter_tensors(chunks, grads):
        if experts and key.layer != next(iter(experts)).layer:
            yield from _expert_tensors(layers, next(iter(experts)).layer, experts, params)
            experts = {}
        if key.module == EXPERTS_MODULE:
            experts[key] = tensor
        else:
            yield _peft_key(key, layers), tensor
    if experts:
        yield from _expert_tensors(layers, next(iter(experts)).layer, experts, params)


# PEFT's regular expression for the modules a vision-language model's adapters leave out (verl's exclude_modules in
# its VL LoRA scripts): the vision tower, whose MLP reuses the language model's names (gate_proj, ...)
VISION_TOWER_MODULES = ".*visual.*"


def adapter_config(settings: LoraSettings, base_model: str | None, experts: bool = False,
                   vision: bool = False) -> dict:
    """PEFT's ``LoraConfig`` fields for ``settings`` (``lora_alpha / r`` is the scaling); ``experts``: the model
    has routed experts, whose adapters are ``target_parameters``; ``vision``: the model has a vision tower, which
    meshrl's adapters leave alone (``exclude_modules``)."""
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": settings.rank, "lora_alpha": settings.alpha,
              "lora_dropout": settings.dropout, "target_modules": list(settings.targets), "bias": "none",
              "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "inference_mode": True,
              "init_lora_weights": True, "base_model_name_or_path": base_model}
    if experts and target_parameters(settings):
        config["target_parameters"] = target_parameters(settings)
    if vision:
        config["exclude_modules"] = VISION_TOWER_MODULES
    return config


def has_experts(chunks: list[torch.nn.Module]) -> bool:
    return getattr(unwrap(chunks[0]).meshrl_spec, "moe", False)


def save_adapter(chunks: list[torch.nn.Module], out_dir: str | os.PathLike,
                 base_model: str | None = None) -> Path | None:
    """Write the adapters as a PEFT folder (atomically; an existing one is replaced); collective over the
    model-parallel group (and the expert-parallel one), whose first rank writes. Returns the folder there, None
    elsewhere."""
    from megatron.core import parallel_state
    from safetensors.torch import save_file

    settings = settings_of(chunks)
    writer = (dist.get_rank(parallel_state.get_model_parallel_group()) == 0
              and parallel_state.get_expert_model_parallel_rank() == 0)
    tensors = {key: tensor.cpu() for key, tensor in iter_adapter_weights(chunks)}
    if not writer:
        return None
    out = Path(out_dir)
    tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
    config = adapter_config(settings, base_model, has_experts(chunks), unwrap(chunks[0]).meshrl_spec.vision)
    (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2))
    publish_dir(tmp, out, aside=out.with_name(f"{out.name}.tmp-{os.getpid()}-replaced"))
    return out


def check_adapter_config(folder: Path, settings: LoraSettings, experts: bool = False) -> None:
    """Raise ``ValueError`` naming each field of the folder's config that differs from ``settings``. PEFT writes
    the modules and parameters it matched: an MLP name matching no linear module (an MoE model without a shared
    expert) is implied by the experts' parameters, which it names in short and in full."""
    config = json.loads((folder / CONFIG_FILE).read_text())
    targets = config.get("target_modules")
    parameters = sorted({_parameter_name(name) for name in config.get("target_parameters") or []} - {"weight"})
    if isinstance(targets, list):  # a module path (shared_expert.gate_proj) by its name
        targets = sorted({name.rsplit(".", 1)[-1] for name in targets}
                         | {part for name in parameters for part in EXPERT_PARAMS.get(name.rsplit(".", 1)[-1], ())})
    want = {"peft_type": "LORA", "r": settings.rank, "lora_alpha": settings.alpha,
            "target_modules": sorted(settings.targets),
            "target_parameters": target_parameters(settings) if experts else []}
    have = {"peft_type": config.get("peft_type"), "r": config.get("r"), "lora_alpha": config.get("lora_alpha"),
            "target_modules": targets, "target_parameters": parameters}
    wrong = [f"{key}: adapter {have[key]!r}, run {value!r}" for key, value in want.items() if have[key] != value]
    if config.get("use_dora") or config.get("use_rslora"):
        wrong.append("the adapter uses DoRA / rsLoRA, which meshrl does not build")
    if wrong:
        raise ValueError(f"the LoRA adapter in {folder} does not fit this run's LoRA settings ("
                         + "; ".join(wrong) + "): set the run's lora rank / alpha / target_modules to the adapter's")


def _expert_slice(tensor: torch.Tensor, key: Key, which_param: str, experts: int, rank: int) -> torch.Tensor:
    """Expert ``key.expert``'s A or ``key.part``'s rows of its B, out of PEFT's tensor of ``which_param``."""
    e = key.expert
    if key.which == "A":
        return tensor[e * rank:(e + 1) * rank]
    b = tensor.reshape(tensor.shape[0], rank, experts)[:, :, e]
    parts = EXPERT_PARAMS[which_param]
    return b.chunk(len(parts))[parts.index(key.part)]


@torch.no_grad()
def load_adapter(chunks: list[torch.nn.Module], folder: str | os.PathLike) -> None:
    """Copy this rank's shard of the PEFT adapter in ``folder`` into the chunks' adapters."""
    from safetensors import safe_open

    folder = Path(folder)
    settings = settings_of(chunks)
    check_adapter_config(folder, settings, has_experts(chunks))
    params, layers = expert_params(settings), _layers(chunks)
    num_experts = getattr(unwrap(chunks[0]).meshrl_spec, "num_experts", 0)
    with safe_open(folder / WEIGHTS_FILE, framework="pt") as handle:
        names = set(handle.keys())
        for key, (adapter, param) in _local(chunks).items():
            if key.module == EXPERTS_MODULE:
                param_name = next(name for name in params if key.part in EXPERT_PARAMS[name])
                peft_key = _expert_peft_key(layers, key.layer, param_name, key.which, params)
            else:
                peft_key = _peft_key(key, layers)
            if peft_key not in names:
                raise ValueError(f"the LoRA adapter in {folder} has no {peft_key}")
            tensor = handle.get_tensor(peft_key)
            if key.module == EXPERTS_MODULE:
                tensor = _expert_slice(tensor, key, param_name, num_experts, settings.rank)
            dim = _split_dim(adapter, key.which)
            if dim is not None:
                tensor = tensor.chunk(adapter.tp, dim=dim)[adapter.tp_group.rank()]
            if tuple(tensor.shape) != tuple(param.shape):
                raise ValueError(f"{peft_key} has shape {tuple(tensor.shape)}, the model's adapter needs "
                                 f"{tuple(param.shape)} (TP shard)")
            # A shared A was already copied from the layer's first part: the others must be copies of it.
            shared_copy = key.which == "A" and SHARED in adapter.lora_A and key.part != adapter.parts[0]
            if shared_copy and not torch.equal(tensor.to(device=param.device, dtype=param.dtype), param):
                raise ValueError(f"{peft_key} differs from the {adapter.parts[0]} A of the same layer, but this run's "
                                 "fused LoRA shares one A across them: load it with per-module adapters "
                                 "(lora.type=canonical_lora, or the FSDP keys)")
            param.copy_(tensor)


def adapter_pairs(chunks: list[torch.nn.Module], hf_config) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """HF weight name -> the full (A, B) of its adapter (a routed expert's under the checkpoint's own name,
    ``model.layers.N.mlp.experts.E.gate_proj.weight``); collective like ``iter_adapter_weights``. Holds the
    adapters only (``r * (in + out)`` per adapted weight), never a weight-sized delta."""
    from meshrl.models.families import EXPERT_NAMES
    from meshrl.parallel.model_builder import model_spec

    spec = model_spec(hf_config)
    names = dict(zip(("gate_proj", "up_proj", "down_proj"), EXPERT_NAMES[spec.expert_names][1:])) if spec.moe else {}
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    layers = f"{spec.lm_prefix}layers"  # the checkpoint's names, which the weight stream carries
    for key, tensor in _iter_tensors(chunks):
        if key.module == EXPERTS_MODULE:
            block = EXPERT_NAMES[spec.expert_names][0]
            name = f"{layers}.{key.layer}.{block}.experts.{key.expert}.{names[key.part]}.weight"
        elif key.part == "gate":  # the router: the checkpoint's MoE block (Mixtral's block_sparse_moe)
            name = f"{layers}.{key.layer}.{EXPERT_NAMES[spec.expert_names][0]}.gate.weight"
        else:
            name = f"{layers}.{key.layer}.{key.module}.{key.part}.weight"
        pairs.setdefault(name, {})[key.which] = tensor
    return {name: (pair["A"], pair["B"]) for name, pair in pairs.items()}


def iter_merged_weights(chunks: list[torch.nn.Module], hf_config) -> Iterator[tuple[str, torch.Tensor]]:
    """``hf_conversion.iter_hf_weights`` with each adapted weight merged, ``W + scaling * B @ A``: the delta is
    formed in fp32 for one weight at a time and added to the stream's fresh buffer in place."""
    from meshrl.parallel.hf_conversion import iter_hf_weights

    scaling = settings_of(chunks).scaling
    pairs = adapter_pairs(chunks, hf_config)
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
