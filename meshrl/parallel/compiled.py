"""What ``actor.use_torch_compile`` / ``ref.use_torch_compile`` compile in built megatron-core chunks, and how.

megatron-core 0.16.1 without Transformer Engine or apex has no fused kernel for the elementwise regions of its
local layer spec: ``apply_rope_fusion`` and ``persist_layer_norm`` need TE/apex, and its ``jit_fuser`` functions
(``megatron.core.fusions``: SwiGLU and its hand-written backward, bias-GeLU, bias-dropout-add) are decorated with
``torch.compile`` once, at import. So :func:`compile_elementwise` compiles, with ``torch.compile(dynamic=True)``
(inductor: C++ on CPU, Triton on GPU; one graph for every sequence length), per model:

- **norms**: every ``torch.nn.RMSNorm`` of the chunks (input / pre-MLP / q-k / final norms, and
  ``layers.RMSNorm``'s zero-centred form), ``y = x / sqrt(mean(x^2) + eps) * w``, as its own compiled module;
- **SwiGLU**: the model's config turns on ``bias_activation_fusion`` for gated-SiLU MLPs, so megatron's MLP runs
  ``fused_bias_swiglu.SwiGLUFunction``: ``silu(y1) * y2`` forward, and its closed-form backward
  ``g * sigmoid(y1) * (1 + y1 (1 - sigmoid(y1))) * y2`` and ``g * silu(y1)``, which keeps only ``y`` for backward
  (autograd's keeps ``silu(y1)`` too). The two functions are re-compiled with ``dynamic=True`` from their
  undecorated code: megatron's import-time decoration is a no-op under ``TORCHDYNAMO_DISABLE=1``;
- **rotary**: ``_apply_rotary_pos_emb_bshd`` (``t cos + rotate_half(t) sin`` and the cos / sin of the angles),
  which both megatron's padded and packed (THD) paths end in, for this model's attention only (its config is
  marked; the reference's or critic's model in the same process keeps eager rotary unless compiled itself).

Attention (torch SDPA), the matrix products and the tensor-parallel collectives stay eager. Every compiled region
computes the same formulas as eager, in another order of fp32 roundings (``tests/parallel/test_compiled.py``
bounds log-probs, entropy and gradients against eager).

``TORCHDYNAMO_DISABLE=1`` makes every ``torch.compile`` a no-op from the moment a function is wrapped (torch reads it
in ``torch._dynamo.optimize``); :func:`compile_elementwise` then compiles nothing and raises
:class:`CompileDisabled`. The run plan (``meshrl.config.run_plan.torch_compile_roles``) sees the variable first: it
compiles no model then and says so in a start-up warning.
"""

from __future__ import annotations

import contextvars
import functools
import os

import torch

COMPILED_ROPE = "meshrl_compiled_rope"  # set on a model's TransformerConfig: its attention's rotary is compiled

# True while a marked attention applies its rotary embedding (megatron's rope helpers take no module).
_ROPE_COMPILED = contextvars.ContextVar("meshrl_rope_compiled", default=False)


class CompileDisabled(RuntimeError):
    """``torch.compile`` is switched off in this process (``TORCHDYNAMO_DISABLE=1``)."""


def compile_disabled() -> bool:
    """Whether ``torch.compile`` would return its function unchanged (``torch._dynamo.eval_frame.optimize``)."""
    return os.environ.get("TORCHDYNAMO_DISABLE", "") == "1"


def _compile(fn):
    return torch.compile(fn, dynamic=True)


def _undecorated(fn):
    """The function megatron's ``jit_fuser`` wrapped (itself when the wrapping was a no-op)."""
    return getattr(fn, "_torchdynamo_orig_callable", None) or getattr(fn, "__wrapped__", None) or fn


@functools.cache
def _install_rope_dispatch() -> None:
    """Route megatron's rotary helper through the compiled one for marked configs (once per process)."""
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.transformer import attention

    eager_bshd = rope_utils._apply_rotary_pos_emb_bshd
    compiled_bshd = _compile(eager_bshd)
    eager_apply = attention.apply_rotary_pos_emb

    def bshd(*args, **kwargs):
        return (compiled_bshd if _ROPE_COMPILED.get() else eager_bshd)(*args, **kwargs)

    def apply_rotary_pos_emb(t, freqs, config, *args, **kwargs):
        if not getattr(config, COMPILED_ROPE, False):
            return eager_apply(t, freqs, config, *args, **kwargs)
        token = _ROPE_COMPILED.set(True)
        try:
            return eager_apply(t, freqs, config, *args, **kwargs)
        finally:
            _ROPE_COMPILED.reset(token)

    rope_utils._apply_rotary_pos_emb_bshd = bshd
    attention.apply_rotary_pos_emb = apply_rotary_pos_emb


@functools.cache
def _install_compiled_swiglu() -> None:
    """megatron's SwiGLU forward and backward, compiled with dynamic shapes (once per process). Only models whose
    config has ``bias_activation_fusion`` reach them: the compiled ones."""
    from megatron.core.fusions import fused_bias_swiglu

    for name in ("swiglu", "swiglu_back", "bias_swiglu", "bias_swiglu_back"):
        setattr(fused_bias_swiglu, name, _compile(_undecorated(getattr(fused_bias_swiglu, name))))


def _plain_swiglu(config) -> bool:
    """Whether ``config``'s MLP is the SwiGLU that ``SwiGLUFunction`` computes: gated SiLU with no clamp or offset
    (GeGLU families keep their eager activation)."""
    import torch.nn.functional as F

    return (config.gated_linear_unit and config.activation_func is F.silu
            and config.activation_func_clamp_value is None and not config.glu_linear_offset)


def compile_elementwise(chunks: list[torch.nn.Module]) -> dict[str, int]:
    """Compile the norms, SwiGLU and rotary of ``chunks`` (one model's, built by ``model_builder``) in place.

    Returns how many modules of each kind now run compiled code (``norms``, ``swiglu_mlps``,
    ``rope_attentions``). Raises :class:`CompileDisabled` under ``TORCHDYNAMO_DISABLE=1`` and ``ValueError`` for a
    model built with Transformer Engine layers (fused kernels already); nothing is changed then.
    """
    from megatron.core.transformer.attention import Attention
    from megatron.core.transformer.mlp import MLP

    from meshrl.parallel.model_builder import unwrap

    models = [unwrap(chunk) for chunk in chunks]
    if any(getattr(model, "meshrl_uses_te", False) for model in models):
        raise ValueError("the model runs Transformer Engine layers, whose norm, activation and rotary are fused "
                         "kernels already: set use_torch_compile=False")
    if compile_disabled():
        raise CompileDisabled("TORCHDYNAMO_DISABLE=1 switches torch.compile off in this process")
    counts = {"norms": 0, "swiglu_mlps": 0, "rope_attentions": 0}
    for model in models:
        config = model.config
        if _plain_swiglu(config):
            _install_compiled_swiglu()
            config.bias_activation_fusion = True  # read by the MLP at every forward
        _install_rope_dispatch()
        setattr(config, COMPILED_ROPE, True)
        for module in model.modules():
            if isinstance(module, torch.nn.RMSNorm):
                module.compile(dynamic=True)
                counts["norms"] += 1
            elif isinstance(module, MLP) and module.config.bias_activation_fusion:
                counts["swiglu_mlps"] += 1
            elif isinstance(module, Attention) and getattr(module.config, COMPILED_ROPE, False):
                counts["rope_attentions"] += 1
    return counts

