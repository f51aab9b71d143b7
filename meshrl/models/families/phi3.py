"""Phi-3 (Phi-3-mini / medium, Phi-3.5-mini): Llama's structure with two fused HF tensors, ``qkv_proj`` ([q; k; v]
rows) and ``gate_up_proj`` ([gate; up] rows) — ``ModelSpec.hf_fused`` — and a ``sliding_window`` over every layer
(Phi-3-mini-4k: 2047 of 4096 positions), which meshrl's trainer applies as transformers does.

vLLM builds Phi-3 on its Llama model, which slides a window only on layers a config's ``layer_types`` marks, and
Phi-3's config has none: the engine attends to the whole sequence. The two agree while a sequence fits the window,
so a run whose prompt plus response can exceed it is refused with a vLLM rollout
(``meshrl.rollout.serving_limits.engine_window_problems``).
Rope scaling (``longrope``: the 128k variants) and partial rotary factors (Phi-4-mini) fall under the common
refusals; dropout must be 0 (meshrl trains without it).
"""

from meshrl.models.families import Family, Refusal


def phi3_fields(hf_config) -> dict:
    window = hf_config.sliding_window
    return dict(hf_fused=("qkv", "gate_up"), sliding_window=window,
                sliding_layers=tuple(range(hf_config.num_hidden_layers)) if window else ())


def _no_dropout(field: str) -> Refusal:
    return Refusal(field, lambda v, c: not v, "meshrl trains without dropout; set it to 0.0")


FAMILY = Family(
    model_type="phi3",
    hf_prefix="Phi3",
    refusals=(_no_dropout("resid_pdrop"), _no_dropout("embd_pdrop")),
    spec_fields=phi3_fields,
    engine_ignores_window=True,
    tiny_shape=dict(tie_word_embeddings=False, norm_scale=0.1),
    tiny_config=dict(sliding_window=None, resid_pdrop=0.0, embd_pdrop=0.0, pad_token_id=0),
)
