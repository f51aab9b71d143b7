"""Run megatron-core 0.16.1 on a CPU-only torch, process-locally, without touching files on disk.

megatron-core assumes CUDA in a few recurring ways. ``apply()`` redirects each of them, only when
CUDA is absent, and must run before any megatron model, optimizer or schedule is built
(``meshrl.parallel.state.initialize`` calls it). Nothing outside megatron-core is changed except for
the duration of four megatron calls (see "Scoped tensor-method shims").

Mechanisms, narrowest first:

1. **A ``torch`` stand-in inside megatron's modules.** Every loaded ``megatron.core.*`` module whose
   global ``torch`` is the real torch gets ``_TORCH_ON_CPU`` instead, and modules imported later get
   it through a meta-path hook. The stand-in forwards every attribute to torch except:

   - ``torch.cuda.current_device()`` -> ``torch.device("cpu")``: ~175 sites use it as the allocation
     device (rotary ``get_emb``, TP mappings, p2p receive buffers, DDP grad buffers, ...).
   - ``torch.cuda.synchronize()`` -> no-op: called by ``p2p_communication._communicate_shapes``
     (always), ``_communicate`` (with ``batch_p2p_sync``) and the checkpoint writer; CPU ops are
     synchronous, so there is nothing to wait for.
   - ``torch.cuda.Stream() / current_stream() / stream(s)`` -> one CPU "stream" whose events are already
     complete: the MoE all-to-all dispatcher copies its token counts to the host on a side stream
     (``MoEAlltoAllTokenDispatcher``); CPU ops are synchronous, so there is one stream and nothing to wait for.
   - ``torch.cuda.get_rng_state / set_rng_state / manual_seed`` -> the CPU generator: the CUDA RNG
     tracker (``model_parallel_cuda_manual_seed``, ``CudaRNGStatesTracker.add``) seeds "the device
     generator", which on CPU is the default CPU generator.
   - tensor factories (``torch.zeros``, ``torch.tensor``, ``torch.ones``, ...) called with
     ``device="cuda"``: hard-coded in ``pipeline_parallel/schedules.py`` (``total_num_tokens``, all
     three schedules), ``optimizer/optimizer.py``, ``optimizer/clip_grads.py``,
     ``optimizer/grad_scaler.py``, ``distributed/param_and_grad_buffer.py``,
     ``utils.local_multi_tensor_l2_norm`` and ``transformer.utils.get_default_causal_mask``; the
     device is rewritten to ``"cpu"``. Any other device is passed through untouched.

   Code outside megatron (transformers, vLLM, the rest of meshrl) keeps seeing the real torch.

   Two collectives of ``tensor_parallel.mappings`` are replaced by gloo-capable equivalents:
   ``_gather_along_first_dim`` (an all-gather of uneven row counts: gloo's all-gather wants equal tensors; each
   rank's rows are padded to the longest and trimmed after) and ``_reduce_scatter_along_first_dim`` (gloo has no
   reduce-scatter: an all-reduce of the whole tensor, then this rank's rows). The MoE dispatcher calls them with
   per-rank token counts when experts are split over an expert-tensor-parallel group.

   The MoE all-to-all dispatcher's ``maybe_move_tensor_to_cpu`` (as ``token_dispatcher`` imported it) is
   replaced too: it turns token-split sizes into numpy arrays only when they come from CUDA, and torch's
   ``all_to_all_single`` refuses the tensors that stay otherwise; on CPU they become numpy arrays as well.

2. **Two module functions replaced** in ``megatron.core.tensor_parallel.random``:
   ``_get_cuda_rng_state`` / ``_set_cuda_rng_state`` read and write ``torch.cuda.default_generators``
   directly; attention always enters ``get_cuda_rng_tracker().fork()`` and activation recompute saves
   and restores through them. On CPU they read / write the CPU generator state.

3. **Scoped tensor-method shims.** Four megatron functions test ``tensor.type() ==
   'torch.cuda.FloatTensor'`` or call ``tensor.cuda()``, which no module-level name can redirect:
   ``clip_grad_by_total_norm_fp32`` (as called from ``optimizer/optimizer.py``),
   ``DistributedOptimizer._build_model_and_main_param_groups``,
   ``Float16OptimizerWithFloat16Params.__init__`` (``.type()``), and
   ``LanguageModule.setup_embeddings_and_output_layer`` (``weight.data.cuda()`` when pipeline stages
   share tied embeddings). Each is wrapped so that *during that call only* ``Tensor.type()`` names CPU
   float tensors as their CUDA twins and ``Tensor.cuda()`` returns the tensor itself. These calls run
   once per optimizer build / model build / clip, on the caller's thread.

``PATCH_POINTS`` lists every megatron attribute touched with a source marker that proves the reason
still holds; ``tests/parallel/test_cpu_compat.py`` fails loudly when an upgrade moves one.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.abc
import importlib.machinery
import sys
import threading
import types
from typing import Any, Callable, Iterator

import torch

SUPPORTED_MEGATRON_VERSION = "0.16.1"

_FACTORIES = (
    "tensor", "as_tensor", "zeros", "ones", "empty", "full", "arange", "rand", "randn", "randint",
    "empty_strided", "zeros_like", "ones_like", "empty_like", "full_like", "eye",
)

# (module, attribute, marker): the marker must appear in the attribute's source for the patch to be
# both needed and correctly placed; checked by the tests and by `verify_patch_points()`.
PATCH_POINTS: tuple[tuple[str, str, str], ...] = (
    ("megatron.core.tensor_parallel.random", "_get_cuda_rng_state", "torch.cuda.random.get_rng_state"),
    ("megatron.core.tensor_parallel.random", "_set_cuda_rng_state", "torch.cuda.default_generators"),
    ("megatron.core.tensor_parallel.random", "CudaRNGStatesTracker.add", "torch.cuda.manual_seed(seed)"),
    ("megatron.core.tensor_parallel.random", "model_parallel_cuda_manual_seed", "torch.cuda.manual_seed"),
    ("megatron.core.optimizer.clip_grads", "clip_grad_by_total_norm_fp32", "'torch.cuda.FloatTensor'"),
    ("megatron.core.optimizer.optimizer", "MegatronOptimizer.clip_grad_norm", "clip_grad_by_total_norm_fp32("),
    ("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer._build_model_and_main_param_groups",
     "'torch.cuda.FloatTensor'"),
    ("megatron.core.optimizer.optimizer", "Float16OptimizerWithFloat16Params.__init__", "'torch.cuda.FloatTensor'"),
    ("megatron.core.models.common.language_module.language_module",
     "LanguageModule.setup_embeddings_and_output_layer", "weight.data.cuda()"),
    ("megatron.core.transformer.utils", "get_default_causal_mask", 'device="cuda"'),
    ("megatron.core.utils", "local_multi_tensor_l2_norm", 'device="cuda"'),
    ("megatron.core.pipeline_parallel.schedules", "forward_backward_no_pipelining", 'device="cuda"'),
    ("megatron.core.pipeline_parallel.schedules", "forward_backward_pipelining_without_interleaving",
     'device="cuda"'),
    ("megatron.core.pipeline_parallel.schedules", "forward_backward_pipelining_with_interleaving",
     'device="cuda"'),
    ("megatron.core.pipeline_parallel.p2p_communication", "P2PCommunicator._communicate_shapes",
     "torch.cuda.synchronize()"),
    ("megatron.core.models.common.embeddings.rotary_pos_embedding", "RotaryEmbedding.get_emb",
     "torch.cuda.current_device()"),
    ("megatron.core.transformer.moe.token_dispatcher", "MoEAlltoAllTokenDispatcher.__init__",
     "torch.cuda.Stream()"),
    ("megatron.core.transformer.moe.moe_utils", "maybe_move_tensor_to_cpu", "tensor.is_cuda"),
    ("megatron.core.tensor_parallel.mappings", "_gather_along_first_dim",
     "torch.distributed.all_gather(output_tensor_list, input_, group=group)"),
    ("megatron.core.tensor_parallel.mappings", "_reduce_scatter_along_first_dim",
     "torch.distributed.reduce_scatter(output, input_tensor_list, group=group)"),
)

_applied = False
_lock = threading.Lock()


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, str):
        return device == "cuda" or device.startswith("cuda:")
    return isinstance(device, torch.device) and device.type == "cuda"


def _cpu_factory(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def factory(*args, **kwargs):
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = "cpu"
        return fn(*args, **kwargs)

    return factory


class _CpuStream:
    """The one CUDA stream megatron sees on CPU (see ``_CudaOnCpu``): waiting on it and its events is a no-op."""

    def wait_stream(self, stream: Any) -> None:
        return None

    def record_event(self, event: Any = None) -> "_CpuStream":
        return self

    def synchronize(self) -> None:
        return None


_CPU_STREAM = _CpuStream()


class _CudaOnCpu(types.ModuleType):
    """``torch.cuda`` as megatron sees it on a CPU-only machine (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__("torch.cuda")

    @staticmethod
    def current_device() -> torch.device:
        return torch.device("cpu")

    @staticmethod
    def synchronize(device: Any = None) -> None:
        return None

    @staticmethod
    def get_rng_state(device: Any = "cuda") -> torch.Tensor:
        return torch.get_rng_state()

    @staticmethod
    def set_rng_state(new_state: torch.Tensor, device: Any = "cuda") -> None:
        torch.set_rng_state(new_state)

    @staticmethod
    def manual_seed(seed: int) -> None:
        torch.manual_seed(seed)

    @staticmethod
    def Stream(*args, **kwargs) -> _CpuStream:  # noqa: N802 (torch.cuda's name)
        return _CPU_STREAM

    @staticmethod
    def current_stream(device: Any = None) -> _CpuStream:
        return _CPU_STREAM

    @staticmethod
    def stream(stream: Any) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)


class _TorchOnCpu(types.ModuleType):
    """``torch`` as megatron sees it on a CPU-only machine: real torch except ``cuda`` and factories."""

    def __init__(self) -> None:
        super().__init__("torch")
        self.cuda = _CudaOnCpu()
        for name in _FACTORIES:
            setattr(self, name, _cpu_factory(getattr(torch, name)))

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


_TORCH_ON_CPU = _TorchOnCpu()


def _host_tensor(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
    """``moe_utils.maybe_move_tensor_to_cpu`` for tensors already on the host: a numpy array when asked."""
    return tensor.numpy() if as_numpy and torch.is_tensor(tensor) else tensor


def _gather_rows(input_: torch.Tensor, group, output_split_sizes=None, use_global_buffer: bool = False):
    """``mappings._gather_along_first_dim`` on gloo: every rank's rows, in rank order, on every rank."""
    import torch.distributed as dist

    if group.size() == 1:
        return input_
    sizes = [input_.shape[0]] * group.size() if output_split_sizes is None else list(output_split_sizes)
    padded = input_.new_zeros((max(sizes),) + tuple(input_.shape[1:]))
    padded[: input_.shape[0]] = input_
    parts = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(parts, padded, group=group)
    return torch.cat([part[:size] for part, size in zip(parts, sizes)])


def _reduce_scatter_rows(input_: torch.Tensor, group, input_split_sizes=None, use_global_buffer: bool = False):
    """``mappings._reduce_scatter_along_first_dim`` on gloo: the sum over ranks of this rank's rows."""
    import torch.distributed as dist

    if group.size() == 1:
        return input_
    sizes = [input_.shape[0] // group.size()] * group.size() if input_split_sizes is None else list(input_split_sizes)
    total = input_.contiguous().clone()
    dist.all_reduce(total, group=group)
    start = sum(sizes[: group.rank()])
    return total[start:start + sizes[group.rank()]].clone()


def _get_cpu_rng_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    state = torch.get_rng_state()
    return state.clone() if clone else state


def _set_cpu_rng_state(new_state: torch.Tensor, device: int = -1, graph_safe: bool = False) -> None:
    torch.set_rng_state(new_state)


_CPU_TO_CUDA_TYPE = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
}


@contextlib.contextmanager
def _tensor_methods_as_cuda() -> Iterator[None]:
    """Within the block, ``Tensor.type()`` reports CPU floats as CUDA types and ``.cuda()`` is identity."""
    real_type, real_cuda = torch.Tensor.type, torch.Tensor.cuda

    def type_(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs:
            name = real_type(self)
            return _CPU_TO_CUDA_TYPE.get(name, name)
        return real_type(self, dtype, non_blocking, **kwargs)

    def cuda(self, *args, **kwargs):
        return self

    torch.Tensor.type, torch.Tensor.cuda = type_, cuda
    try:
        yield
    finally:
        torch.Tensor.type, torch.Tensor.cuda = real_type, real_cuda


def _scoped(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with _tensor_methods_as_cuda():
            return fn(*args, **kwargs)

    wrapper.__meshrl_cpu_compat__ = True
    return wrapper


def _swap_torch(module: types.ModuleType) -> None:
    if module.__dict__.get("torch") is torch:
        module.torch = _TORCH_ON_CPU


class _MegatronImportHook(importlib.abc.MetaPathFinder):
    """Gives megatron modules imported after ``apply()`` (lazy imports inside megatron) the stand-in."""

    def find_spec(self, fullname, path, target=None):
        if not fullname.startswith("megatron.core"):
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        real_exec = spec.loader.exec_module

        def exec_module(module):
            real_exec(module)
            _swap_torch(module)

        spec.loader.exec_module = exec_module
        return spec


def _resolve(module_name: str, qualname: str) -> tuple[Any, str, Any]:
    """(owner, attribute name, raw attribute) for ``module.Qual.name`` (raw: no descriptor binding)."""
    import importlib

    owner: Any = importlib.import_module(module_name)
    *parents, attr = qualname.split(".")
    for parent in parents:
        owner = getattr(owner, parent)
    return owner, attr, owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)


def megatron_version() -> str:
    from megatron.core import package_info

    return package_info.__version__


def verify_patch_points() -> None:
    """Raise if megatron-core is not the audited version or a patched place moved or changed."""
    import inspect

    version = megatron_version()
    if version != SUPPORTED_MEGATRON_VERSION:
        raise RuntimeError(
            f"meshrl.parallel.cpu_compat was audited against megatron-core {SUPPORTED_MEGATRON_VERSION}, "
            f"found {version}: re-check every entry of PATCH_POINTS before running on CPU."
        )
    for module_name, qualname, marker in PATCH_POINTS:
        try:
            _, _, raw = _resolve(module_name, qualname)
        except (ImportError, AttributeError, KeyError) as exc:
            raise RuntimeError(f"megatron-core moved {module_name}.{qualname} ({exc!r}); "
                               "update meshrl.parallel.cpu_compat") from exc
        fn = raw.__func__ if isinstance(raw, (classmethod, staticmethod)) else raw
        fn = getattr(fn, "__wrapped__", fn)
        if marker not in inspect.getsource(fn):
            raise RuntimeError(f"{module_name}.{qualname} no longer contains {marker!r}; "
                               "the CPU redirection for it may be stale: update meshrl.parallel.cpu_compat")


def is_applied() -> bool:
    return _applied


def apply(force: bool = False) -> bool:
    """Redirect megatron-core's CUDA-only calls to the CPU; returns whether anything was applied.

    A no-op when CUDA is available (unless ``force``, used by tests) or when already applied. Call it
    before building any megatron model, optimizer or schedule. Idempotent and process-local.
    """
    global _applied
    with _lock:
        if _applied or (torch.cuda.is_available() and not force):
            return _applied
        verify_patch_points()
        # Import the patched modules so the sweep below sees them.
        from megatron.core.models.common.language_module import language_module
        from megatron.core.optimizer import distrib_optimizer, optimizer
        from megatron.core.tensor_parallel import random as tp_random

        _get_cpu_rng_state.__wrapped__ = tp_random._get_cuda_rng_state
        _set_cpu_rng_state.__wrapped__ = tp_random._set_cuda_rng_state
        tp_random._get_cuda_rng_state = _get_cpu_rng_state
        tp_random._set_cuda_rng_state = _set_cpu_rng_state
        optimizer.clip_grad_by_total_norm_fp32 = _scoped(optimizer.clip_grad_by_total_norm_fp32)
        fp16_init = optimizer.Float16OptimizerWithFloat16Params.__init__
        optimizer.Float16OptimizerWithFloat16Params.__init__ = _scoped(fp16_init)
        build = distrib_optimizer.DistributedOptimizer.__dict__["_build_model_and_main_param_groups"]
        distrib_optimizer.DistributedOptimizer._build_model_and_main_param_groups = classmethod(
            _scoped(build.__func__))
        setup = language_module.LanguageModule.setup_embeddings_and_output_layer
        language_module.LanguageModule.setup_embeddings_and_output_layer = _scoped(setup)
        from megatron.core.transformer.moe import token_dispatcher

        token_dispatcher.maybe_move_tensor_to_cpu = _host_tensor
        from megatron.core.tensor_parallel import mappings

        _gather_rows.__wrapped__ = mappings._gather_along_first_dim
        _reduce_scatter_rows.__wrapped__ = mappings._reduce_scatter_along_first_dim
        mappings._gather_along_first_dim = _gather_rows
        mappings._reduce_scatter_along_first_dim = _reduce_scatter_rows

        for name, module in list(sys.modules.items()):
            if module is not None and (name == "megatron.core" or name.startswith("megatron.core.")):
                _swap_torch(module)
        sys.meta_path.insert(0, _MegatronImportHook())
        _applied = True
        return True
