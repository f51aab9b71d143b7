"""LoRA on the Megatron policy, in process at TP1 (TP2 / PP2 gradients: ``test_lora_multiproc.py``).

Independent references: the model without adapters (step 1 must equal it), PEFT's own ``PeftModel`` on the
HF model loading the adapter meshrl saved (logits), and the HF model loading the merged weights.
"""

from __future__ import annotations

import math

import pytest
import torch
from mp_worker import build, hf_model, hf_outputs, make_micro_batches, policy_loss

from meshrl.parallel import lora, optimizer, peft_io, schedule, state
from meshrl.parallel.forward import OutputRequest

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
REQUEST = OutputRequest(entropy=True)
OPT = optimizer.OptimizerConfig(lr=1e-2, weight_decay=0.0, clip_grad=0.0)


@pytest.fixture(scope="module")
def tp1():
    state.initialize(state.ParallelConfig())
    yield
    state.destroy()


def lora_model(path, settings: lora.LoraSettings):
    return lora.apply_lora(build(path), settings)


def train(chunks, steps: int) -> None:
    opt, _ = optimizer.build_optimizer(chunks, OPT)
    for _ in range(steps):
        optimizer.train_step(chunks, opt, None, make_micro_batches(), policy_loss, REQUEST)


def outputs(chunks) -> list[dict[str, torch.Tensor]]:
    return schedule.forward_only(chunks, make_micro_batches(), REQUEST)


def max_diff(a, b) -> float:
    return max(float((x[k] - y[k]).abs().max()) for x, y in zip(a, b) for k in x)


@pytest.mark.parametrize("kwargs,problem", [
    (dict(rank=0, alpha=16, targets=ALL), "rank must be >= 1"),
    (dict(rank=8, alpha=16, targets=("q_proj", "lm_head")), "lm_head"),
    (dict(rank=8, alpha=16, targets=()), "none"),
    (dict(rank=8, alpha=16, targets=ALL, dropout=1.0), "dropout"),
    (dict(rank=8, alpha=16, targets=ALL, init_a="gaussian"), "gaussian"),
])
def test_bad_settings_are_refused(kwargs, problem) -> None:
    with pytest.raises(ValueError, match=problem):
        lora.LoraSettings(**kwargs)


def test_base_frozen_step_one_equals_base_reference_is_adapters_off(tp1, tiny_llama_dir) -> None:
    base_out = outputs(build(tiny_llama_dir))
    chunks = lora_model(tiny_llama_dir, lora.LoraSettings(rank=4, alpha=8, targets=ALL))
    gpt = chunks[0].module
    trainable = {name for name, p in gpt.named_parameters() if p.requires_grad}
    assert trainable and all("_lora.lora_" in name for name in trainable)
    # Only the adapters have DDP gradient buffers, and the optimizer holds only them.
    buffered = sum(buffer.grad_data.numel() for buffer in chunks[0].buffers)
    assert buffered == sum(p.numel() for name, p in gpt.named_parameters() if name in trainable)
    opt, _ = optimizer.build_optimizer(chunks, OPT)
    assert {id(p) for p in opt.get_parameters()} == {id(p) for n, p in gpt.named_parameters() if n in trainable}
    # A: PEFT's kaiming-uniform(a=sqrt(5)) bound 1/sqrt(fan_in); B = 0.
    for _, adapter in lora.adapters(chunks):
        for a in adapter.lora_A.values():
            assert 0.5 / math.sqrt(a.shape[1]) < float(a.abs().max()) <= 1 / math.sqrt(a.shape[1])
        assert all(float(b.abs().max()) == 0 for b in adapter.lora_B.values())
    step1 = outputs(chunks)
    assert max_diff(step1, base_out) < 1e-6  # megatron's frozen-weight linear, otherwise the same model
    with lora.adapters_disabled(chunks):
        assert max_diff(outputs(chunks), step1) == 0.0
    frozen = {n: p.detach().clone() for n, p in gpt.named_parameters() if n not in trainable}
    before = {n: p.detach().clone() for n, p in gpt.named_parameters() if n in trainable}
    train(chunks, 3)
    assert all(torch.equal(p, frozen[n]) for n, p in gpt.named_parameters() if n in frozen)
    assert all(not torch.equal(p, before[n]) for n, p in gpt.named_parameters() if n in before)
    assert max_diff(outputs(chunks), step1) > 1e-3
    with lora.adapters_disabled(chunks):
        assert max_diff(outputs(chunks), step1) == 0.0


def hf_log_probs(model, batches) -> list[torch.Tensor]:
    with torch.no_grad():
        return [hf_outputs(model, mb, critic=False)["log_probs"] for mb in batches]


@pytest.mark.parametrize("fixture,settings", [
    ("tiny_llama_dir", lora.LoraSettings(rank=4, alpha=16, targets=ALL)),
    # fused (verl's Megatron lora: one A per fused layer), a subset of parts, xavier, dropout while training
    ("tiny_qwen2_dir", lora.LoraSettings(rank=8, alpha=8, targets=("q_proj", "v_proj", "up_proj", "down_proj"),
                                         shared_a=True, init_a="xavier", dropout=0.1)),
], ids=["llama-all-linear", "qwen2-fused-subset"])
def test_peft_loads_the_saved_adapter_with_the_trainers_outputs(tp1, request, tmp_path, fixture, settings) -> None:
    from peft import PeftModel

    path = request.getfixturevalue(fixture)
    chunks = lora_model(path, settings)
    train(chunks, 3)
    mine = [o["log_probs"] for o in outputs(chunks)]
    folder = peft_io.save_adapter(chunks, tmp_path / "adapter", base_model=str(path))
    assert sorted(p.name for p in folder.iterdir()) == [peft_io.CONFIG_FILE, peft_io.WEIGHTS_FILE]
    hf = hf_model(path, critic=False)
    peft_model = PeftModel.from_pretrained(hf, folder).eval()
    batches = make_micro_batches()
    theirs = hf_log_probs(peft_model, batches)
    assert max(float((m - t).abs().max()) for m, t in zip(mine, theirs)) < 1e-5
    # Without the adapter PEFT's model is the base: the adapter really moved the outputs.
    with peft_model.disable_adapter():
        assert max(float((m - t).abs().max()) for m, t in zip(mine, hf_log_probs(peft_model, batches))) > 1e-3
    # The merged weights (what the engine is sent) in the HF model.
    merged = hf_model(path, critic=False)
    missing, unexpected = merged.load_state_dict(dict(peft_io.iter_merged_weights(chunks, merged.config)),
                                                 strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    merged.tie_weights()
    assert max(float((m - t).abs().max()) for m, t in zip(mine, hf_log_probs(merged.eval(), batches))) < 1e-5
    # Loading the adapter back (resume) into fresh adapters gives the same model.
    fresh = lora_model(path, settings)
    peft_io.load_adapter(fresh, folder)
    assert max_diff(outputs(fresh), outputs(chunks)) == 0.0


def test_load_adapter_refuses_other_settings(tp1, tiny_llama_dir, tmp_path) -> None:
    chunks = lora_model(tiny_llama_dir, lora.LoraSettings(rank=4, alpha=16, targets=ALL))
    folder = peft_io.save_adapter(chunks, tmp_path / "adapter")
    other = lora_model(tiny_llama_dir, lora.LoraSettings(rank=8, alpha=16, targets=("q_proj",)))
    with pytest.raises(ValueError, match=r"r: adapter 4, run 8.*target_modules"):
        peft_io.load_adapter(other, folder)
    # per-module A's (kaiming draws differ) cannot become the one A a fused adapter shares
    fused = lora_model(tiny_llama_dir, lora.LoraSettings(rank=4, alpha=16, targets=ALL, shared_a=True))
    with pytest.raises(ValueError, match="k_proj.lora_A.weight differs from the q_proj A"):
        peft_io.load_adapter(fused, folder)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_distributed_optimizer_and_bf16_train_the_adapters_only(tp1, tiny_llama_dir, dtype) -> None:
    chunks = lora.apply_lora(build(tiny_llama_dir, use_distributed_optimizer=True, dtype=dtype),
                             lora.LoraSettings(rank=4, alpha=8, targets=("q_proj", "down_proj")))
    opt, _ = optimizer.build_optimizer(chunks, optimizer.OptimizerConfig(lr=1e-2, use_distributed_optimizer=True))
    gpt = chunks[0].module
    before = {name: p.detach().clone() for name, p in gpt.named_parameters()}
    for _ in range(2):
        assert optimizer.train_step(chunks, opt, None, make_micro_batches(), policy_loss, REQUEST)["update_successful"]
    changed = sorted(name for name, p in gpt.named_parameters() if not torch.equal(p, before[name]))
    # 2 layers x (q_proj's A and B in linear_qkv_lora, down_proj's in linear_fc2_lora)
    assert len(changed) == 8 and all("_lora.lora_" in name for name in changed), changed


@pytest.mark.parametrize("shared_a", [True, False], ids=["one-A-per-layer", "A-per-module"])
def test_the_one_product_path_adds_what_the_per_part_deltas_add(tp1, tiny_llama_dir, shared_a) -> None:
    """``added_to`` (the hooks' path: one ``addmm`` with the parts' B laid out as the linear's output, where one A
    feeds every part) equals ``out + delta(x)`` (per part, then assembled) on every adapted linear: the grouped
    q/k/v rows, the [gate; up] concatenation, a single part; with an A per module it is the per-part path."""
    chunks = lora_model(tiny_llama_dir, lora.LoraSettings(rank=4, alpha=16, targets=ALL, shared_a=shared_a))
    g = torch.Generator().manual_seed(0)
    checked = set()
    for _, adapter in lora.adapters(chunks):
        with torch.no_grad():
            for b in adapter.lora_B.values():
                b.copy_(torch.randn(b.shape, generator=g))
            a = next(iter(adapter.lora_A.values()))
            x = torch.randn(5, 2, a.shape[1], generator=g)
            out = torch.randn(5, 2, sum(adapter.out_sizes.values()), generator=g)
            assert (adapter.added_to(out, x) - (out + adapter.delta(x))).abs().max() <= 1e-5
        checked.add(adapter.layout)
    assert checked == {"qkv", "concat", "single"}
