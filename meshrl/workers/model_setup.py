"""What a training role (the policy and its reference, the critic, the reward model) builds from its config
section, the same way for each: the optimizer's settings, megatron's transformer overrides (and the ``model`` stage's
rule on what they may not ask of the model), the starting weights, LoRA adapters."""

from __future__ import annotations

from typing import Any

from meshrl.config.refusals import Checked, refusal
from meshrl.models.families import model_spec


def optimizer_config(optim, distributed: bool):
    """``*.optim`` (verl's keys of both backends) → ``meshrl.parallel.optimizer.OptimizerConfig``, as verl's
    Megatron workers build the optimizer and ``OptimizerParamScheduler``: schedule sized in RL steps
    (``lr_decay_steps``, default ``total_training_steps``), warm-up ``lr_warmup_steps`` or, when that is
    not positive, ``int(lr_warmup_steps_ratio · lr_decay_steps)``; floor ``min_lr`` or ``lr·min_lr_ratio``."""
    from meshrl.config.run_plan import lr_decay_style
    from meshrl.parallel.optimizer import OptimizerConfig

    total = max(int(optim.total_training_steps), 1)
    decay = optim.lr_decay_steps or total
    warmup = optim.lr_warmup_steps if optim.lr_warmup_steps > 0 else int(optim.lr_warmup_steps_ratio * decay)
    schedule = lr_decay_style(optim).replace("inverse_square_root", "inverse-square-root")  # megatron's spelling
    return OptimizerConfig(
        lr=optim.lr, min_lr=optim.min_lr if optim.min_lr is not None else optim.lr * optim.min_lr_ratio,
        weight_decay=optim.weight_decay, betas=tuple(optim.betas), eps=optim.eps, clip_grad=optim.clip_grad,
        warmup_steps=warmup, warmup_init_lr=optim.lr_warmup_init, schedule=schedule,
        decay_steps=max(decay, warmup + 1) if schedule != "constant" else None,
        wsd_decay_steps=optim.lr_wsd_decay_steps, wsd_decay=optim.lr_wsd_decay_style,
        weight_decay_schedule=optim.weight_decay_incr_style, weight_decay_steps=total,
        schedule_from_checkpoint=optim.use_checkpoint_opt_param_scheduler,
        use_distributed_optimizer=distributed, overrides=tuple(sorted(optim.override_optimizer_config.items())),
    )


def transformer_overrides(model_cfg, megatron_cfg) -> dict[str, Any]:
    """TransformerConfig fields from ``megatron.override_transformer_config`` (verl's Megatron key), and
    ``megatron.sequence_parallel`` (the model builder turns it off at TP 1, as verl does). Without
    ``recompute_*`` fields there, ``model.enable_gradient_checkpointing`` (verl's FSDP key) means megatron's
    full-layer recompute, one layer per checkpoint."""
    overrides = dict(megatron_cfg.override_transformer_config)
    if megatron_cfg.sequence_parallel:
        overrides["sequence_parallel"] = True
    if model_cfg.enable_gradient_checkpointing and not any(k.startswith("recompute_") for k in overrides):
        overrides.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    return overrides


def load_initial_weights(chunks, megatron_cfg, model_dir: str, hf_config) -> None:
    """The model's starting weights: the HF checkpoint, or with ``megatron.use_dist_checkpointing`` the megatron
    distributed checkpoint at ``megatron.dist_checkpointing_path`` (its weights only)."""
    if megatron_cfg.use_dist_checkpointing:
        from meshrl.parallel.checkpoint import load_checkpoint

        load_checkpoint(megatron_cfg.dist_checkpointing_path, chunks)
    else:
        from meshrl.parallel.hf_conversion import load_hf_weights

        load_hf_weights(chunks, model_dir, hf_config)


def with_lora(chunks, plan):
    """``chunks`` with the run plan's LoRA adapters (``plan``: ``RunPlan.lora``) on their frozen base, started
    from the plan's PEFT adapter folder if it names one."""
    from meshrl.parallel.lora import LoraSettings, apply_lora
    from meshrl.parallel.peft_io import load_adapter

    chunks = apply_lora(chunks, LoraSettings(rank=plan.rank, alpha=plan.alpha, targets=plan.targets,
                                             dropout=plan.dropout, shared_a=plan.shared_a, init_a=plan.init_a,
                                             experts=plan.experts, router=plan.router))
    if plan.adapter_path:
        load_adapter(chunks, plan.adapter_path)
    return chunks


@refusal("model", "actor_rollout_ref.model.enable_gradient_checkpointing",
         "actor_rollout_ref.actor.megatron.override_transformer_config")
def deepstack_runs_without_full_recompute(c: Checked) -> list[str]:
    """Qwen3-VL's deepstack layers recompute with their features as checkpoint arguments in megatron's uniform loop
    (``vision_language.recompute_deepstack_layers``, what ``enable_gradient_checkpointing`` means); full recompute by
    another method is refused (``transformer_config`` refuses it at build too)."""
    arr = c.cfg.actor_rollout_ref
    overrides = transformer_overrides(arr.model, arr.actor.megatron)
    if not model_spec(c.hf_config).deepstack_layers or overrides.get("recompute_granularity") != "full" or \
            overrides.get("recompute_method") == "uniform":
        return []
    return [f"actor_rollout_ref.actor.megatron.override_transformer_config: recompute_method="
            f"{overrides.get('recompute_method')} with full recompute is not built with Qwen3-VL's deepstack features; "
            "set recompute_method=uniform (what model.enable_gradient_checkpointing sets), or selective recompute"]
