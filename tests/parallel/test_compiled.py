"""``actor.use_torch_compile``: the compiled norms, SwiGLU and rotary (``meshrl.parallel.compiled``) against eager.

The slow test runs a tiny Llama's passes through megatron's schedule (forward-only log-probs and entropy at T=0.7;
forward + backward: loss and every parameter's gradient), packed (THD) and in rows, eager and then compiled, in
process at TP1. Bounds: outputs 1e-6 relative to their scale (log-probs of ~10: measured 4.8e-6 absolute, 4.4e-7
relative), gradients 1e-6 absolute at a scale of ~0.47 (measured 3.6e-7): fp32 rounding of the same formulas in
another order. The fast tests check the run plan's decision and what happens with ``TORCHDYNAMO_DISABLE=1``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from fused_output_worker import MODELS, loss_fn, micro_batches

from meshrl.config import load_config
from meshrl.config.validate import validate_config
from meshrl.models.tiny import tiny_model_dir
from meshrl.parallel import compiled, hf_conversion, model_builder, schedule, state
from meshrl.parallel.forward import OutputRequest

OUTPUT_TOLERANCE = 1e-6  # relative to max(1, the outputs' scale)
GRAD_TOLERANCE = 1e-6


@pytest.fixture(scope="module")
def tp1():
    state.initialize(state.ParallelConfig())
    yield
    state.destroy()


def _model(name: str):
    from transformers import AutoConfig

    path = Path(tiny_model_dir(MODELS[name]))
    chunks = model_builder.build_model(AutoConfig.from_pretrained(path), dtype=torch.float32)  # a GPU's default: bf16
    hf_conversion.load_hf_weights(chunks, path)
    return chunks


def _passes(chunks) -> list[tuple[list[dict], float, dict[str, torch.Tensor]]]:
    runs = []
    for remove_padding in (True, False):
        request = OutputRequest(entropy=True, temperature=0.7, remove_padding=remove_padding)
        outputs = schedule.forward_only(chunks, micro_batches(), request)
        for chunk in chunks:
            chunk.zero_grad_buffer()
        loss = schedule.forward_backward(chunks, micro_batches(), loss_fn, request).loss
        runs.append((outputs, loss, {n: p.main_grad.clone() for n, p in chunks[0].named_parameters()}))
    return runs


# `make test-extended` (65 test-seconds: an inductor C++ build): `make test` runs eager (the Makefile's
# TORCHDYNAMO_DISABLE=1), and the compiled regions are the eager formulas (meshrl.parallel.compiled) checked here.
@pytest.mark.slow
@pytest.mark.extended
def test_compiled_layers_match_eager(tp1, monkeypatch) -> None:
    monkeypatch.delenv("TORCHDYNAMO_DISABLE", raising=False)
    chunks = _model("llama_untied")
    eager = _passes(chunks)
    regions = compiled.compile_elementwise(chunks)
    layers = model_builder.unwrap(chunks[0]).config.num_layers
    # two norms per layer and the final one; each layer's MLP and attention
    assert regions == {"norms": 2 * layers + 1, "swiglu_mlps": layers, "rope_attentions": layers}
    for (out_a, loss_a, grads_a), (out_b, loss_b, grads_b) in zip(eager, _passes(chunks)):
        for a, b in zip(out_a, out_b):
            for key in ("log_probs", "entropy"):
                scale = max(1.0, float(a[key].abs().max()))
                assert float((a[key] - b[key]).abs().max()) <= OUTPUT_TOLERANCE * scale, key
        assert abs(loss_a - loss_b) <= OUTPUT_TOLERANCE
        assert max(float((grads_a[n] - grads_b[n]).abs().max()) for n in grads_a) <= GRAD_TOLERANCE
        assert max(float(g.abs().max()) for g in grads_a.values()) > 0.1  # the gradients are not all but zero


def test_nothing_is_compiled_under_torchdynamo_disable(tp1, monkeypatch) -> None:
    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "1")
    chunks = _model("llama_untied")
    with pytest.raises(compiled.CompileDisabled, match="TORCHDYNAMO_DISABLE=1"):
        compiled.compile_elementwise(chunks)
    model = model_builder.unwrap(chunks[0])
    assert not model.config.bias_activation_fusion and not hasattr(model.config, compiled.COMPILED_ROPE)
    assert all(m._compiled_call_impl is None for m in model.modules())


def test_the_run_plan_compiles_the_roles_the_keys_name(monkeypatch) -> None:
    """The reference follows the actor unless set (verl's oc.select); TORCHDYNAMO_DISABLE=1 compiles none, saying
    so in a start-up warning; the keys are no longer named as FSDP-only."""
    def plan(*overrides: str):
        return validate_config(load_config(list(overrides), recipe="cpu_tiny_grpo"))

    actor, ref = "actor_rollout_ref.actor.use_torch_compile", "actor_rollout_ref.ref.use_torch_compile"
    monkeypatch.delenv("TORCHDYNAMO_DISABLE", raising=False)
    assert plan().torch_compile == ()
    on = plan(f"{actor}=True")
    assert on.torch_compile == ("policy", "reference") and not any("use_torch_compile" in w for w in on.warnings)
    assert plan(f"{actor}=True", f"{ref}=False").torch_compile == ("policy",)
    assert plan(f"{ref}=True").torch_compile == ("reference",)
    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "1")
    off = plan(f"{actor}=True")
    assert off.torch_compile == ()
    assert any(actor in w and "TORCHDYNAMO_DISABLE=1" in w for w in off.warnings), off.warnings


def test_a_transformer_engine_model_is_refused() -> None:
    model = torch.nn.Module()
    model.meshrl_uses_te = True
    with pytest.raises(ValueError, match="Transformer Engine .* set use_torch_compile=False"):
        compiled.compile_elementwise([model])
