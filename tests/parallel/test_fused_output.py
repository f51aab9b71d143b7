"""The fused output layer (``meshrl.parallel.fused_output``) against the unfused path, in process at TP1.

Reference: the output layer's logits through ``forward.vocab_parallel_log_probs`` / ``vocab_parallel_entropy``
(what every pass runs without ``model.use_fused_kernels``). fp32: log-probs, entropy, loss and the fused
function's gradients within 1e-6 (relative to the tensor's scale when that exceeds 1). A model's parameter
gradients within 1e-5 of their scale: BLAS picks its kernel by the number of rows, so a chunk's
``[rows, V] x [V, H]`` product rounds its 49k-term sums otherwise than the whole micro-batch's, and the
decoder's backward carries that rounding (measured: 2.1e-6 at a gradient scale of 0.57, chunks of 4 to 16).
TP2 and PP2 run in ``test_fused_output_multiproc.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from meshrl.models.tiny import TinySpec, tiny_model_dir
from meshrl.parallel import state
from meshrl.parallel.forward import OutputRequest, vocab_parallel_entropy, vocab_parallel_log_probs
from meshrl.parallel.fused_output import fused_log_probs_entropy

TOLERANCE = 1e-6


GRAD_TOLERANCE = 1e-5


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Within fp32 rounding: |a - b| <= 1e-6 x max(1, max |b|) (the chunks sum a weight's gradient over the
    tokens in another order than one product does)."""
    return float((a - b).abs().max()) <= TOLERANCE * max(1.0, float(b.abs().max()))


def close_grads(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """Every parameter's gradient within ``GRAD_TOLERANCE`` of its scale (the module docstring)."""
    return set(a) == set(b) and all(float((a[n] - b[n]).abs().max()) <= GRAD_TOLERANCE * float(b[n].abs().max())
                                    for n in b)


@pytest.fixture(scope="module")
def tp1():
    state.initialize(state.ParallelConfig())
    yield
    state.destroy()


def _unfused(hidden, weight, target, temperature, softcap):
    logits = hidden @ weight.t()
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    logits = logits.float() / temperature
    return vocab_parallel_log_probs(logits.clone(), target), vocab_parallel_entropy(logits)


@pytest.mark.parametrize("temperature,softcap,chunk", [(1.0, None, 7), (0.6, None, 64), (1.3, 2.0, 5)])
def test_log_probs_entropy_and_gradients_match_the_unfused_path(tp1, temperature, softcap, chunk) -> None:
    g = torch.Generator().manual_seed(0)
    tokens, hidden_size, vocab = 23, 16, 97  # 23 tokens: the last chunk is a partial one
    hidden = torch.randn(tokens, hidden_size, generator=g)
    weight = torch.randn(vocab, hidden_size, generator=g) * 0.5
    target = torch.randint(0, vocab, (tokens,), generator=g)
    g_lp, g_h = torch.randn(tokens, generator=g), torch.randn(tokens, generator=g)
    results = []
    for fused in (False, True):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        if fused:
            lp, ent = fused_log_probs_entropy(h, w, target, temperature=temperature, softcap=softcap,
                                              chunk_size=chunk, entropy=True)
        else:
            lp, ent = _unfused(h, w, target, temperature, softcap)
        ((lp * g_lp).sum() + (ent * g_h).sum()).backward()
        results.append((lp.detach(), ent.detach(), h.grad, w.grad))
    for name, a, b in zip(("log_probs", "entropy", "grad hidden", "grad weight"), *results):
        assert close(a, b), name
        assert float(b.abs().max()) > 1e-2, f"{name} is all but zero: the comparison would prove nothing"


def test_one_output_alone_and_its_gradient(tp1) -> None:
    """Only entropy (no targets), or only log-probs: the other comes back None, the gradient is the one
    output's."""
    g = torch.Generator().manual_seed(1)
    hidden, weight = torch.randn(9, 8, generator=g), torch.randn(31, 8, generator=g)
    target = torch.randint(0, 31, (9,), generator=g)
    for wants_log_probs in (True, False):
        h = hidden.clone().requires_grad_()
        lp, ent = fused_log_probs_entropy(h, weight, target if wants_log_probs else None, temperature=1.0,
                                          softcap=None, chunk_size=4, entropy=not wants_log_probs)
        assert (lp is None) != (ent is None)
        (lp if wants_log_probs else ent).sum().backward()
        r = hidden.clone().requires_grad_()
        ref_lp, ref_ent = _unfused(r, weight, target, 1.0, None)
        (ref_lp if wants_log_probs else ref_ent).sum().backward()
        assert close(h.grad, r.grad)


def test_a_chunk_size_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="fused_chunk_size must be >= 1"):
        OutputRequest(fused_chunk_size=0)


@pytest.mark.parametrize("tied", [True, False])
def test_a_model_pass_matches_the_unfused_pass(tp1, tied: bool) -> None:
    """A tiny Llama through megatron's schedule (rows and packed, all tokens and selected ones, at T=0.7):
    outputs, loss and every parameter's gradient (the tied embedding's or the output layer's among them)."""
    from transformers import AutoConfig

    from meshrl.parallel import hf_conversion, model_builder, schedule

    path = Path(tiny_model_dir(TinySpec(tie_word_embeddings=tied)))
    chunks = model_builder.build_model(AutoConfig.from_pretrained(path))
    hf_conversion.load_hf_weights(chunks, path)
    g = torch.Generator().manual_seed(2)
    mask = torch.ones(3, 12, dtype=torch.long)
    mask[0, :3] = 0
    mask[2, 9:] = 0
    batch = {"input_ids": torch.randint(0, 1000, (3, 12), generator=g), "attention_mask": mask,
             "adv": torch.randn(3, 12, generator=g), "loss_mask": mask * (torch.arange(12) >= 5)}

    def loss_fn(outputs, mb):
        m = mb["loss_mask"]
        return ((outputs["log_probs"] * mb["adv"] + 0.1 * outputs["entropy"]) * m).sum() / m.sum(), {}

    for remove_padding in (False, True):
        for selected in (False, True):
            mbs = [{**batch, "output_mask": batch["loss_mask"]} if selected else batch]
            runs = []
            for chunk_size in (None, 4):
                request = OutputRequest(entropy=True, temperature=0.7, remove_padding=remove_padding,
                                        fused_chunk_size=chunk_size)
                out = schedule.forward_only(chunks, mbs, request)[0]
                for model in chunks:
                    model.zero_grad_buffer()
                loss = schedule.forward_backward(chunks, mbs, loss_fn, request).loss
                grads = {n: p.main_grad.clone() for n, p in chunks[0].named_parameters()}
                runs.append((out, loss, grads))
            (out_a, loss_a, grads_a), (out_b, loss_b, grads_b) = runs
            where = f"remove_padding={remove_padding} selected={selected}"
            for key in ("log_probs", "entropy"):
                assert close(out_b[key], out_a[key]), f"{key} {where}"
            assert abs(loss_a - loss_b) <= TOLERANCE, where
            assert close_grads(grads_b, grads_a), where
            head = "embedding.word_embeddings.weight" if tied else "output_layer.weight"
            assert float(grads_b[f"module.{head}"].abs().max()) > 1e-3, "the output weight got no gradient"


def test_the_run_plan_takes_the_chunk_from_verls_key_and_refuses_an_empty_chunk() -> None:
    from meshrl.config import ConfigError, load_config
    from meshrl.config.validate import validate_config

    assert validate_config(load_config([], recipe="cpu_tiny_grpo")).fused_chunk_size == 512
    plan = validate_config(load_config(["actor_rollout_ref.model.fused_kernel_options.chunk_size=64"],
                                       recipe="cpu_tiny_grpo"))
    assert plan.fused_chunk_size == 64
    off = load_config(["actor_rollout_ref.model.use_fused_kernels=False"], recipe="cpu_tiny_grpo")
    assert validate_config(off).fused_chunk_size is None
    with pytest.raises(ConfigError, match="fused_kernel_options.chunk_size: must be >= 1 token"):
        validate_config(load_config(["actor_rollout_ref.model.fused_kernel_options.chunk_size=0"],
                                    recipe="cpu_tiny_grpo"))
