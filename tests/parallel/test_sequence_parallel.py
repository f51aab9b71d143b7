"""Megatron sequence parallelism (``megatron.sequence_parallel``), single process: the key reaches megatron's
TransformerConfig for every role, TP 1 turns it off as verl does, the refusals, the row layout's width at a
multiple of TP, and ``meshrl plan``'s activations. SP on vs off at TP2 (outputs, values and gradients, packed and
padded, with PP2 and MoE) runs in ``mp_worker.py`` (``check_sequence_parallel``) and ``moe_worker.py``."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig

from meshrl.config import ConfigError, load_config
from meshrl.config.validate import validate_config
from meshrl.parallel import state
from meshrl.parallel.forward import trim_rows, unpack
from meshrl.parallel.model_builder import build_forward_only_model, model_config
from meshrl.memory_plan import estimate
from meshrl.workers.model_setup import transformer_overrides

ACTOR = "actor_rollout_ref.actor.megatron"


def validated(*overrides, recipe="cpu_tiny_grpo"):
    cfg = load_config(list(overrides), recipe=recipe)
    return cfg, validate_config(cfg)


def test_the_key_reaches_the_transformer_config_and_tp1_turns_it_off(tiny_llama_dir):
    cfg, run = validated(f"{ACTOR}.sequence_parallel=True")
    overrides = transformer_overrides(cfg.actor_rollout_ref.model, cfg.actor_rollout_ref.actor.megatron)
    assert overrides["sequence_parallel"] is True
    # the recipe runs at TP 1: a start-up note says it is off, as verl's engine warns
    notes = [note for note in run.warnings if "sequence_parallel" in note]
    assert len(notes) == 1 and notes[0].startswith(f"{ACTOR}.sequence_parallel=True") and "off" in notes[0]
    state.initialize(state.ParallelConfig())
    try:
        with pytest.warns(UserWarning, match="tensor_model_parallel_size=1: off"):
            chunks = build_forward_only_model(AutoConfig.from_pretrained(tiny_llama_dir), **overrides)
        assert model_config(chunks).sequence_parallel is False
    finally:
        state.destroy()
    plain, run = validated()
    assert "sequence_parallel" not in transformer_overrides(plain.actor_rollout_ref.model,
                                                            plain.actor_rollout_ref.actor.megatron)
    assert not [note for note in run.warnings if "sequence_parallel" in note]


@pytest.mark.parametrize("overrides, key", [
    ([f"+{ACTOR}.override_transformer_config.sequence_parallel=True"],
     f"{ACTOR}.override_transformer_config.sequence_parallel"),
    # the reference runs in the actor's layout: it may repeat the actor's value, not change it
    (["actor_rollout_ref.ref.megatron.sequence_parallel=True"], "actor_rollout_ref.ref.megatron.sequence_parallel"),
])
def test_refusals(overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        validated(*overrides)


def test_rows_are_padded_to_a_multiple_of_tp_and_unpack_the_same():
    ids = torch.arange(1, 22).view(3, 7)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # left padding
    mask[2, 3:] = 0  # right padding
    plain, padded = trim_rows(ids, mask), trim_rows(ids, mask, width_multiple=4)
    assert plain.input_ids.shape == (3, 7) and padded.input_ids.shape == (3, 8)
    # every row's tokens in front, as before; what follows them is never attended to nor read back
    assert torch.equal(padded.input_ids[:, :7][mask.sort(dim=1, descending=True).values.bool()],
                       plain.input_ids[mask.sort(dim=1, descending=True).values.bool()])
    for inputs in (plain, padded):
        # position p's value read back at token p + 1 of the same row
        values = inputs.input_ids.float()
        assert torch.equal(unpack(values, inputs), torch.where(
            mask.bool() & (mask.cumsum(1) > 1), ids.roll(1, dims=1).float(), torch.zeros(3, 7)))


def test_plan_splits_every_activation_over_tp():
    """At TP 2 with sequence parallelism a layer keeps half of what TP 1 keeps (the same token budget per GPU);
    without it, the replicated norm and projection inputs stay whole. Full recompute keeps each layer's input."""
    recipe, tp2 = "grpo_qwen2-7b_math", f"{ACTOR}.tensor_model_parallel_size=2"
    no_recompute = "actor_rollout_ref.model.enable_gradient_checkpointing=False"

    def actor_activations(*overrides):
        cfg = load_config(list(overrides), recipe=recipe)
        validate_config(cfg)
        result = estimate(cfg)
        update = next(p for p in result.phases if p.name == "actor update")
        return update.items["actor activations"], result

    tp1, _ = actor_activations(no_recompute, f"{ACTOR}.tensor_model_parallel_size=1")
    off, _ = actor_activations(no_recompute, tp2)
    on, result = actor_activations(no_recompute, tp2, f"{ACTOR}.sequence_parallel=True")
    assert result.layout["sequence_parallel"] and on == pytest.approx(tp1 / 2) and off > on * 1.05
    recompute_off, _ = actor_activations(tp2)
    recompute_on, _ = actor_activations(tp2, f"{ACTOR}.sequence_parallel=True")
    assert recompute_on < recompute_off
