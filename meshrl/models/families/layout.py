"""The HF <-> megatron tensor mapping of a ``ModelSpec``: one table (``hf_layout``) of pieces, built from the spec's
features, that ``meshrl.parallel`` splits over TP / PP / EP; and the fused HF tensors that concatenate pieces."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from meshrl.models.families.spec import EXPERT_NAMES, HF_FUSIONS, POST_NORM_NAMES, SHARED_EXPERT_NAMES, ModelSpec


@dataclass(frozen=True)
class Fusion:
    """One HF tensor (``name``) that is the concatenation of the ``hf_layout`` pieces ``parts`` along dim 0."""

    name: str
    parts: tuple[str, ...]


def hf_fusions(spec: "ModelSpec") -> list[Fusion]:
    """The fused HF tensors of every layer (``ModelSpec.hf_fused``), in layer order."""
    layers = f"{spec.lm_prefix}layers"
    return [Fusion(f"{layers}.{i}.{fused}", tuple(f"{layers}.{i}.{part}" for part in parts))
            for i in range(spec.num_layers) for kind in spec.hf_fused for fused, parts in (HF_FUSIONS[kind],)]


@dataclass(frozen=True)
class Piece:
    """One HF tensor and its place in megatron.

    ``stage``: "embed" (first stage), "layer" (``layer`` index), "head" (last stage).
    ``mcore``: parameter name inside the owning chunk, local-spec naming, ``{j}`` = local layer index.
    ``tp_dim``: HF dimension TP splits (None: replicated). ``part``: which slice of a fused parameter
    ("q", "k", "v", "gate", "up") or None. ``shape``: full HF shape. ``fields``: the config fields
    that determine the shape, for error messages. ``expert``: the routed expert it belongs to (MoE); its
    ``mcore`` name holds ``{k}``, the expert's index among its expert-parallel rank's local experts.
    ``buffer``: a megatron buffer, not a parameter (the router's fp32 expert bias): no gradient, held in fp32.
    """

    hf_name: str
    stage: str
    layer: int | None
    mcore: str
    tp_dim: int | None
    part: str | None
    shape: tuple[int, ...]
    fields: str
    expert: int | None = None
    buffer: bool = False


def layer_pieces(spec: ModelSpec, i: int) -> list[Piece]:
    """HF tensors of decoder layer ``i`` for the spec's features (Llama's layer, plus QKV bias, q/k norms)."""
    h, d, f = spec.hidden_size, spec.head_dim, spec.ffn_hidden_size
    nq, nkv = spec.num_attention_heads, spec.num_kv_heads
    p, layer = f"{spec.lm_prefix}layers.{i}.", "decoder.layers.{j}."
    attn, qkv = layer + "self_attention.", layer + "self_attention.linear_qkv."
    q_rows, kv_rows = "num_attention_heads*head_dim", "num_key_value_heads*head_dim"

    def piece(hf: str, mcore: str, tp_dim: int | None, part: str | None, shape: tuple[int, ...], fields: str):
        return Piece(p + hf, "layer", i, mcore, tp_dim, part, shape, fields)

    pieces = [piece("input_layernorm.weight", layer + "input_layernorm.weight", None, None, (h,), "hidden_size")]
    if spec.mla:
        pieces += _mla_pieces(spec, piece, attn)
    else:
        pieces += [
            piece("self_attn.q_proj.weight", qkv + "weight", 0, "q", (nq * d, h), f"{q_rows}, hidden_size"),
            piece("self_attn.k_proj.weight", qkv + "weight", 0, "k", (nkv * d, h), f"{kv_rows}, hidden_size"),
            piece("self_attn.v_proj.weight", qkv + "weight", 0, "v", (nkv * d, h), f"{kv_rows}, hidden_size"),
        ]
    if spec.qkv_bias:
        pieces += [piece("self_attn.q_proj.bias", qkv + "bias", 0, "q", (nq * d,), q_rows),
                   piece("self_attn.k_proj.bias", qkv + "bias", 0, "k", (nkv * d,), kv_rows),
                   piece("self_attn.v_proj.bias", qkv + "bias", 0, "v", (nkv * d,), kv_rows)]
    if spec.qk_norm:  # one head_dim-sized gamma shared by every head: replicated over TP
        pieces += [piece("self_attn.q_norm.weight", attn + "q_layernorm.weight", None, None, (d,), "head_dim"),
                   piece("self_attn.k_norm.weight", attn + "k_layernorm.weight", None, None, (d,), "head_dim")]
    fc1, fc2, ffn = layer + "mlp.linear_fc1.weight", layer + "mlp.linear_fc2.weight", "intermediate_size, hidden_size"
    if not spec.mla:
        pieces.append(piece("self_attn.o_proj.weight", attn + "linear_proj.weight", 1, None, (h, nq * d),
                            f"hidden_size, {q_rows}"))
    attn_out_norm, mlp_in_norm, mlp_out_norm = POST_NORM_NAMES[spec.post_norm_names]
    if spec.post_norms:
        # Gemma2/3's post_attention_layernorm (GLM-4's post_self_attn_layernorm) normalises the attention output
        # (meshrl.parallel.layers' norm after linear_proj); the MLP's input norm is pre_feedforward_layernorm
        # (GLM-4's post_attention_layernorm).
        pieces += [piece(f"{attn_out_norm}.weight", attn + "linear_proj.post_norm.weight", None, None, (h,),
                         "hidden_size"),
                   piece(f"{mlp_in_norm}.weight", layer + "pre_mlp_layernorm.weight", None, None, (h,), "hidden_size")]
    else:
        pieces.append(piece("post_attention_layernorm.weight", layer + "pre_mlp_layernorm.weight", None, None, (h,),
                            "hidden_size"))
    if spec.moe_layer(i):
        pieces += _moe_pieces(spec, piece, layer + "mlp.")
    else:
        pieces += [
            piece("mlp.gate_proj.weight", fc1, 0, "gate", (f, h), ffn),
            piece("mlp.up_proj.weight", fc1, 0, "up", (f, h), ffn),
            piece("mlp.down_proj.weight", fc2, 1, None, (h, f), "hidden_size, intermediate_size"),
        ]
    if spec.post_norms:
        pieces.append(piece(f"{mlp_out_norm}.weight", layer + "mlp.linear_fc2.post_norm.weight", None, None, (h,),
                            "hidden_size"))
    return pieces


def _mla_pieces(spec: ModelSpec, piece: Callable[..., Piece], attn: str) -> list[Piece]:
    """Multi-latent attention's HF tensors on megatron's local-spec ``MLASelfAttention``. Every projection is a
    column-parallel linear split on its rows over TP (the down projections too: megatron gathers their outputs),
    ``linear_proj`` on its columns; the latent norms are replicated. The rows of ``kv_a_proj_with_mqa`` are
    ``[latent (kv_lora_rank); rope key (qk_rope_head_dim)]`` and those of ``q_proj`` / ``q_b_proj`` /
    ``kv_b_proj`` per head ``[nope; rope]`` / ``[k_nope; v]``, megatron's order too."""
    h, nq, lora, rope = spec.hidden_size, spec.num_attention_heads, spec.kv_lora_rank, spec.qk_rope_head_dim
    q_head, v_head = spec.qk_nope_head_dim + rope, spec.v_head_dim
    qk = "num_attention_heads*(qk_nope_head_dim+qk_rope_head_dim)"
    if spec.q_lora_rank is None:
        pieces = [piece("self_attn.q_proj.weight", attn + "linear_q_proj.weight", 0, None, (nq * q_head, h),
                        f"{qk}, hidden_size")]
    else:
        ql = spec.q_lora_rank
        pieces = [piece("self_attn.q_a_proj.weight", attn + "linear_q_down_proj.weight", 0, None, (ql, h),
                        "q_lora_rank, hidden_size"),
                  piece("self_attn.q_a_layernorm.weight", attn + "q_layernorm.weight", None, None, (ql,),
                        "q_lora_rank"),
                  piece("self_attn.q_b_proj.weight", attn + "linear_q_up_proj.weight", 0, None, (nq * q_head, ql),
                        f"{qk}, q_lora_rank")]
    return pieces + [
        piece("self_attn.kv_a_proj_with_mqa.weight", attn + "linear_kv_down_proj.weight", 0, None, (lora + rope, h),
              "kv_lora_rank+qk_rope_head_dim, hidden_size"),
        piece("self_attn.kv_a_layernorm.weight", attn + "kv_layernorm.weight", None, None, (lora,), "kv_lora_rank"),
        piece("self_attn.kv_b_proj.weight", attn + "linear_kv_up_proj.weight", 0, None,
              (nq * (spec.qk_nope_head_dim + v_head), lora), "num_attention_heads*(qk_nope_head_dim+v_head_dim), "
              "kv_lora_rank"),
        piece("self_attn.o_proj.weight", attn + "linear_proj.weight", 1, None, (h, nq * v_head),
              "hidden_size, num_attention_heads*v_head_dim"),
    ]


def _moe_pieces(spec: ModelSpec, piece: Callable[..., Piece], mlp: str) -> list[Piece]:
    """An MoE layer's HF tensors: the router, each expert's SwiGLU (split over expert-tensor-parallel ranks like a
    dense MLP over TP; megatron's ``SequentialMLP`` holds the local ones), the shared expert and its gate."""
    h, f, n = spec.hidden_size, spec.moe_ffn_hidden_size, spec.num_experts
    block, gate, up, down = EXPERT_NAMES[spec.expert_names]
    width = "intermediate_size" if spec.expert_names == "mixtral" else "moe_intermediate_size"  # the HF field
    ffn, local = f"{width}, hidden_size", mlp + "experts.local_experts.{k}."
    pieces = [piece(f"{block}.gate.weight", mlp + "router.weight", None, None, (n, h), "num_experts, hidden_size")]
    if spec.moe_expert_bias:
        pieces.append(replace(piece(f"{block}.gate.e_score_correction_bias", mlp + "router.expert_bias", None, None,
                                    (n,), "num_experts"), buffer=True))
    for e in range(n):
        expert = f"{block}.experts.{e}."
        pieces += [replace(piece(expert + f"{gate}.weight", local + "linear_fc1.weight", 0, "gate", (f, h), ffn),
                           expert=e),
                   replace(piece(expert + f"{up}.weight", local + "linear_fc1.weight", 0, "up", (f, h), ffn), expert=e),
                   replace(piece(expert + f"{down}.weight", local + "linear_fc2.weight", 1, None, (h, f),
                                 f"hidden_size, {width}"), expert=e)]
    if spec.shared_expert_ffn_hidden_size:
        fs, shared, hf = (spec.shared_expert_ffn_hidden_size, mlp + "shared_experts.",
                          SHARED_EXPERT_NAMES[spec.expert_names])
        width = ("n_shared_experts*moe_intermediate_size" if spec.expert_names == "deepseek"
                 else "shared_expert_intermediate_size")
        pieces += [piece(f"{hf}.gate_proj.weight", shared + "linear_fc1.weight", 0, "gate", (fs, h),
                         f"{width}, hidden_size"),
                   piece(f"{hf}.up_proj.weight", shared + "linear_fc1.weight", 0, "up", (fs, h),
                         f"{width}, hidden_size"),
                   piece(f"{hf}.down_proj.weight", shared + "linear_fc2.weight", 1, None, (h, fs),
                         f"hidden_size, {width}")]
        if spec.shared_expert_gate:
            pieces.append(piece("mlp.shared_expert_gate.weight", shared + "gate_weight", None, None, (1, h),
                                "hidden_size"))
    return pieces


def checkpoint_shapes(spec: ModelSpec, critic: bool = False) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor as the family's HF checkpoints hold them: ``hf_layout``'s pieces, with the parts
    of a fused tensor (``hf_fusions``) replaced by it."""
    shapes = {piece.hf_name: piece.shape for piece in hf_layout(spec, critic)}
    for fusion in hf_fusions(spec):
        parts = [shapes.pop(part) for part in fusion.parts]
        shapes[fusion.name] = (sum(shape[0] for shape in parts), *parts[0][1:])
    return shapes


def hf_layout(spec: ModelSpec, critic: bool = False) -> list[Piece]:
    """Every HF tensor of the model (``*ForCausalLM``, or the critic's ``*ForTokenClassification``; a
    vision-language model's language model), in the order ``meshrl.parallel.hf_conversion.iter_hf_weights`` yields
    them; the language model's names under ``spec.lm_prefix``."""
    h, v = spec.hidden_size, spec.vocab_size
    pieces = [Piece(f"{spec.lm_prefix}embed_tokens.weight", "embed", None, "embedding.word_embeddings.weight", 0, None,
                    (v, h), "vocab_size, hidden_size")]
    for i in range(spec.num_layers):
        pieces += layer_pieces(spec, i)
    pieces.append(Piece(f"{spec.lm_prefix}norm.weight", "head", None, "decoder.final_layernorm.weight", None, None,
                        (h,), "hidden_size"))
    if critic:
        pieces += [Piece("score.weight", "head", None, "output_layer.weight", None, None, (1, h), "hidden_size"),
                   Piece("score.bias", "head", None, "output_layer.bias", None, None, (1,), "num_labels=1")]
    elif not spec.tie_word_embeddings:
        pieces.append(Piece("lm_head.weight", "head", None, "output_layer.weight", 0, None, (v, h),
                            "vocab_size, hidden_size"))
    return pieces
