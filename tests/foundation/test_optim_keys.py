"""verl's optimizer keys (both of its backends' names) → the learning rate of every RL step.

Expected values are written here from verl's definitions (its Megatron workers' ``OptimizerParamScheduler``
settings, its FSDP workers' warm-up + cosine), not computed by meshrl or megatron code.
"""

import math
from types import SimpleNamespace

import pytest

from meshrl.config import ConfigError, load_config
from meshrl.config.validate import validate_config
from meshrl.parallel.optimizer import advance_schedule, build_scheduler
from meshrl.workers.model_setup import optimizer_config

OPTIM = "actor_rollout_ref.actor.optim"


def lrs(overrides: list[str], steps: int) -> list[float]:
    """The learning rate of RL steps 0..steps-1 for ``actor.optim`` overrides (total_training_steps = steps)."""
    cfg = load_config([f"{OPTIM}.{o}" for o in overrides], recipe="cpu_tiny_grpo")
    validate_config(cfg)
    cfg.actor_rollout_ref.actor.optim.total_training_steps = steps
    optimizer = SimpleNamespace(param_groups=[{}])
    scheduler = build_scheduler(optimizer, optimizer_config(cfg.actor_rollout_ref.actor.optim, distributed=False))
    out = []
    for _ in range(steps):
        out.append(optimizer.param_groups[0]["lr"])
        advance_schedule(scheduler)
    return out


def test_megatron_keys_linear_decay_with_warmup_init_and_floor():
    got = lrs(["lr=1e-3", "lr_warmup_init=1e-4", "lr_warmup_steps=2", "lr_decay_style=linear", "min_lr=1e-5",
               "lr_decay_steps=6"], steps=9)

    def verl(k):
        if k <= 2:
            return 1e-4 + (1e-3 - 1e-4) * k / 2
        if k <= 6:
            return 1e-5 + (1 - (k - 2) / 4) * (1e-3 - 1e-5)
        return 1e-5

    assert got == pytest.approx([verl(k) for k in range(9)], rel=1e-12)


def test_fsdp_keys_cosine_with_warmup_ratio_and_min_ratio():
    got = lrs(["lr=1e-3", "warmup_style=cosine", "min_lr_ratio=0.1", "lr_warmup_steps_ratio=0.2"], steps=10)

    def verl(k, warmup=2, total=10, ratio=0.1):
        if k < warmup:
            return 1e-3 * k / warmup
        progress = (k - warmup) / (total - warmup)
        return 1e-3 * max(ratio, (1 + ratio) / 2 + (1 - ratio) / 2 * math.cos(math.pi * progress))

    assert got == pytest.approx([verl(k) for k in range(10)], rel=1e-12)


def test_zero_warmup_steps_falls_back_on_the_ratio_as_verl():
    got = lrs(["lr=1e-3", "lr_warmup_steps=0", "lr_warmup_steps_ratio=0.5"], steps=4)
    assert got == pytest.approx([0.0, 5e-4, 1e-3, 1e-3], rel=1e-12)


def test_wsd_and_inverse_square_root():
    wsd = lrs(["lr=1e-3", "lr_decay_style=WSD", "lr_wsd_decay_steps=3", "lr_wsd_decay_style=linear"], steps=9)
    # decay over the 9 RL steps: constant until step 9 - 3 = 6, then a linear anneal towards 0 at step 9
    assert wsd == pytest.approx([1e-3] * 7 + [1e-3 * (1 - j / 3) for j in (1, 2)], rel=1e-12)
    isr = lrs(["lr=1e-3", "lr_decay_style=inverse_square_root", "lr_warmup_steps=4", "min_lr=1e-4"], steps=30)
    assert isr[:5] == pytest.approx([1e-3 * k / 4 for k in range(5)], rel=1e-12)
    assert isr[5:] == pytest.approx([max(1e-4, 1e-3 * 2 / math.sqrt(k)) for k in range(5, 30)], rel=1e-12)


def test_clip_and_optimizer_overrides_reach_megatron():
    cfg = load_config([f"{OPTIM}.clip_grad=0.25", f"+{OPTIM}.override_optimizer_config.adam_beta2=0.95"],
                      recipe="cpu_tiny_grpo")
    validate_config(cfg)
    config = optimizer_config(cfg.actor_rollout_ref.actor.optim, distributed=False)
    assert config.clip_grad == 0.25 and dict(config.overrides) == {"adam_beta2": 0.95}


@pytest.mark.parametrize("overrides, key", [
    (["min_lr=1e-6", "min_lr_ratio=0.1"], "min_lr"),
    (["lr_decay_style=linear", "warmup_style=cosine"], "lr_decay_style"),
    (["lr_decay_style=WSD"], "lr_wsd_decay_steps"),
    (["lr_decay_style=exponential"], "lr_decay_style"),
    (["num_cycles=1.0"], "num_cycles"),
    (["optimizer=sgd"], "optimizer"),
    (["lr=1e-6", "lr_warmup_init=1e-5"], "lr_warmup_init"),
    (["+override_optimizer_config.adam_beta=0.9"], "adam_beta1"),  # the did-you-mean
])
def test_conflicting_or_unsupported_optimizer_keys_are_refused(overrides, key):
    with pytest.raises(ConfigError, match=key):
        validate_config(load_config([f"{o[0]}{OPTIM}.{o[1:]}" if o.startswith("+") else f"{OPTIM}.{o}"
                                     for o in overrides], recipe="cpu_tiny_grpo"))
