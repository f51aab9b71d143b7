"""megatron optimizer (AdamW), gradient clipping and learning-rate schedule for model chunks.

``build_optimizer`` wraps ``get_megatron_optimizer``: TE/apex fused Adam where available, else
torch's AdamW (the CPU case), switched to torch's fused kernel (``fused_adam``, on by default: one pass over
each parameter's weight, gradient and moments, as TE/apex's kernel on GPU; torch's default on CPU is a Python
loop of eight elementwise ops per parameter). The fused kernel computes the same update, rounded otherwise
(weights within 1 ulp after a step, ``tests/parallel/test_compiled_optimizer.py``). Precision follows the model:
fp32 params -> ``FP32Optimizer``; bf16 params
-> megatron's mixed precision on CPU as on GPU (``Float16OptimizerWithFloat16Params``, or the
distributed optimizer): fp32 main params, gradients and Adam state, the updated weights copied back
into the bf16 params. fp16 params are not supported: they need a loss scale wired into the schedule.
``use_distributed_optimizer`` shards optimizer state over data-parallel ranks (the model must have been
built with the same flag). Weight decay is megatron's standard: none for biases and 1-D parameters (norms).
An update whose loss or gradient norm is NaN or infinite is never applied (``train_step``); the caller
decides whether that stops the run.

The schedule is megatron's ``OptimizerParamScheduler``: linear warmup from ``warmup_init_lr`` over
``warmup_steps``, then ``constant`` / ``cosine`` / ``linear`` / ``inverse-square-root`` / ``WSD`` decay to
``min_lr`` at ``decay_steps``.
Schedule step ``k`` (0-based, ``k`` calls of ``advance_schedule`` so far) sets the learning rate
``lr(k)``. ``train_step`` with a scheduler advances it after its update (one step per update); RL
training passes none and advances once per RL step, so every mini-batch of RL step ``k`` uses ``lr(k)``
(verl's semantics, ``meshrl.workers.engine``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from meshrl.parallel.forward import LossFn, MicroBatch, OutputRequest
from meshrl.parallel.model_builder import model_config

LR_SCHEDULES = ("constant", "cosine", "linear", "inverse-square-root", "WSD")
WD_SCHEDULES = ("constant", "linear", "cosine")
WSD_DECAYS = ("linear", "cosine", "exponential", "minus_sqrt")


@dataclass(frozen=True)
class OptimizerConfig:
    lr: float = 1e-6
    min_lr: float = 0.0
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    clip_grad: float = 1.0
    warmup_steps: int = 0
    warmup_init_lr: float = 0.0
    schedule: str = "constant"
    decay_steps: int | None = None
    wsd_decay_steps: int | None = None  # the WSD schedule's final anneal
    wsd_decay: str = "exponential"
    weight_decay_schedule: str = "constant"
    weight_decay_steps: int = 1  # over which weight_decay_schedule runs (it starts and ends at weight_decay)
    # Resume takes the schedule's settings from the checkpoint (True) or from this config (False); its
    # position (step count) comes from the checkpoint either way.
    schedule_from_checkpoint: bool = True
    use_distributed_optimizer: bool = False
    fused_adam: bool = True  # torch's fused AdamW kernel where megatron falls back on torch's AdamW
    overrides: tuple[tuple[str, Any], ...] = ()  # megatron OptimizerConfig fields set directly

    def __post_init__(self) -> None:
        if self.schedule not in LR_SCHEDULES:
            raise ValueError(f"schedule {self.schedule!r} is not one of {LR_SCHEDULES}")
        if self.schedule == "WSD" and not self.wsd_decay_steps:
            raise ValueError("schedule 'WSD' needs wsd_decay_steps")
        if self.wsd_decay not in WSD_DECAYS:
            raise ValueError(f"wsd_decay {self.wsd_decay!r} is not one of {WSD_DECAYS}")
        if self.weight_decay_schedule not in WD_SCHEDULES:
            raise ValueError(f"weight_decay_schedule {self.weight_decay_schedule!r} is not one of {WD_SCHEDULES}")
        from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig

        unknown = [name for name, _ in self.overrides if name not in MegatronOptimizerConfig.__dataclass_fields__]
        if unknown:
            raise ValueError(f"megatron's OptimizerConfig has no field(s) {unknown}")
        if self.schedule != "constant" and self.decay_steps is None:
            raise ValueError(f"schedule {self.schedule!r} needs decay_steps")
        if self.decay_steps is not None and self.decay_steps <= self.warmup_steps:
            raise ValueError(f"decay_steps ({self.decay_steps}) must exceed warmup_steps ({self.warmup_steps})")
        if not 0.0 <= self.min_lr <= self.lr or self.warmup_init_lr > self.lr:
            raise ValueError("need 0 <= min_lr <= lr and warmup_init_lr <= lr")


def _inner_optimizers(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _use_fused_kernel(torch_optimizer: torch.optim.Optimizer) -> None:
    """Switch megatron's torch AdamW to torch's fused kernel (``torch.optim.AdamW(fused=True)``'s step), for
    parameters on a device torch has the kernel for; raises ``ValueError`` naming the device otherwise."""
    from torch.optim.optimizer import _get_fused_kernels_supported_devices

    devices = {p.device.type for group in torch_optimizer.param_groups for p in group["params"]}
    unsupported = devices - set(_get_fused_kernels_supported_devices())
    if unsupported:
        raise ValueError(f"torch has no fused AdamW kernel for {sorted(unsupported)}: set fused_adam=False")
    for group in torch_optimizer.param_groups:
        group.update(fused=True, foreach=False)
    torch_optimizer.defaults.update(fused=True, foreach=False)
    # What torch's constructor sets for fused=True: it unscales gradients itself under a GradScaler.
    torch_optimizer._step_supports_amp_scaling = True


def _with_step_state(init_state_fn):
    """megatron's Adam state initialiser plus torch AdamW's ``step``.

    Loading a checkpoint first initialises empty optimizer state to know its shapes; megatron's
    initialiser creates ``exp_avg`` / ``exp_avg_sq`` but not the ``step`` torch's AdamW needs
    (TE/apex Adam keep the step in the param group). Without it a loaded DistributedOptimizer fails.
    """
    def init(opt, config=None):
        init_state_fn(opt, config)
        for group in opt.param_groups:
            for param in group["params"]:
                state = opt.state[param]
                if state and "step" not in state:
                    # The fused kernel reads the step on the parameter's device.
                    device = param.device if group.get("fused") else None
                    state["step"] = torch.zeros((), dtype=torch.float32, device=device)

    return init


def _fix_distributed_optimizer_step_loading(inner) -> None:
    """Make a megatron DistributedOptimizer with torch AdamW loadable (megatron-core 0.16.1 gaps).

    Loading sets one shared ``step`` tensor into every parameter's state, then copies the checkpointed
    moments with ``_set_main_param_and_optimizer_states``, which copies *every* state key and fails on
    ``step`` (the checkpoint carries it separately). This instance-level wrapper hides ``step`` during
    that copy and puts back a private copy per parameter: a shared tensor would be incremented once
    per parameter at every ``optimizer.step()``, corrupting Adam's bias correction.
    """
    original = inner._set_main_param_and_optimizer_states

    def set_states(model_param, tensors):
        group, order = inner.model_param_group_index_map[model_param]
        param_state = inner.optimizer.state[inner.optimizer.param_groups[group]["params"][order]]
        step = param_state.pop("step", None) if "step" not in tensors else None
        try:
            original(model_param, tensors)
        finally:
            if step is not None:
                param_state["step"] = step.detach().clone()

    inner._set_main_param_and_optimizer_states = set_states


def _fill_missing_step_on_load(torch_optimizer: torch.optim.Optimizer) -> None:
    """Let torch's Adam load a state whose ``step`` megatron dropped (megatron-core 0.16.1 gap).

    ``FP32Optimizer.sharded_state_dict`` stores the shared step only ``if step:``, so a checkpoint
    taken before the first update (step 0) has moments but no step, and torch refuses to load it.
    A missing step means 0.
    """
    original = torch_optimizer.load_state_dict

    def load_state_dict(state_dict):
        for param_state in state_dict["state"].values():
            if param_state and "step" not in param_state:
                param_state["step"] = torch.zeros((), dtype=torch.float32)
        original(state_dict)

    torch_optimizer.load_state_dict = load_state_dict


def build_optimizer(chunks: list[torch.nn.Module], config: OptimizerConfig):
    """(megatron optimizer, ``OptimizerParamScheduler``) for ``chunks``; the LR of step 0 is set."""
    from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig
    from megatron.core.optimizer import get_megatron_optimizer

    model = model_config(chunks)
    ddp_flag = getattr(chunks[0], "ddp_config", None)
    if ddp_flag is not None and ddp_flag.use_distributed_optimizer != config.use_distributed_optimizer:
        raise ValueError("use_distributed_optimizer differs between the model (build_model) and the optimizer")
    megatron_config = MegatronOptimizerConfig(
        optimizer="adam",
        lr=config.lr,
        min_lr=config.min_lr,
        weight_decay=config.weight_decay,
        adam_beta1=config.betas[0],
        adam_beta2=config.betas[1],
        adam_eps=config.eps,
        clip_grad=config.clip_grad,
        bf16=model.bf16,
        fp16=model.fp16,
        params_dtype=model.params_dtype,
        use_distributed_optimizer=config.use_distributed_optimizer,
        **dict(config.overrides),
    )
    optimizer = get_megatron_optimizer(megatron_config, chunks)
    for inner in _inner_optimizers(optimizer):
        if isinstance(getattr(inner, "optimizer", None), torch.optim.AdamW | torch.optim.Adam):
            if config.fused_adam:
                _use_fused_kernel(inner.optimizer)
            if inner.init_state_fn is not None:
                inner.init_state_fn = _with_step_state(inner.init_state_fn)
            if hasattr(inner, "_set_main_param_and_optimizer_states"):
                _fix_distributed_optimizer_step_loading(inner)
            _fill_missing_step_on_load(inner.optimizer)
    return optimizer, build_scheduler(optimizer, config)


def build_scheduler(optimizer, config: OptimizerConfig):
    """megatron's ``OptimizerParamScheduler`` over ``optimizer``'s param groups; the LR of step 0 is set."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    return OptimizerParamScheduler(
        optimizer,
        init_lr=config.warmup_init_lr if config.warmup_steps else config.lr,
        max_lr=config.lr,
        min_lr=config.min_lr,
        lr_warmup_steps=config.warmup_steps,
        lr_decay_steps=config.decay_steps or config.warmup_steps + 1,
        lr_decay_style=config.schedule,
        start_wd=config.weight_decay,
        end_wd=config.weight_decay,
        wd_incr_steps=config.weight_decay_steps,
        wd_incr_style=config.weight_decay_schedule,
        # Resuming restores the schedule's position (and, if schedule_from_checkpoint, its settings) from
        # the checkpoint (see checkpoint.load_checkpoint).
        use_checkpoint_opt_param_scheduler=config.schedule_from_checkpoint,
        override_opt_param_scheduler=not config.schedule_from_checkpoint,
        wsd_decay_steps=config.wsd_decay_steps,
        lr_wsd_decay_style=config.wsd_decay,
    )


def initialize_state(optimizer) -> None:
    """Create empty Adam state (moments and ``step``) where there is none, e.g. before loading a checkpoint.

    megatron's DistributedOptimizer reads the state's ``step`` while describing what to load, before it
    initialises anything itself.
    """
    for inner in _inner_optimizers(optimizer):
        if inner.init_state_fn is not None:
            inner.init_state_fn(inner.optimizer, inner.config)


def zero_grad(chunks: list[torch.nn.Module], optimizer) -> None:
    """Clear the DDP grad buffers and the optimizer's gradients before accumulating a new step."""
    for chunk in chunks:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()


def current_lr(optimizer) -> float:
    return float(optimizer.param_groups[0]["lr"])


def advance_schedule(scheduler) -> None:
    """One schedule step: the learning rate (and weight decay) of the next step are set."""
    scheduler.step(1)


def optimizer_step(optimizer) -> dict[str, Any]:
    """Clip (``clip_grad``) and apply the accumulated gradients, unless their norm is NaN or infinite.

    megatron-core 0.16.1's ``ChainedOptimizer.step`` with one check added. megatron skips an update itself
    only under a loss scale (its found-inf check, still honoured here); with bf16 or fp32 parameters it
    would clip and apply anything, and clipping cannot repair a non-finite norm (NaN·c stays NaN; an
    infinite norm zeroes finite gradients while Adam's moments and weight decay still move the weights).
    The norm is reduced over megatron's gradient-statistics group (the model-parallel ranks; the whole
    world with the distributed optimizer), and data-parallel ranks hold the same reduced gradients, so
    every rank takes the same decision and a skipped update leaves weights and optimizer state untouched.

    Returns ``lr`` (the one used), ``grad_norm`` (before clipping, over the whole model; NaN where the
    found-inf check stopped first) and ``update_successful`` (False: skipped).
    """
    from megatron.core.optimizer import optimizer as megatron_optimizer

    lr = current_lr(optimizer)
    if optimizer.prepare_grads():
        return {"lr": lr, "grad_norm": float("nan"), "update_successful": False}
    grad_norm = float(optimizer.get_grad_norm())
    if not math.isfinite(grad_norm):
        return {"lr": lr, "grad_norm": grad_norm, "update_successful": False}
    for inner in _inner_optimizers(optimizer):
        params = [] if getattr(inner, "is_stub_optimizer", False) else inner.get_parameters()
        if params and inner.config.clip_grad > 0.0:
            # Looked up at call time: meshrl.parallel.cpu_compat wraps megatron's function on CPU.
            megatron_optimizer.clip_grad_by_total_norm_fp32(
                params, max_norm=inner.config.clip_grad, total_norm=grad_norm,
                use_decoupled_grad=inner.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8)
    return {"lr": lr, "grad_norm": grad_norm, "update_successful": bool(optimizer.step_with_ready_grads())}


def train_step(chunks: list[torch.nn.Module], optimizer, scheduler, micro_batches: list[MicroBatch],
               loss_fn: LossFn, request: OutputRequest = OutputRequest()) -> dict[str, Any]:
    """One optimizer update over ``micro_batches``: zero grads, forward/backward, clip, step; then one
    schedule step if ``scheduler`` is given and the update was applied (None: the caller advances it).

    The update is skipped (``update_successful`` False, weights and optimizer state untouched) when the
    global loss is NaN or infinite, or its gradient norm is (``optimizer_step``). The global loss is the
    same number on every rank, so all skip together; it is checked apart from the norm because a loss can
    be NaN where its gradient is not (a NaN masked to zero).
    ``loss_fn`` follows ``meshrl.parallel.schedule``'s contract (already globally normalised).
    Returns ``loss`` (global), per-micro-batch ``metrics``, ``lr``, ``grad_norm``, ``update_successful``.
    """
    from meshrl.parallel.schedule import forward_backward

    zero_grad(chunks, optimizer)
    result = forward_backward(chunks, micro_batches, loss_fn, request)
    if math.isfinite(result.loss):
        stats = optimizer_step(optimizer)
    else:
        stats = {"lr": current_lr(optimizer), "grad_norm": float("nan"), "update_successful": False}
    if scheduler is not None and stats["update_successful"]:
        advance_schedule(scheduler)
    return {"loss": result.loss, "metrics": result.metrics, **stats}
