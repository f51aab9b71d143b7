"""vLLM's LoRA adapter path: the policy's adapter tensors into a running engine, in memory, a new adapter per sync.

With LoRA the base weights never change, so after the engine holds them (loaded from the model folder, or one
full sync) a sync needs only the adapters: per adapted HF module ``model.layers.N.<parent>.<part>``, under
PEFT's names,

    base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight   A [r, in]
    base_model.model.model.layers.N.self_attn.q_proj.lora_B.weight   B [out, r]

``r·(in + out)`` numbers per module instead of ``out·in`` (rank 16 on SmolLM2-135M: 20 MB instead of 538 MB).
vLLM (0.32, CPU and CUDA) serves them with its LoRA layers: each packed linear (``qkv_proj`` = q, k, v;
``gate_up_proj`` = gate, up; ``o_proj``, ``down_proj``) computes ``W x + (alpha/r)·B (A x)`` per part, as PEFT
does, with the punica kernels (on CPU ``PunicaWrapperCPU``'s torch ops, replaced by ``vllm_cpu_lora``'s at the first
install: vLLM's copy the adapter for every token). The engine is started with
``enable_lora``, ``max_loras=1`` and ``max_lora_rank`` = the smallest rank vLLM allows (``MaxLoRARanks``) >= the
policy's, as verl starts it.

In memory, no folder: vLLM loads adapters from a folder named by ``LoRARequest.lora_path``. Here the worker
builds vLLM's ``LoRAModel`` from the tensors themselves (``LoRAModel.from_lora_tensors`` with the PEFT config
read by ``PEFTHelper.from_dict``), removes the previous adapter and adds and activates the new one under a
fresh id, before any request names it. A request then names that id (``lora_request``); the worker's LRU
manager finds it loaded and never reads the path, which is a placeholder (with ``max_loras=1`` and one adapter
at a time nothing is evicted). A new id per sync also keeps prefix-cache entries of the old adapter from being
reused (vLLM keys them by adapter).

Validation happens before anything reaches vLLM (``collect_adapter``): every tensor is a PEFT key of a weight the
engine's model has, with the shape that weight implies, floating point, sent once, and every module the config
targets has both its A and its B. A bad stream raises ``WeightSyncError`` naming the tensor and the engine keeps
its previous adapter.
"""

from __future__ import annotations

import itertools
import time
from typing import Any, Iterable, Mapping

import torch

from meshrl.rollout.weight_sync import SyncStats, WeightSyncError, tensor_bytes

PEFT_PREFIX = "base_model.model."
# LoRARequest.lora_path must be non-empty; the adapter is already loaded when a request names it (module doc).
IN_MEMORY_PATH = "meshrl:in-memory"


def vllm_max_lora_rank(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that serves an adapter of ``rank``."""
    from typing import get_args

    from vllm.config.lora import MaxLoRARanks

    allowed = sorted(get_args(MaxLoRARanks))
    fitting = [value for value in allowed if value >= rank]
    if rank < 1 or not fitting:
        raise ValueError(f"vLLM serves LoRA adapters of rank 1..{allowed[-1]}, got {rank}: send the merged weights "
                         "instead (actor_rollout_ref.model.lora.merge=True)")
    return fitting[0]


def adapter_shapes(manifest: Mapping[str, torch.Size], peft_config: Mapping[str, Any]) -> dict[str, tuple[int, int]]:
    """PEFT key -> shape of every adapter tensor ``peft_config`` (``r``, ``target_modules``: a list of module
    names) puts on the model whose weights are ``manifest`` (HF name -> shape): A ``[r, in]``, B ``[out, r]``."""
    targets, rank = peft_config["target_modules"], int(peft_config["r"])
    if not isinstance(targets, (list, tuple)):
        raise ValueError(f"target_modules must list module names for the adapter path, got {targets!r}")
    shapes = {}
    for name, shape in manifest.items():
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and len(shape) == 2 and module.rsplit(".", 1)[-1] in targets:
            shapes[f"{PEFT_PREFIX}{module}.lora_A.weight"] = (rank, int(shape[1]))
            shapes[f"{PEFT_PREFIX}{module}.lora_B.weight"] = (int(shape[0]), rank)
    return shapes


def collect_adapter(weights: Iterable[tuple[str, torch.Tensor]], manifest: Mapping[str, torch.Size],
                    peft_config: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The validated adapter of a ``(peft_key, tensor)`` stream (see the module docstring); raises
    ``WeightSyncError`` naming the first tensor that does not fit, or the missing ones."""
    import difflib

    expected = adapter_shapes(manifest, peft_config)
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in weights:
        shape = expected.get(name)
        if shape is None:
            close = difflib.get_close_matches(name, list(expected), n=1)
            raise WeightSyncError(f"unexpected adapter tensor {name!r}: the engine's model has no such adapted "
                                  "module for target_modules " + repr(list(peft_config["target_modules"]))
                                  + (f" (did you mean {close[0]!r}?)" if close else ""))
        if name in tensors:
            raise WeightSyncError(f"adapter tensor {name!r} was sent twice in one sync")
        if tuple(tensor.shape) != shape:
            raise WeightSyncError(f"adapter tensor {name!r} has shape {tuple(tensor.shape)}; the engine's model "
                                  f"needs {shape} (rank {peft_config['r']})")
        if not tensor.is_floating_point():
            raise WeightSyncError(f"adapter tensor {name!r} has dtype {tensor.dtype}; it must be floating point")
        tensors[name] = tensor
    missing = [name for name in expected if name not in tensors]
    if missing:
        raise WeightSyncError(f"the adapter stream ended without {len(missing)} of its {len(expected)} tensors, "
                              f"e.g. {missing[:4]}")
    return tensors


def lora_request(lora_id: int) -> Any:
    """The ``LoRARequest`` that makes a request use adapter ``lora_id`` (installed by ``install_adapter``)."""
    from vllm.lora.request import LoRARequest

    return LoRARequest(lora_name=f"meshrl-policy-{lora_id}", lora_int_id=lora_id, lora_path=IN_MEMORY_PATH)


class AdapterSlot:
    """The engine's one served adapter: each ``load`` installs a new one under the next id and returns what it
    moved; ``request`` is what generation passes to vLLM (None before the first load)."""

    def __init__(self) -> None:
        self._ids = itertools.count(1)
        self.request: Any = None

    def load(self, llm: Any, in_process: bool, weights: Iterable[tuple[str, torch.Tensor]],
             manifest: Mapping[str, torch.Size], peft_config: Mapping[str, Any]) -> SyncStats:
        start = time.perf_counter()
        with torch.no_grad():
            tensors = collect_adapter(weights, manifest, peft_config)
        lora_id = next(self._ids)
        config = dict(peft_config)
        # By name (vllm_worker.WeightUpdateExtension): vLLM sends callables to another process only with its
        # insecure pickle fallback.
        if in_process:  # tensors by reference
            llm.collective_rpc("meshrl_install_adapter", args=(lora_id, tensors, config))
        else:  # RPC arguments are serialised: one flat byte buffer, as the weight buckets travel
            from meshrl.rollout.flat_buckets import flatten_bucket

            layout, flat = flatten_bucket([(name, tensor.cpu()) for name, tensor in tensors.items()])
            llm.collective_rpc("meshrl_install_flat_adapter", args=(lora_id, layout, flat.numpy().tobytes(), config))
        self.request = lora_request(lora_id)
        size = sum(tensor_bytes(t) for t in tensors.values())
        return SyncStats(tensors=len(tensors), bytes=size, buckets=1, largest_bucket_bytes=size,
                         seconds=time.perf_counter() - start)


def install_adapter(worker: Any, lora_id: int, tensors: dict[str, torch.Tensor], peft_config: dict) -> int:
    """(Runs in vLLM's worker: ``vllm_worker.WeightUpdateExtension.meshrl_install_adapter``.) Build adapter ``lora_id``
    from ``tensors``, then replace
    every loaded adapter with it and activate it; returns the number of adapted modules. The adapter is built
    (and vLLM's checks of it run) before the old one is removed, so a failure leaves the old one served."""
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper
    from vllm.platforms import current_platform

    if current_platform.is_cpu():  # before any request uses the adapter
        from meshrl.rollout.vllm_cpu_lora import patch

        patch()
    manager = worker.model_runner.lora_manager
    helper = PEFTHelper.from_dict(peft_config)
    helper.validate_legal(manager.lora_config)
    model = manager._adapter_manager.model
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    lora = LoRAModel.from_lora_tensors(lora_id, tensors, helper, device="cpu", dtype=manager.lora_config.lora_dtype,
                                       model_vocab_size=manager.vocab_size,
                                       weights_mapper=mapper.get_rename_mapper() if mapper is not None else None)
    manager.remove_all_adapters()
    manager._adapter_manager.add_adapter(lora)
    manager._adapter_manager.activate_adapter(lora_id)
    return len(lora.loras)

