"""LoRA adapters on megatron-core's tensor-parallel linear layers, applied to built model chunks.

For a targeted linear ``y = W x`` the adapted layer computes (PEFT's LoRA)::

    y = W x + scaling * B (A dropout(x)),        scaling = alpha / rank,
    A: [rank, in]  (kaiming-uniform(a=sqrt(5)) as PEFT, or xavier-normal as Megatron-Bridge),  B: [out, rank] = 0

so with B = 0 the adapted model's outputs are the base model's, bit for bit. Targets are HF module names
(``q_proj k_proj v_proj o_proj gate_proj up_proj down_proj``); the fused megatron layers hold several:

- ``linear_qkv`` (column-parallel) holds q, k, v, its rows grouped per KV group ``[q_g; k_g; v_g]``
  (``hf_conversion``): each targeted part has its own B, TP-split along its output rows like its HF rows
  (rank t holds the contiguous q/k/v heads of its groups), and the deltas are interleaved into the fused
  layout. ``linear_fc1`` holds ``[gate; up]`` per TP rank, likewise.
- Each part has its own A (PEFT's separate ``q_proj`` / ``k_proj`` / ``v_proj`` adapters; verl's
  ``canonical_lora``), or all parts of a fused layer share one A (``shared_a``: verl's Megatron ``lora``
  type, one adapter on ``linear_qkv``; in PEFT's format each part gets a copy of that A).

Tensor parallelism: on a column-parallel layer A is replicated and B split along its output; the rank-r
activation ``h = A x`` enters megatron's ``copy_to_tensor_model_parallel_region`` (identity forward,
all-reduce backward), so A's and x's gradients are complete and equal on every TP rank. On a row-parallel
layer (``o_proj``, ``down_proj``) A is split along its input and B replicated: ``h`` is the all-reduce of
the ranks' partial ``A_t x_t`` (``reduce_from_tensor_model_parallel_region``), B's gradient is then the same
on every rank. Under sequence parallelism the linear's input (column-parallel) or output (row-parallel) is this
rank's sequence shard, and the rank-r activation moves as the layer's does: a column-parallel adapter's ``A x``
of the shard is all-gathered along the sequence (its backward reduce-scatters, summing the ranks' B terms),
a row-parallel one's partial ``A_t x_t`` reduce-scattered to the shard; the replicated A (column) or B (row) then
sees one shard per rank, and is marked ``sequence_parallel`` so that megatron sums its gradient over TP, as for
the norms. Pipeline parallelism: each stage adapts the layers it holds, named by their global index.

Mixture-of-experts layers: the MLP targets (``gate_proj``, ``up_proj``, ``down_proj``) adapt the shared expert
(a dense TP-split MLP, HF's ``mlp.shared_expert``) and, with ``experts=True``, every routed expert: one adapter per
expert on its ``linear_fc1`` (one A for ``[gate; up]``, as PEFT's ``target_parameters=["mlp.experts.gate_up_proj"]``
and Megatron-Bridge's per-expert ``linear_fc1`` adapter) and one on its ``linear_fc2``; ``W_e + scaling * B_e A_e``.
The expert linears run megatron's explicit expert communication (the dispatcher gathers the expert-TP ranks' tokens
and sums their partial outputs), so an expert adapter communicates nothing: each expert-TP rank adds its own term
(``B_t (A x)`` on ``linear_fc1``, ``B (A_t x_t)`` on ``linear_fc2``) and the dispatcher sums them as it does the
base's; the replicated factor's gradient is then a per-rank partial sum, marked ``layers.ETP_PARTIAL_GRAD`` and
summed over the expert-TP group after the backward. An expert adapter's parameters take the expert weight's
``allreduce`` flag (reduced over the expert-data-parallel group, as the experts are). With ``router=True`` (verl's
``router`` target) the router's logits get ``scaling * B (A x)`` too, in the router's dtype: the router's weight is
whole on every TP rank, so is its adapter, which takes the weight's gradient flags (``sequence_parallel`` under
sequence parallelism, ``layers.TP_PARTIAL_GRAD`` where each TP rank routes its own share of the tokens).

The base model is frozen (``requires_grad=False``: no gradient, no DDP buffer, no optimizer state; megatron
runs its frozen-weight linear); only the adapters train. ``adapters_disabled(chunks)`` runs the base model
(the KL reference without a reference copy). The adapter parameters live in a sibling module of the linear
(``linear_qkv_lora`` beside ``linear_qkv``), whose ``sharded_state_dict`` marks the split ones, so
megatron's distributed checkpoints save model and optimizer state of every TP shard.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Iterator

import torch

# The adapted linears of a decoder layer: (HF parts it holds, layout of its output, row-parallel), by the linear's
# name inside its parent (the attention, a dense MLP, an MoE layer's shared expert or one routed expert).
LINEARS = {"linear_qkv": (("q_proj", "k_proj", "v_proj"), "qkv", False), "linear_proj": (("o_proj",), "single", True),
           "linear_fc1": (("gate_proj", "up_proj"), "concat", False), "linear_fc2": (("down_proj",), "single", True)}
# The HF module names a run may target, in PEFT's order
HF_TARGETS = tuple(part for parts, _, _ in LINEARS.values() for part in parts)
# PEFT's module of a layer's routed experts in transformers 5 (3-D ``gate_up_proj`` / ``down_proj`` parameters), and
# the module whose ``gate`` is the router (its ``weight``: PEFT's ``target_parameters=["mlp.gate.weight"]``)
EXPERTS_MODULE, ROUTER_MODULE = "mlp.experts", "mlp"
INIT_METHODS = ("kaiming", "xavier")
SHARED = "shared"


@dataclass(frozen=True)
class LoraSettings:
    """What to adapt and how; ``targets`` are HF module names (``HF_TARGETS``)."""

    rank: int
    alpha: float
    targets: tuple[str, ...]
    dropout: float = 0.0
    shared_a: bool = False
    init_a: str = "kaiming"
    experts: bool = False  # MLP targets also adapt each routed expert of an MoE layer (see the module docstring)
    router: bool = False  # an MoE layer's router too (verl's "router" target; PEFT's mlp.gate.weight)

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"LoRA rank must be >= 1, got {self.rank}")
        unknown = [name for name in self.targets if name not in HF_TARGETS]
        if unknown or not (self.targets or self.router):
            raise ValueError(f"LoRA targets {unknown or '(none)'}: choose among {sorted(HF_TARGETS)} (or the router)")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoRA dropout must be in [0, 1), got {self.dropout}")
        if self.init_a not in INIT_METHODS:
            raise ValueError(f"LoRA A init {self.init_a!r} is not one of {INIT_METHODS}")

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


def expert_lora_problem(settings: LoraSettings) -> str | None:
    """Why ``settings`` cannot adapt routed experts, or None: PEFT's expert format (``target_parameters``) holds one
    adapter for ``gate_up_proj`` (one A for gate and up, whatever ``shared_a`` says of the dense layers) and takes no
    dropout."""
    mlp = [name for name in ("gate_proj", "up_proj") if name in settings.targets]
    if len(mlp) == 1:
        return (f"LoRA on routed experts adapts gate and up together (PEFT's experts.gate_up_proj), but only {mlp[0]} "
                "is targeted: target both (linear_fc1) or neither")
    if settings.dropout:
        return (f"LoRA dropout {settings.dropout} on routed experts or routers: PEFT's parameter adapters take none "
                "(the delta is added to the weights); set lora.dropout=0")
    return None


class LoraAdapter(torch.nn.Module):
    """The adapter of one megatron linear (``parts``: the HF modules it holds that are targeted), and the
    hook that adds its delta to the linear's output.

    ``out_sizes``: each part's full (HF) output size; ``layout`` tells how the parts' local deltas form the
    linear's local output: ``"qkv"`` (grouped per KV group), ``"concat"`` (``[gate; up]``) or ``"single"``.
    """

    def __init__(self, parts: tuple[str, ...], all_parts: tuple[str, ...], in_size: int,
                 out_sizes: dict[str, int], row_parallel: bool, layout: str, spec, settings: LoraSettings,
                 dtype: torch.dtype, device: torch.device, sequence_parallel: bool = False, tp_group=None,
                 expert: int | None = None, allreduce: bool = True, replicated=None) -> None:
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        from meshrl.parallel.layers import ETP_PARTIAL_GRAD, TP_PARTIAL_GRAD

        super().__init__()
        self.tp_group = tp_group or parallel_state.get_tensor_model_parallel_group()
        # ``replicated``: the weight of a linear every TP rank holds whole (a router's), whose gradient flags the
        # adapter takes; it is neither split nor communicated
        self.replicated = replicated is not None
        tp = 1 if self.replicated else self.tp_group.size()
        self.parts, self.all_parts, self.layout, self.row_parallel = parts, all_parts, layout, row_parallel
        self.scaling, self.spec, self.tp = settings.scaling, spec, tp
        self.expert = expert  # the routed expert's global index; None for a dense linear
        self.sequence_parallel = sequence_parallel and tp > 1 and expert is None
        self.enabled = True
        self.dropout = torch.nn.Dropout(settings.dropout) if settings.dropout > 0 else torch.nn.Identity()
        local_in = in_size // tp if row_parallel else in_size
        # a routed expert's linear_fc1 always has one A: PEFT's experts.gate_up_proj (module docstring)
        a_names = (SHARED,) if (settings.shared_a or expert is not None) and len(parts) > 1 else parts
        self.lora_A = torch.nn.ParameterDict({
            name: torch.nn.Parameter(torch.empty(settings.rank, local_in, dtype=dtype, device=device))
            for name in a_names})
        self.lora_B = torch.nn.ParameterDict({
            name: torch.nn.Parameter(torch.zeros(out_sizes[name] if row_parallel else out_sizes[name] // tp,
                                                 settings.rank, dtype=dtype, device=device))
            for name in parts})
        self.out_sizes = {name: size if row_parallel else size // tp for name, size in out_sizes.items()}
        for param in self.lora_A.values():
            set_tensor_model_parallel_attributes(param, row_parallel, 1, 1)
            _init_a(param, settings.init_a, in_size)
        for param in self.lora_B.values():
            set_tensor_model_parallel_attributes(param, not row_parallel and not self.replicated, 0, 1)
        for param in (self.lora_B if row_parallel else self.lora_A).values():  # the replicated side
            param.sequence_parallel = self.sequence_parallel
            if expert is not None and tp > 1:
                setattr(param, ETP_PARTIAL_GRAD, True)
        for param in self.parameters():
            param.allreduce = allreduce
            if self.replicated:
                param.sequence_parallel = getattr(replicated, "sequence_parallel", False)
                setattr(param, TP_PARTIAL_GRAD, getattr(replicated, TP_PARTIAL_GRAD, False))

    def a_of(self, part: str) -> torch.nn.Parameter:
        return self.lora_A[SHARED] if SHARED in self.lora_A else self.lora_A[part]

    def _low_rank(self, x: torch.Tensor) -> torch.Tensor:
        """``A dropout(x)`` (every A's rows side by side), through the layer's communication."""
        from megatron.core.tensor_parallel.mappings import (copy_to_tensor_model_parallel_region,
                                                            gather_from_sequence_parallel_region,
                                                            reduce_from_tensor_model_parallel_region,
                                                            reduce_scatter_to_sequence_parallel_region)

        names = list(self.lora_A)
        h = torch.nn.functional.linear(self._dropped(x), torch.cat([self.lora_A[n] for n in names])
                                       if len(names) > 1 else self.lora_A[names[0]])
        if self.expert is not None or self.replicated:
            # explicit expert communication: the dispatcher sums the expert-TP ranks' terms; a router's input and weight
            # are whole on each rank (module docstring)
            return h
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel_region(h) if self.row_parallel \
                else gather_from_sequence_parallel_region(h, tensor_parallel_output_grad=True)
        return reduce_from_tensor_model_parallel_region(h) if self.row_parallel \
            else copy_to_tensor_model_parallel_region(h)

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        """``scaling * B (A dropout(x))`` in the linear's local output layout (this TP rank's rows)."""
        h = self._low_rank(x)
        names = list(self.lora_A)
        rank = self.lora_B[self.parts[0]].shape[1]
        by_a = dict(zip(names, h.split(rank, dim=-1)))
        deltas = {part: torch.nn.functional.linear(by_a[SHARED if SHARED in by_a else part], self.lora_B[part])
                  * self.scaling for part in self.parts}
        return self._assemble(deltas, h.shape[:-1])

    def added_to(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``out + delta(x)``; with one A feeding every part of the linear (one part, a shared A), the parts' B in
        the output layout and one ``addmm``: the adapter is two matrix products (a third kernel concatenates a fused
        layer's B), which matters where it runs once per routed expert."""
        if len(self.lora_A) > 1 or len(self.parts) < len(self.all_parts):
            return out + self.delta(x)
        h = self._low_rank(x)
        rank = h.shape[-1]
        b_t = self._assemble({part: self.lora_B[part].t() for part in self.parts}, (rank,))  # [r, output layout]
        return torch.addmm(out.reshape(-1, out.shape[-1]), h.reshape(-1, rank), b_t,
                           alpha=self.scaling).view(out.shape)

    def _dropped(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(self.dropout, torch.nn.Identity) or not self.training:
            return x
        if self.row_parallel or self.sequence_parallel:
            # Each TP rank holds other input columns (or sequence positions): draw its mask from megatron's
            # model-parallel RNG, as megatron does for any TP-split activation; a replicated input draws the same
            # mask everywhere.
            from megatron.core import tensor_parallel

            with tensor_parallel.get_cuda_rng_tracker().fork():
                return self.dropout(x)
        return self.dropout(x)

    def _assemble(self, deltas: dict[str, torch.Tensor], lead: torch.Size) -> torch.Tensor:
        def part(name: str) -> torch.Tensor:
            return deltas[name] if name in deltas else deltas[self.parts[0]].new_zeros(*lead, self.out_sizes[name])

        if self.layout == "single":
            return deltas[self.parts[0]]
        if self.layout == "concat":
            return torch.cat([part(name) for name in self.all_parts], dim=-1)
        groups = self.spec.num_kv_heads // self.tp
        per_group, head_dim = self.spec.num_attention_heads // self.spec.num_kv_heads, self.spec.head_dim
        heads = {"q_proj": per_group, "k_proj": 1, "v_proj": 1}
        grouped = [part(name).reshape(*lead, groups, heads[name], head_dim) for name in self.all_parts]
        return torch.cat(grouped, dim=-2).reshape(*lead, -1)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """megatron's distributed-checkpoint view: split parameters named with their TP axis."""
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        state = self.state_dict(prefix="", keep_vars=True)
        axes = {name: (1 if name.startswith("lora_A.") else 0) for name, param in state.items()
                if getattr(param, "tensor_model_parallel", False)}
        if self.expert is None or not metadata or "dp_cp_group" not in metadata:
            return make_sharded_tensors_for_checkpoint(state, prefix, axes, sharded_offsets)
        # inside an expert: its TP group is the expert-TP one (megatron's SequentialMLP adds the expert axis)
        return make_sharded_tensors_for_checkpoint(state, prefix, axes, sharded_offsets, tp_group=self.tp_group,
                                                   dp_cp_group=metadata["dp_cp_group"])


def _init_a(param: torch.Tensor, method: str, fan_in: int) -> None:
    """PEFT's kaiming-uniform(a=sqrt(5)) (bound 1/sqrt(in)), or xavier-normal (std sqrt(2/(in + rank)));
    computed on the full A's fan-in, so a TP-split A has the distribution of the unsplit one."""
    with torch.no_grad():
        if method == "kaiming":
            bound = 1.0 / math.sqrt(fan_in)
            param.uniform_(-bound, bound)
        else:
            param.normal_(0.0, math.sqrt(2.0 / (fan_in + param.shape[0])))


def _hook_router(adapter: LoraAdapter, router: torch.nn.Module) -> None:
    """Add the adapter's delta to the router's logits (megatron's ``gating``, in the router's dtype, e.g. verl's
    ``moe_router_dtype=fp32``): ``x (W + scaling B A)^T``, PEFT's ``mlp.gate.weight`` adapter."""
    gating = router.gating

    def adapted(input):
        logits = gating(input)
        return logits + adapter.delta(input).to(logits.dtype) if adapter.enabled else logits

    router.gating = adapted


def _hook(adapter: LoraAdapter, linear: torch.nn.Module) -> None:
    """Add the adapter's delta to the linear's output; a post-normed projection (Gemma 2/3) gets it before
    its norm: the input is kept by a pre-hook on the linear and the delta added to the norm's input."""
    if hasattr(linear, "post_norm"):
        held: list[torch.Tensor] = []

        def keep_input(module, args):
            held.append(args[0])

        def add_before_norm(module, args):
            x = held.pop()
            return (adapter.added_to(args[0], x),) + tuple(args[1:]) if adapter.enabled else None

        linear.register_forward_pre_hook(keep_input)
        linear.post_norm.register_forward_pre_hook(add_before_norm)
        return

    def add(module, args, kwargs, output):
        if not adapter.enabled:
            return None
        x = args[0] if args else kwargs["input_"]
        out, bias = output
        return adapter.added_to(out, x), bias

    linear.register_forward_hook(add, with_kwargs=True)


@dataclass(frozen=True)
class Site:
    """One linear a layer's adapters may sit on: its parent module, its name there, the HF module holding its parts
    inside ``model.layers.N`` (``self_attn``, ``mlp``, the shared expert's, ``mlp.experts``), and the routed
    expert's global index (None: a dense linear)."""

    parent: torch.nn.Module
    name: str
    hf_module: str
    expert: int | None = None


def layer_sites(layer: torch.nn.Module, spec) -> list[Site]:
    """The attention's two linears, then the MLP's: a dense MLP's, or an MoE layer's shared expert and its local
    routed experts (global index ``EP rank * local experts + k``, megatron's ``SequentialMLP`` order)."""
    from meshrl.models.families import SHARED_EXPERT_NAMES

    sites = [Site(layer.self_attention, "linear_qkv", "self_attn"),
             Site(layer.self_attention, "linear_proj", "self_attn")]
    mlp = layer.mlp
    if not hasattr(mlp, "experts"):
        return sites + [Site(mlp, "linear_fc1", "mlp"), Site(mlp, "linear_fc2", "mlp")]
    if getattr(mlp, "shared_experts", None) is not None:
        shared = SHARED_EXPERT_NAMES[spec.expert_names]
        sites += [Site(mlp.shared_experts, "linear_fc1", shared), Site(mlp.shared_experts, "linear_fc2", shared)]
    experts = mlp.experts
    if not hasattr(experts, "local_experts"):
        raise NotImplementedError(f"LoRA on {type(experts).__name__} experts is not built: meshrl adapts megatron's "
                                  "SequentialMLP experts (moe_grouped_gemm off)")
    first = experts.ep_group.rank() * experts.num_local_experts
    for k, expert in enumerate(experts.local_experts):
        sites += [Site(expert, "linear_fc1", EXPERTS_MODULE, first + k),
                  Site(expert, "linear_fc2", EXPERTS_MODULE, first + k)]
    return sites


def _sizes(spec, linear: torch.nn.Module, name: str) -> tuple[int, dict[str, int]]:
    """The linear's full input size and each of its HF parts' full output size."""
    parts, layout, _ = LINEARS[name]
    if layout == "qkv":
        q, kv = spec.num_attention_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        return linear.input_size, {"q_proj": q, "k_proj": kv, "v_proj": kv}
    return linear.input_size, {part: linear.output_size // len(parts) for part in parts}


def adapt(gpt: torch.nn.Module, settings: LoraSettings) -> None:
    """Freeze every parameter of one bare ``GPTModel`` chunk and add the adapters of ``settings.targets`` to
    its decoder layers (``<linear>_lora`` beside each adapted linear)."""
    from meshrl.parallel.model_builder import unwrap

    gpt = unwrap(gpt)
    if gpt.meshrl_uses_te:
        raise NotImplementedError("LoRA on Transformer Engine layers is not built: TE fuses the input norm into "
                                  "linear_qkv / linear_fc1, so the adapter would see the un-normed input")
    if gpt.meshrl_critic:
        raise NotImplementedError("LoRA adapts the policy only; the critic trains every weight")
    for param in gpt.parameters():
        param.requires_grad_(False)
    spec = gpt.meshrl_spec
    gpt.meshrl_lora = settings
    sample = next(gpt.parameters())
    experts = settings.experts and any(part in settings.targets for part in LINEARS["linear_fc1"][0] + ("down_proj",))
    if spec.moe and (experts or settings.router) and (problem := expert_lora_problem(settings)):
        raise ValueError(problem)
    for layer in gpt.decoder.layers:
        for site in layer_sites(layer, spec):
            all_parts, layout, row_parallel = LINEARS[site.name]
            parts = tuple(name for name in all_parts if name in settings.targets)
            if not parts or (site.expert is not None and not settings.experts):
                continue
            linear = getattr(site.parent, site.name)
            in_size, out_sizes = _sizes(spec, linear, site.name)
            adapter = LoraAdapter(parts, all_parts, in_size, out_sizes, row_parallel, layout, spec, settings,
                                  sample.dtype, sample.device, sequence_parallel=gpt.config.sequence_parallel,
                                  tp_group=linear.tp_group, expert=site.expert,
                                  allreduce=getattr(linear.weight, "allreduce", True))
            adapter.global_layer, adapter.hf_module = layer.layer_number - 1, site.hf_module
            site.parent.add_module(f"{site.name}_lora", adapter)
            _hook(adapter, linear)
        if settings.router and hasattr(layer.mlp, "router"):
            router = layer.mlp.router
            adapter = LoraAdapter(("gate",), ("gate",), spec.hidden_size, {"gate": router.weight.shape[0]}, False,
                                  "single", spec, settings, sample.dtype, sample.device, replicated=router.weight)
            adapter.global_layer, adapter.hf_module = layer.layer_number - 1, ROUTER_MODULE
            layer.mlp.add_module("router_lora", adapter)
            _hook_router(adapter, router)


def apply_lora(chunks: list[torch.nn.Module], settings: LoraSettings) -> list[torch.nn.Module]:
    """The chunks of ``model_builder.build_model`` with the base frozen and adapters added, re-wrapped in
    megatron DDP so that its gradient buffers (and hence the optimizer) hold the adapters only.

    Call after loading the base weights and before building the optimizer. The old wrappers' buffers are
    released (their ``main_grad`` views on the frozen parameters are dropped).
    """
    from megatron.core.distributed import DistributedDataParallel

    from meshrl.parallel.model_builder import model_config, unwrap

    config = model_config(chunks)
    ddp_config = chunks[0].ddp_config
    rewrapped = []
    for index, chunk in enumerate(chunks):
        gpt = unwrap(chunk)
        for param in gpt.parameters():
            for attribute in ("main_grad", "grad_added_to_main_grad"):
                if hasattr(param, attribute):
                    delattr(param, attribute)
        adapt(gpt, settings)
        rewrapped.append(DistributedDataParallel(config=config, ddp_config=ddp_config, module=gpt,
                                                 disable_bucketing=index > 0))
    # The schedule reaches the DDP wrappers through these hooks (build_model set them on the old ones).
    config.no_sync_func = [c.no_sync for c in rewrapped] if len(rewrapped) > 1 else rewrapped[0].no_sync
    if config.grad_sync_func is not None:
        config.grad_sync_func = ([c.start_grad_sync for c in rewrapped] if len(rewrapped) > 1
                                 else rewrapped[0].start_grad_sync)
    return rewrapped


def adapters(chunks: list[torch.nn.Module]) -> Iterator[tuple[int, LoraAdapter]]:
    """(chunk index, adapter) of every adapter in ``chunks``, in module order."""
    for index, chunk in enumerate(chunks):
        for module in chunk.modules():
            if isinstance(module, LoraAdapter):
                yield index, module


def has_adapters(chunks: list[torch.nn.Module]) -> bool:
    return any(True for _ in adapters(chunks))


@contextlib.contextmanager
def adapters_disabled(chunks: list[torch.nn.Module]) -> Iterator[None]:
    """Inside the block the chunks compute the base model (the adapters add nothing)."""
    found = [adapter for _, adapter in adapters(chunks)]
    for adapter in found:
        adapter.enabled = False
    try:
        yield
    finally:
        for adapter in found:
            adapter.enabled = True
