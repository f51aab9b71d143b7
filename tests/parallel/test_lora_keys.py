"""verl's LoRA keys (FSDP and Megatron spellings) -> the run plan's ``LoraPlan``, or a refusal naming the key."""

from __future__ import annotations

import json

import pytest

from meshrl.config import ConfigError, load_config
from meshrl.config.validate import validate_config
from meshrl.config.checkpoint_contents import hf_export_roles

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
M = "actor_rollout_ref.model."


def plan_of(*overrides: str):
    return validate_config(load_config(list(overrides), recipe="cpu_tiny_grpo"))


def test_no_lora_by_default() -> None:
    assert plan_of().lora is None


@pytest.mark.parametrize("overrides,targets", [
    ([f"{M}target_modules=all-linear"], ALL),
    ([f"{M}target_modules=[v_proj,q_proj]"], ("q_proj", "v_proj")),
    ([f"{M}target_modules='.*\\.(q|up)_proj'"], ("q_proj", "up_proj")),  # PEFT: a string is a regex
    ([f"{M}exclude_modules='.*visual.*'"], ALL),  # matches no module of a text model (verl's VL script)
    ([f"{M}exclude_modules=[o_proj,down_proj]"], ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")),
])
def test_fsdp_keys_are_peft_adapters(overrides, targets) -> None:
    lora = plan_of(f"{M}lora_rank=16", f"{M}lora_alpha=32", *overrides).lora
    assert (lora.rank, lora.alpha, lora.targets, lora.dropout, lora.shared_a, lora.init_a, lora.keys) == \
        (16, 32.0, targets, 0.0, False, "kaiming", "FSDP")


def test_megatron_keys_fused_and_canonical() -> None:
    plan = plan_of(f"{M}lora.rank=8")
    assert (plan.lora.rank, plan.lora.alpha, plan.lora.targets, plan.lora.shared_a, plan.lora.init_a) == \
        (8, 32.0, ALL, True, "xavier")
    assert not plan.lora.merge  # verl's default: the engine gets the adapters
    canonical = plan_of(f"{M}lora.rank=8", f"{M}lora.type=canonical_lora", f"{M}lora.merge=True",
                        f"{M}lora.target_modules=[linear_q,linear_fc1_up]", f"{M}lora.dropout=0.05",
                        f"{M}lora.lora_A_init_method=kaiming")
    assert (canonical.lora.targets, canonical.lora.shared_a, canonical.lora.dropout, canonical.lora.init_a) == \
        (("q_proj", "up_proj"), False, 0.05, "kaiming")
    assert canonical.lora.merge and not any("lora.merge" in warning for warning in canonical.warnings)
    excluded = plan_of(f"{M}lora.rank=8", f"{M}lora.target_modules=[]", f"{M}lora.exclude_modules=[linear_fc1]")
    assert excluded.lora.targets == ("q_proj", "k_proj", "v_proj", "o_proj", "down_proj")


@pytest.mark.parametrize("overrides,named", [
    ([f"{M}lora_rank=8", f"{M}lora.rank=8"], "not both"),
    ([f"{M}lora.rank=8", f"{M}lora.type=dora"], "lora.type=dora"),
    ([f"{M}lora.rank=8", f"{M}lora.target_modules=['*.layers.0.*.linear_qkv']"], "wildcards"),
    ([f"{M}lora.rank=8", f"{M}lora.exclude_modules=[linear_proj]"], "set target_modules=[]"),
    ([f"{M}lora.rank=8", f"{M}lora.dropout_position=post"], "dropout_position=post"),
    ([f"{M}lora.rank=8", f"{M}lora.a2a_experimental=True"], "a2a_experimental"),
    ([f"{M}lora.rank=8", f"{M}lora.dtype=bfloat16"], "lora.dtype"),
    ([f"{M}lora_rank=8", f"{M}target_modules=[lm_head]"], "lm_head"),
    ([f"{M}lora_rank=8", "actor_rollout_ref.model.target_modules='.*layers\\.0\\..*'"], "per-layer LoRA"),
    ([f"{M}lora_rank=8", f"{M}exclude_modules=[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj]"],
     "no linear layer"),
    # a key of the other spelling would not be read
    ([f"{M}lora_rank=8", f"{M}lora.alpha=64"], f"{M}lora.alpha"),
    ([f"{M}lora.rank=8", f"{M}target_modules=[q_proj]"], f"{M}target_modules"),
    # vLLM's adapter path serves ranks up to 512, as verl checks
    ([f"{M}lora_rank=1024"], "lora.merge=True"),
])
def test_unbuildable_lora_settings_are_refused(overrides, named) -> None:
    with pytest.raises(ConfigError) as info:
        plan_of(*overrides)
    assert named in str(info.value)


def test_lora_merge_picks_how_the_engine_gets_the_policy() -> None:
    """verl reads model.lora.merge with both spellings; the transformers engine has no adapter path."""
    assert plan_of(f"{M}lora_rank=8", f"{M}lora.merge=True").lora.merge
    assert plan_of(f"{M}lora_rank=1024", f"{M}lora.merge=True").lora.rank == 1024  # merged: any rank
    hf = plan_of(f"{M}lora_rank=8", "actor_rollout_ref.rollout.name=hf")
    assert hf.lora.merge and any("rollout.name=hf has no LoRA adapter path" in note for note in hf.warnings)


def test_an_adapter_folder_gives_the_lora_as_in_verl(tmp_path) -> None:
    folder = tmp_path / "lora_adapter"
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 16, "lora_alpha": 32, "lora_dropout": 0.05, "target_modules": ["v_proj", "q_proj"]}))
    lora = plan_of(f"{M}lora_adapter_path={folder}").lora
    assert (lora.rank, lora.alpha, lora.targets, lora.dropout, lora.adapter_path) == \
        (16, 32.0, ("q_proj", "v_proj"), 0.05, str(folder))
    for overrides, named in (([f"{M}lora_rank=8"], "has rank 16"),
                             ([f"{M}lora_alpha=64"], f"{M}lora_alpha: the adapter")):
        with pytest.raises(ConfigError, match=named):
            plan_of(f"{M}lora_adapter_path={folder}", *overrides)
    with pytest.raises(ConfigError, match="adapter_config.json is missing"):
        plan_of(f"{M}lora_adapter_path={tmp_path / 'nowhere'}")


def test_hf_export_with_lora_is_accepted() -> None:
    """The export is the merged model (``tests/parallel/test_lora_export.py``)."""
    cfg = load_config([f"{M}lora_rank=8", "actor_rollout_ref.actor.checkpoint.save_contents=[model,optimizer,extra,"
                                          "hf_model]"], recipe="cpu_tiny_grpo")
    assert hf_export_roles(cfg, with_critic=False) == ["actor"]
