"""Weight-update methods mixed into vLLM's worker class (``worker_extension_cls``).

They run where the model lives: in this process for the in-process engine, in vLLM's engine-core
process otherwise, and are called through ``LLM.collective_rpc`` by name. An update is a session:

    meshrl_begin_weight_update()       vLLM's layer-wise reload: layers go back to checkpoint format
    meshrl_load_weights(bucket) ...    HF-named full tensors (each TP rank's loaders take its shard);
                                       a layer is re-processed (e.g. repacked for the CPU kernels) as
                                       soon as all its tensors arrived, so a fused layer (qkv,
                                       gate_up) may straddle buckets
    meshrl_finish_weight_update()      layers that received nothing get their old tensors back

``meshrl_install_adapter`` (``meshrl_install_flat_adapter`` across processes) serves a LoRA adapter built from
tensors in memory (``meshrl.rollout.lora_adapter``); it is not a session: the base weights are untouched.

``meshrl_release_kv_cache`` / ``meshrl_restore_kv_cache`` are the CPU engine's sleep (vLLM's sleep mode is CUDA's
only): the KV cache buffers' storages shrink to nothing and grow back zeroed. vLLM's tensors (the runner's
``kv_caches``, each attention layer's ``kv_cache`` view) keep referring to those same storages, so they see the new
memory without being rebuilt; what the blocks held is gone, hence the engine resets its prefix cache first.

One session spans many buckets, which is why this is not ``reload_weights`` once per bucket: a
per-bucket reload would process a fused layer from a partial set of its tensors. Only the transport
differs between modes: tensors by reference in process, a flat byte buffer across processes, a
CUDA IPC handle of a flat device buffer across processes on GPU.

vLLM warns "<Layer>: Failed to load weights" at ``finish`` for every layer that received nothing.
Two receive nothing by design, on every update: the rotary embedding (its cache is a buffer, not a
checkpoint tensor) and a tied LM head (it is the embedding). Their warnings are dropped; any other
layer's still shows (and ``weight_sync`` has already checked that every expected tensor was sent).

CPU quirk handled in ``finish``: with tied embeddings the CPU backend packs a private copy of the
embedding matrix for the LM head when the model loads; a reload updates the embedding but not that
copy, so the head would keep computing logits with the old weights. The head is re-packed here. Likewise
a mixture-of-experts layer's experts, which the CPU backend prepacks for its kernel on the first load only.
"""

from __future__ import annotations

import contextlib
import logging
import pickle
from typing import Any, Iterator

import torch

from meshrl.rollout.flat_buckets import TensorLayout, unflatten_bucket


def _patch_cpu_rope() -> None:
    """vLLM imports this module in the process that runs the model (``worker_extension_cls``) before it builds the
    model, which is when the CPU rotary fix must be in place (``meshrl.rollout.vllm_cpu_rope``)."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        from meshrl.rollout.vllm_cpu_rope import patch

        patch()


_patch_cpu_rope()

def _kv_cache_storages(model_runner) -> list[torch.UntypedStorage]:
    """The distinct storages under the runner's KV cache tensors (several layers' views may share one)."""
    tensors, pending = [], list(model_runner.kv_caches)
    while pending:  # an entry is a tensor, or a list of them for some attention backends
        item = pending.pop()
        if isinstance(item, torch.Tensor):
            tensors.append(item)
        else:
            pending.extend(item)
    return list({t.untyped_storage()._cdata: t.untyped_storage() for t in tensors}.values())


def _parameter_storages(model: torch.nn.Module) -> list[torch.UntypedStorage]:
    """The distinct storages under the model's parameters (a tied head shares the embedding's), in a fixed order."""
    storages = {}
    for param in model.parameters():
        storages.setdefault(param.untyped_storage()._cdata, param.untyped_storage())
    return list(storages.values())


def _dropped_linear(*args: Any) -> torch.Tensor:
    raise RuntimeError("this vLLM layer's weights were dropped by a level-2 sleep; run a full weight sync first")


class WeightUpdateExtension:
    """Mixed into vLLM's ``Worker``; ``self`` is the worker (``model_runner``, ``vllm_config``)."""

    def meshrl_release_kv_cache(self) -> int:
        """Free the KV cache's memory (module docstring); the bytes freed."""
        storages = _kv_cache_storages(self.model_runner)
        self.meshrl_kv_cache_bytes = [storage.nbytes() for storage in storages]
        for storage in storages:
            storage.resize_(0)
        return sum(self.meshrl_kv_cache_bytes)

    def meshrl_restore_kv_cache(self) -> int:
        """Give the KV cache its memory back, zeroed, in the storages ``meshrl_release_kv_cache`` emptied."""
        storages = _kv_cache_storages(self.model_runner)
        for storage, nbytes in zip(storages, self.meshrl_kv_cache_bytes, strict=True):
            storage.resize_(nbytes)
            storage.fill_(0)
        return sum(self.meshrl_kv_cache_bytes)

    def meshrl_drop_weights(self) -> int:
        """Free the model's weights: the CPU engine's level-2 sleep (module docstring); the parameter bytes freed.

        Parameter storages shrink to nothing (their tensors stay, so the next sync's layer-wise reload finds them),
        and every layer's CPU kernel closure (``cpu_linear``, over the oneDNN / SGL packed copy of its weight, the
        larger part of the model) is replaced by one that refuses to run. The sync after
        ``meshrl_restore_weight_memory`` re-processes every layer, which packs its weight anew."""
        model = self.model_runner.get_model()
        storages = _parameter_storages(model)
        self.meshrl_weight_bytes = [storage.nbytes() for storage in storages]
        for storage in storages:
            storage.resize_(0)
        for module in model.modules():
            if getattr(module, "cpu_linear", None) is not None:
                module.cpu_linear = _dropped_linear
        return sum(self.meshrl_weight_bytes)

    def meshrl_restore_weight_memory(self) -> int:
        """Give the parameters ``meshrl_drop_weights`` emptied their memory back, zeroed, for a full sync to fill."""
        storages = _parameter_storages(self.model_runner.get_model())
        for storage, nbytes in zip(storages, self.meshrl_weight_bytes, strict=True):
            storage.resize_(nbytes)
            storage.fill_(0)
        return sum(self.meshrl_weight_bytes)

    def meshrl_begin_weight_update(self) -> None:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        with set_current_vllm_config(self.vllm_config):
            initialize_layerwise_reload(self.model_runner.get_model())

    def meshrl_load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        from vllm.config import set_current_vllm_config

        with set_current_vllm_config(self.vllm_config), torch.no_grad():
            self.model_runner.get_model().load_weights(weights)

    def meshrl_load_flat_bucket(self, layout: TensorLayout, payload: bytes) -> None:
        # bytearray: a writable copy (the RPC hands over immutable bytes); it lives for this bucket only.
        flat = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        self.meshrl_load_weights(unflatten_bucket(layout, flat))

    def meshrl_load_ipc_bucket(self, layout: TensorLayout, handle: bytes) -> None:
        # The sender keeps the device buffer alive until this call returns (collective_rpc is blocking).
        rebuild, args = pickle.loads(handle)
        args = list(args)
        args[6] = torch.cuda.current_device()  # the receiver's device index for the shared storage
        self.meshrl_load_weights(unflatten_bucket(layout, rebuild(*args)))

    def meshrl_install_adapter(self, lora_id: int, tensors: dict[str, torch.Tensor], peft_config: dict) -> int:
        """Serve LoRA adapter ``lora_id`` built from PEFT-named tensors (``meshrl.rollout.lora_adapter``)."""
        from meshrl.rollout.lora_adapter import install_adapter

        return install_adapter(self, lora_id, tensors, peft_config)

    def meshrl_install_flat_adapter(self, lora_id: int, layout: TensorLayout, payload: bytes, peft_config: dict) -> int:
        flat = torch.frombuffer(bytearray(payload), dtype=torch.uint8)  # writable, as in meshrl_load_flat_bucket
        return self.meshrl_install_adapter(lora_id, dict(unflatten_bucket(layout, flat)), peft_config)

    def meshrl_finish_weight_update(self) -> None:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload
        from vllm.platforms import current_platform

        model = self.model_runner.get_model()
        # From the config: mid-reload, the head's and the embedding's parameters are not yet one object again.
        tied = bool(getattr(self.model_config.hf_text_config, "tie_word_embeddings", False))
        with set_current_vllm_config(self.vllm_config), torch.no_grad(), _quiet_expected_empty_layers(model, tied):
            finalize_layerwise_reload(model, self.model_config)
            if current_platform.is_cpu():
                _repack_tied_lm_head(model)
                _repack_cpu_moe_experts(model)
        for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):
            if hasattr(self.model_runner, reset):
                getattr(self.model_runner, reset)()


def _has_tied_lm_head(model: torch.nn.Module) -> bool:
    weight = getattr(getattr(model, "lm_head", None), "weight", None)
    return weight is not None and any(param is weight for name, param in model.named_parameters(remove_duplicate=False)
                                      if not name.startswith("lm_head."))


def _repack_tied_lm_head(model: torch.nn.Module) -> None:
    head: Any = getattr(model, "lm_head", None)
    if _has_tied_lm_head(model) and hasattr(head, "quant_method"):
        head.quant_method.process_weights_after_loading(head)


def _repack_cpu_moe_experts(model: torch.nn.Module) -> None:
    """Prepack every fused-MoE layer's new expert weights for the CPU kernel: vLLM re-processes a reloaded MoE
    layer but prepacks (and pads) its experts only on the first load, so after a reload the kernel would read the
    synced weights in the wrong layout (tiny:qwen2_moe: log-probs off by ~1 nat)."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        if isinstance(getattr(kernel, "fused_experts", None), CPUUnquantizedExperts):
            kernel.fused_experts.process_weights_after_loading(module)


class _DropExpectedEmptyLayers(logging.Filter):
    """Drops vLLM's "Failed to load weights" record for the layers named (see the module docstring)."""

    def __init__(self, tied_head_class: str | None) -> None:
        super().__init__()
        self.tied_head_class = tied_head_class

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg != "%s: Failed to load weights" or not record.args:
            return True
        layer = str(record.args[0])
        return not (layer.endswith("RotaryEmbedding") or layer == self.tied_head_class)


@contextlib.contextmanager
def _quiet_expected_empty_layers(model: torch.nn.Module, tied: bool) -> Iterator[None]:
    from vllm.model_executor.model_loader.reload import layerwise

    head = getattr(model, "lm_head", None)
    drop = _DropExpectedEmptyLayers(type(head).__name__ if tied and head is not None else None)
    layerwise.logger.addFilter(drop)
    try:
        yield
    finally:
        layerwise.logger.removeFilter(drop)
