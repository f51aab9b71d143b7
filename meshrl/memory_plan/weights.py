"""Parameter counts: one rank's model shard, the experts, the matmul parameters, the LoRA adapters (counted from the
family's tensor table, the one conversion uses)."""

from __future__ import annotations

from math import prod
from pathlib import Path

from meshrl.memory_plan.units import PlanError
from meshrl.models.families import layer_pieces
from meshrl.models.known import KNOWN_MODELS, known_config


def load_hf_config(path: str):
    """The Hugging Face config of ``path``: a local folder, a meshrl model name, or a ``KNOWN_MODELS`` id."""
    from transformers import AutoConfig

    folder = Path(path).expanduser()
    if (folder / "config.json").is_file():
        return AutoConfig.from_pretrained(folder)
    if path.startswith(("embedded:", "tiny:", "tiny-rm:")):
        from meshrl.models.resolve import resolve_model_path

        return AutoConfig.from_pretrained(resolve_model_path(path))
    if path in KNOWN_MODELS:
        return known_config(path)
    raise PlanError(f"model '{path}' is not a local Hugging Face folder (no config.json) and not a known config; "
                    f"known: {', '.join(KNOWN_MODELS)}. Pass the model's folder.")


def layer_parameters(spec, tp: int = 1, ep: int = 1, etp: int | None = None, layer: int | None = None) -> int:
    """Parameters of transformer layer ``layer`` (None: the last, an MoE layer in an MoE model whose first
    ``dense_layers`` are dense) on one rank: the family's tensors of a decoder layer
    (``meshrl.models.families.layer_pieces``, the table conversion uses; buffers such as DeepSeek-V3's expert bias
    are no parameters), replicated ones (norms, an MoE router) whole, TP-split ones divided; an MoE layer's routed
    experts are split over the expert-parallel ranks (``num_experts / ep`` each) and each expert over the expert-TP
    ranks (``etp``, megatron's default: TP)."""
    etp = tp if etp is None else etp
    local_experts = spec.num_experts // ep if spec.moe else 0
    count = 0
    for p in layer_pieces(spec, spec.num_layers - 1 if layer is None else layer):
        if p.buffer:
            continue
        if p.expert is None:
            count += prod(p.shape) // (1 if p.tp_dim is None else tp)
        elif p.expert < local_experts:
            count += prod(p.shape) // (1 if p.tp_dim is None else etp)
    return count


def expert_parameters(spec) -> int:
    """Parameters of one routed expert of one layer (0 for a dense model)."""
    return sum(prod(p.shape) for p in layer_pieces(spec, spec.num_layers - 1) if p.expert == 0)


def active_layer_parameters(spec, layer: int | None = None) -> int:
    """Parameters of layer ``layer`` (None: the last) that one token runs through: all but the
    ``num_experts - moe_topk`` routed experts it is not sent to (the whole layer when dense)."""
    layer = spec.num_layers - 1 if layer is None else layer
    idle = spec.num_experts - spec.moe_topk if spec.moe_layer(layer) else 0
    return layer_parameters(spec, layer=layer) - idle * expert_parameters(spec)


def active_parameters(spec) -> int:
    """Parameters one token uses, as MoE models publish them ("A2.7B"): every layer's ``active_layer_parameters``,
    the embedding and the output layer (once when tied)."""
    return stage_parameters(spec) - sum(layer_parameters(spec, layer=i) - active_layer_parameters(spec, i)
                                        for i in range(spec.num_layers))


def stage_parameters(spec, *, tp: int = 1, pp: int = 1, stage: int = 0, critic: bool = False, ep: int = 1,
                     etp: int | None = None) -> int:
    """Parameters one rank of pipeline stage ``stage`` holds, as megatron's ``GPTModel`` allocates them.

    First stage: the vocab-parallel embedding. Last stage: the final norm and the output layer — a
    separate copy of the embedding when untied, or when tied with PP > 1 (megatron keeps a synced
    copy there); a critic's scalar value head instead. ``stage_parameters(spec)`` is the model's total.
    MoE layers: ``layer_parameters`` at expert-parallel size ``ep`` and expert TP ``etp``.
    """
    if not 0 <= stage < pp:
        raise ValueError(f"stage {stage} outside 0..{pp - 1}")
    embedding = spec.vocab_size // tp * spec.hidden_size
    per_stage = spec.num_layers // pp
    count = sum(layer_parameters(spec, tp, ep, etp, i) for i in range(stage * per_stage, (stage + 1) * per_stage))
    if stage == 0:
        count += embedding
    if stage == pp - 1:
        count += spec.hidden_size
        if critic:
            count += spec.hidden_size + 1
        elif not spec.tie_word_embeddings or pp > 1:
            count += embedding
    return count


def matmul_parameters(spec, critic: bool = False) -> int:
    """N of the 2·N / 6·N FLOP rules: every layer plus the output projection (not the embedding lookup); an MoE
    layer counts the experts a token runs (``active_layer_parameters``)."""
    head = spec.hidden_size + 1 if critic else spec.vocab_size * spec.hidden_size
    return sum(active_layer_parameters(spec, i) for i in range(spec.num_layers)) + head


# LoRA (``RunPlan.lora``): the (input, output) sizes of each adapted HF linear, and the ones megatron splits on their
# input over TP (row-parallel: A split, B replicated); the others split their output (A replicated, B split).
def _linear_sizes(spec) -> dict[str, tuple[int, int]]:
    h, f, d = spec.hidden_size, spec.ffn_hidden_size, spec.head_dim
    q, kv = spec.num_attention_heads * d, spec.num_kv_heads * d
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h), "gate_proj": (h, f),
            "up_proj": (h, f), "down_proj": (f, h)}


ROW_PARALLEL = ("o_proj", "down_proj")


def lora_parameters(spec, lora, tp: int = 1, pp: int = 1) -> int:
    """Adapter parameters of one rank's layers (a stage's ``num_layers / PP``): ``r·(in + out)`` per adapted linear,
    the TP-split side divided by TP; with ``lora.shared_a`` one A per fused megatron layer (q/k/v, gate/up)."""
    from meshrl.config.lora_keys import FUSED

    sizes, r = _linear_sizes(spec), lora.rank
    per_layer = 0
    for name in lora.targets:
        fan_in, fan_out = sizes[name]
        row = name in ROW_PARALLEL
        per_layer += r * (fan_in // (tp if row else 1) + fan_out // (1 if row else tp))
    if lora.shared_a:  # the A's of a fused layer's adapted parts are one
        for parts in FUSED.values():
            shared = [name for name in parts if name in lora.targets]
            per_layer -= r * sum(sizes[name][0] for name in shared[1:])
    return per_layer * (spec.num_layers // pp)
