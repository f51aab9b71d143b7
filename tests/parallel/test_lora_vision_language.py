"""LoRA on a vision-language model's language model (verl's ``examples/tuning/lora/run_qwen2_5_vl_7b_fsdp.sh``:
``target_modules=all-linear``, ``exclude_modules='.*visual.*'``), checked against PEFT on transformers' own class:
tiny Qwen2.5-VL and Qwen3-VL trained two steps on image prompts at TP1 (the tower frozen with the base), then PEFT
loads the saved adapter and gives the trainer's log-probs; the merged weights the engine is sent, loaded by
transformers from a checkpoint folder, give them too."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from vl_checks import hf_log_probs, micro_batches, sample_log_probs, samples

from meshrl.parallel import hf_conversion, lora, model_builder, optimizer, peft_io, schedule, state
from meshrl.parallel.forward import OutputRequest

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
OPT = optimizer.OptimizerConfig(lr=1e-2, weight_decay=0.0, clip_grad=0.0)
REQUEST = OutputRequest(remove_padding=True)


@pytest.fixture(scope="module")
def tp1():
    state.initialize(state.ParallelConfig())
    yield
    state.destroy()


def _loss(outputs: dict, mb: dict):
    return -(outputs["log_probs"] * mb["weights"] * mb["attention_mask"]).sum(), {}


def _hf(model_class, path, items) -> list[torch.Tensor]:
    model = model_class.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        return [hf_log_probs(model, item) for item in items]


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


@pytest.mark.parametrize("model_type", ["qwen2_5_vl", "qwen3_vl"])
def test_lora_on_the_language_model_matches_peft(tp1, tmp_path, model_type: str) -> None:
    import transformers
    from peft import PeftModel
    from safetensors.torch import save_file

    from meshrl.models.families import family
    from meshrl.models.tiny_vision import tiny_vl_model_dir

    path = tiny_vl_model_dir(model_type)
    config = transformers.AutoConfig.from_pretrained(path)
    model_class = getattr(transformers, family(model_type).policy_class)
    chunks = model_builder.build_model(config)
    hf_conversion.load_hf_weights(chunks, path)
    tower_before = {name: tensor.clone() for name, tensor in hf_conversion.iter_hf_weights(chunks, config)
                    if "visual." in name}
    chunks = lora.apply_lora(chunks, lora.LoraSettings(rank=4, alpha=8, targets=ALL))
    items = samples(path)
    batches = micro_batches(items)
    opt, _ = optimizer.build_optimizer(chunks, OPT)
    for _ in range(2):
        optimizer.train_step(chunks, opt, None, batches, _loss, REQUEST)
    mine = sample_log_probs(batches, schedule.forward_only(chunks, batches, REQUEST))

    folder = peft_io.save_adapter(chunks, tmp_path / "adapter", base_model=str(path))
    assert json.loads((folder / peft_io.CONFIG_FILE).read_text())["exclude_modules"] == ".*visual.*"
    peft_model = PeftModel.from_pretrained(
        model_class.from_pretrained(path, dtype=torch.float32, attn_implementation="eager"), folder).eval()
    adapted = {name.split(".lora_")[0] for name, _ in peft_model.named_parameters() if ".lora_" in name}
    assert adapted and not any("visual" in name for name in adapted)
    assert len(adapted) == len(ALL) * config.text_config.num_hidden_layers
    with torch.no_grad():
        theirs = [hf_log_probs(peft_model, item) for item in items]
        assert _max_diff(mine, theirs) < 1e-5
        with peft_model.disable_adapter():  # the adapters moved the outputs
            assert _max_diff(mine, [hf_log_probs(peft_model, item) for item in items]) > 1e-3

    # What the engine is sent: the base with each adapted weight merged, the tower untouched (checkpoint names)
    merged = {name: tensor.clone() for name, tensor in peft_io.iter_merged_weights(chunks, config)}
    assert all(torch.equal(merged[name], tensor) for name, tensor in tower_before.items())
    out = tmp_path / "merged"
    out.mkdir()
    shutil.copy(path / "config.json", out / "config.json")
    save_file(merged, str(out / "model.safetensors"))
    assert _max_diff(mine, _hf(model_class, out, items)) < 1e-5


@pytest.mark.parametrize("model_type, target, exclude, targets, refused", [
    ("qwen2_5_vl", "all-linear", ".*visual.*", ALL, []),  # verl's VL LoRA script
    ("qwen2_5_vl", "all-linear", None, ALL, ["vision tower"]),  # PEFT would adapt every tower linear too
    ("qwen2_5_vl", ["q_proj", "v_proj"], None, ("q_proj", "v_proj"), []),  # the tower has no such names
    ("qwen2_5_vl", ["gate_proj", "up_proj"], None, ("gate_proj", "up_proj"), ["vision tower"]),  # its MLP has
    ("qwen3_vl", ["gate_proj", "up_proj"], None, ("gate_proj", "up_proj"), []),  # Qwen3-VL's tower MLP: linear_fc*
    ("qwen2_5_vl", r".*\.(q|v)_proj", None, ("q_proj", "v_proj"), []),
    # resolved by meshrl against a text model's paths; in transformers' VL class the regex selects nothing
    ("qwen2_5_vl", r"model\.layers\.\d+\.self_attn\.(q|v)_proj", None, ("q_proj", "v_proj"), ["no projection"]),
])
def test_settings_with_which_peft_would_adapt_other_modules_are_refused(model_type, target, exclude, targets, refused):
    """PEFT's selection in transformers' own class (the modules verl's FSDP LoRA adapts) against meshrl's adapters on
    the language model: a tower module or another projection is refused, naming what PEFT would adapt; PEFT itself,
    on the same class, adapts what the refusals say."""
    from peft import LoraConfig
    from peft.tuners.tuners_utils import _maybe_include_all_linear_layers, check_target_module_exists
    from transformers import AutoConfig

    from meshrl.models.families import family
    from meshrl.models.hf_classes import hf_class
    from meshrl.models.tiny_vision import tiny_vl_model_dir
    from meshrl.parallel.lora_limits import vision_language_lora_problems

    config = AutoConfig.from_pretrained(tiny_vl_model_dir(model_type))
    found = vision_language_lora_problems(config, target, exclude, targets)
    assert len(found) == len(refused) and all(word in line for word, line in zip(refused, found)), found
    with torch.device("meta"):
        model = hf_class(family(model_type).policy_class)._from_config(config)
    peft_config = _maybe_include_all_linear_layers(LoraConfig(target_modules=target, exclude_modules=exclude), model)
    chosen = [name for name, module in model.named_modules()
              if isinstance(module, torch.nn.Linear) and check_target_module_exists(peft_config, name)]
    assert any(".visual." in name for name in chosen) == ("vision tower" in refused)
    language = {name.rsplit(".", 1)[-1] for name in chosen if ".language_model." in name}
    assert (language == set(targets)) == ("no projection" not in refused)
