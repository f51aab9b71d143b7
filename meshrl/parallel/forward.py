"""Per-token model outputs from vocab-parallel logits, and the forward step the pipeline schedules run.

Alignment convention (every output is ``[batch, seq]``, like the micro-batch's ``input_ids``):
``out[b, t]`` concerns token ``t`` and is computed from tokens ``< t`` of the same row:

- ``log_probs[b, t] = log pi_T(input_ids[b, t] | input_ids[b, <t])``
- ``entropy[b, t]``  = entropy of that next-token distribution
- ``sum_pi_squared[b, t]`` = sum_v pi_T(v | input_ids[b, <t])^2 of that distribution (forward only, no
  gradient: the optimal token baselines' path-variance proxy, verl's ``calculate_sum_pi_squared``)
- ``values[b, t]``   = critic value of the prefix before token ``t`` (the state that emits it)

where ``pi_T = softmax(logits / T)`` at the request's temperature ``T`` (:class:`OutputRequest`): RL
evaluates the policy on samples drawn at the rollout's temperature, so old, reference and updated
log-probs, KL and entropy all use that distribution (verl divides by ``rollout.temperature`` in the
same three places). Critic values do not depend on it.

Positions without a prediction (the first valid token of a row, padding) are 0.

Padding: a micro-batch carries ``input_ids`` and ``attention_mask`` (1 = token). The valid tokens of a
row form the sequence, in order, wherever the padding is (left, right, or between prompt and
response). The model sees them in one of two layouts (:func:`model_inputs`), both equal to HF with
``position_ids = cumsum(mask) - 1`` and padding masked out:

- rows (:func:`trim_rows`): each row's valid tokens moved to the front (positions 0..n-1), the batch
  trimmed to its longest row (rounded up to a multiple of TP under sequence parallelism), a plain causal
  mask (valid tokens never see padding, which sits after them). Computes ``rows x longest row`` positions.
- packed THD (:func:`pack_thd`, ``use_remove_padding``): every sequence laid end to end in one row
  (``meshrl.parallel.packing``: slots padded to a multiple of TP), run with megatron's
  ``PackedSeqParams(qkv_format="thd")``, so RoPE positions restart in every slot and attention stays
  inside it. Computes about the real token count.

Either way outputs are scattered back to the micro-batch's ``[batch, seq]`` positions (:func:`unpack`).

Under context parallelism (CP > 1) the micro-batch is packed whatever ``use_remove_padding`` says, and each CP rank
runs its 2 of the 2·CP chunks of every slot (:func:`split_over_context`, ``meshrl.parallel.context_parallel``); its
selected outputs are summed over the CP group, so every CP rank returns the whole ``[batch, seq]`` outputs.

Selected outputs: a micro-batch may carry ``output_mask`` (``[batch, seq]``, 1 = an output is wanted for
this token). The last stage then runs its output layer (the vocabulary projection, or the critic's
value head) on the hidden states that predict those tokens only (:func:`select_outputs`), and every
output is 0 at the other tokens. RL needs outputs for response tokens only; skipping the prompts'
``hidden x vocab`` projection and log-softmax saves about a fifth of a small model's FLOPs per prompt
token.

Full-vocabulary logits are never materialised on one rank: log-probs use megatron's
``vocab_parallel_cross_entropy`` and entropy uses ``vocab_parallel_entropy`` below, both reducing over
the TP group, both differentiable, both from the logits upcast to fp32 whatever the model's dtype and
divided by the temperature in place (no further copy of the ``[tokens, V/TP]`` logits).

With ``OutputRequest.fused_chunk_size`` the last stage does not build even this rank's ``[tokens, V/TP]``
logits: the model returns the hidden states (``fused_output.projection_skipped``) and
``fused_output.fused_log_probs_entropy`` projects, reduces and differentiates them a chunk of tokens at a
time, with the same operations (same numbers up to the rounding of the chunked products).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from meshrl.parallel import context_parallel
from meshrl.parallel.fused_output import OutputHead, fused_log_probs_entropy
from meshrl.parallel.packing import pad_multiple_for, pack_padded
from meshrl.parallel.shared_prefix import pack_shared_prefix

MicroBatch = dict[str, Any]
LossFn = Callable[[dict[str, torch.Tensor], MicroBatch], tuple[torch.Tensor, dict[str, Any]]]


class _VocabParallelEntropy(torch.autograd.Function):
    """H = logsumexp(x) - sum_i p_i x_i over a vocabulary split across the TP group.

    Backward: dH/dx_j = -p_j (log p_j + H), local to each shard (no communication). Only the local
    log-softmax shard is saved, never the logits, so callers may modify the logits in place afterwards
    (megatron's cross entropy does).
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, group) -> torch.Tensor:
        logits = logits.float()
        maximum = logits.max(dim=-1).values
        dist.all_reduce(maximum, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - maximum.unsqueeze(-1)
        sum_exp = shifted.exp().sum(dim=-1)
        dist.all_reduce(sum_exp, group=group)
        log_p = shifted - sum_exp.log().unsqueeze(-1)
        # -sum p log p, summed over shards
        entropy = -(log_p.exp() * log_p).sum(dim=-1)
        dist.all_reduce(entropy, group=group)
        ctx.save_for_backward(log_p, entropy)
        return entropy

    @staticmethod
    def backward(ctx, grad_entropy: torch.Tensor):
        log_p, entropy = ctx.saved_tensors
        grad = -log_p.exp() * (log_p + entropy.unsqueeze(-1)) * grad_entropy.unsqueeze(-1)
        return grad, None


def vocab_parallel_entropy(vocab_parallel_logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) per position; ``logits[..., V/TP]`` is this rank's vocabulary shard."""
    from megatron.core import parallel_state

    return _VocabParallelEntropy.apply(vocab_parallel_logits, parallel_state.get_tensor_model_parallel_group())


@torch.no_grad()
def vocab_parallel_sum_pi_squared(vocab_parallel_logits: torch.Tensor) -> torch.Tensor:
    """sum_v softmax(logits)_v^2 per position, without a gradient; ``logits[..., V/TP]`` is this rank's shard.

    With m the maximum over the whole vocabulary and e_v = exp(x_v - m): sum_v e_v^2 / (sum_v e_v)^2, both sums
    reduced over the TP group in one all-reduce. ``logits`` is read, not modified."""
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    logits = vocab_parallel_logits.float()
    maximum = logits.max(dim=-1).values
    dist.all_reduce(maximum, op=dist.ReduceOp.MAX, group=group)
    exp = (logits - maximum.unsqueeze(-1)).exp_()
    sums = torch.stack([exp.sum(dim=-1), exp.square_().sum(dim=-1)])
    dist.all_reduce(sums, group=group)
    return sums[1] / sums[0].square()


def vocab_parallel_log_probs(vocab_parallel_logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[target] via megatron's vocab-parallel cross entropy (modifies fp32 logits in place)."""
    from megatron.core import tensor_parallel

    return -tensor_parallel.vocab_parallel_cross_entropy(vocab_parallel_logits, target)


@dataclass
class ModelInputs:
    """A micro-batch in the layout the model runs on, and the map from its positions back to ``[B, S]``."""

    input_ids: torch.Tensor  # [r, n]
    position_ids: torch.Tensor  # [r, n]
    packed_seq_params: Any  # megatron's PackedSeqParams for the THD layout, else None
    packed_index: torch.Tensor  # (N,) flat position in [r, n] of each valid token
    source_index: torch.Tensor  # (N,) flat position in [B, S] of that token
    first: torch.Tensor  # (N,) bool: the first token of its sequence (nothing predicts it)
    shape: tuple[int, int]  # (B, S)
    # (K,) flat positions in [r, n] the output layer runs on (see select_outputs); None: all of them
    selected: torch.Tensor | None = None
    # (K,) the token each selected output predicts, and its flat position in [B, S]
    selected_tokens: torch.Tensor | None = None
    selected_source: torch.Tensor | None = None
    # (N,) flat position in [r, n] whose output predicts each valid token (-1: the first); None: the previous one,
    # packed_index - 1 (every layout but the shared-prompt one, where a response's first token is predicted by its
    # group's shared prompt)
    predictor: torch.Tensor | None = None
    # context parallelism (split_over_context): the CP group over which the selected outputs are summed; the index
    # fields above then hold this rank's positions only
    context_group: Any = None

    def predictors(self) -> torch.Tensor:
        return self.packed_index - 1 if self.predictor is None else self.predictor


def trim_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor, width_multiple: int = 1) -> ModelInputs:
    """Row layout: valid tokens moved to the front of each row (stable), trimmed to the longest row, whose
    length is rounded up to a multiple of ``width_multiple`` with padding after every row's tokens (sequence
    parallelism splits the sequence into that many equal shards)."""
    mask = attention_mask.bool()
    batch, seq_len = input_ids.shape
    order = torch.sort((~mask).to(torch.int8), dim=1, stable=True).indices
    counts = mask.sum(dim=1)
    longest = max(int(counts.max()), 1)
    width = -(-longest // width_multiple) * width_multiple
    if width > seq_len:  # room for the extra padding positions: they hold a padding token of the row
        order = torch.cat([order, order[:, -1:].expand(batch, width - seq_len)], dim=1)
    order = order[:, :width]
    positions = torch.arange(width, device=input_ids.device).expand(batch, width)
    packed_index = (positions < counts.unsqueeze(1)).flatten().nonzero().squeeze(1)
    rows = torch.arange(batch, device=input_ids.device).unsqueeze(1)
    return ModelInputs(input_ids=input_ids.gather(1, order), position_ids=positions.contiguous(),
                       packed_seq_params=None, packed_index=packed_index,
                       source_index=(rows * seq_len + order).flatten()[packed_index],
                       first=packed_index % width == 0, shape=(batch, seq_len))


def pack_thd(input_ids: torch.Tensor, attention_mask: torch.Tensor, pad_multiple: int) -> ModelInputs:
    """THD layout: the valid tokens of every row end to end in one ``[1, T]`` row (slots of a multiple of
    ``pad_multiple`` tokens) with the ``PackedSeqParams`` that keep RoPE and attention per slot."""
    from megatron.core.packed_seq_params import PackedSeqParams

    packed = pack_padded(input_ids, attention_mask, pad_multiple=pad_multiple)
    if packed.num_tokens == 0:
        raise ValueError("a micro-batch without any valid token cannot be packed (use_remove_padding)")
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=packed.cu_seqlens, cu_seqlens_kv=packed.cu_seqlens,
                             cu_seqlens_q_padded=packed.cu_seqlens_padded,
                             cu_seqlens_kv_padded=packed.cu_seqlens_padded,
                             max_seqlen_q=packed.max_seqlen, max_seqlen_kv=packed.max_seqlen)
    return ModelInputs(input_ids=packed.input_ids, position_ids=packed.position_ids, packed_seq_params=params,
                       packed_index=packed.packed_index, source_index=packed.source_index,
                       first=packed.position_ids[0, packed.packed_index] == 0, shape=packed.padded_shape)


def pack_shared(input_ids: torch.Tensor, attention_mask: torch.Tensor, prefix_columns: int,
                pad_multiple: int) -> ModelInputs:
    """The shared-prompt layout (``meshrl.parallel.shared_prefix``): rows with the same tokens before column
    ``prefix_columns`` run their prompt once; slots of a multiple of ``pad_multiple`` tokens."""
    layout = pack_shared_prefix(input_ids, attention_mask, prefix_columns, pad_multiple)
    if layout.input_ids.shape[1] == 0:
        raise ValueError("a micro-batch without any valid token cannot be packed")
    return ModelInputs(input_ids=layout.input_ids, position_ids=layout.position_ids, packed_seq_params=layout.params(),
                       packed_index=layout.packed_index, source_index=layout.source_index,
                       first=layout.predictor < 0, shape=tuple(input_ids.shape), predictor=layout.predictor)


def select_outputs(inputs: ModelInputs, output_mask: torch.Tensor) -> None:
    """Run the output layer for the valid tokens of ``output_mask`` (``[B, S]``) that are not the first of their
    sequence only: ``inputs.selected`` the flat ``[r, n]`` positions whose hidden states predict them (in the
    shared-prompt layout a prompt's last position once per response), ``selected_tokens`` those tokens and
    ``selected_source`` their ``[B, S]`` positions."""
    wanted = output_mask.reshape(-1)[inputs.source_index].bool() & ~inputs.first
    inputs.selected = inputs.predictors()[wanted]
    inputs.selected_tokens = inputs.input_ids.reshape(-1)[inputs.packed_index[wanted]]
    inputs.selected_source = inputs.source_index[wanted]


def split_over_context(inputs: ModelInputs, group) -> ModelInputs:
    """This CP rank's share of a packed micro-batch with selected outputs (``meshrl.parallel.context_parallel``): its
    chunks of every slot, the selected outputs whose predictor it holds, the global ``PackedSeqParams``."""
    part = context_parallel.shard(inputs.packed_seq_params.cu_seqlens_q_padded, group.rank(), group.size())
    selected = part.local[inputs.selected]
    mine = selected >= 0
    held = part.local[inputs.packed_index]
    kept = held >= 0
    return ModelInputs(input_ids=inputs.input_ids[:, part.positions],
                       position_ids=inputs.position_ids[:, part.positions],
                       packed_seq_params=inputs.packed_seq_params, packed_index=held[kept],
                       source_index=inputs.source_index[kept], first=inputs.first[kept], shape=inputs.shape,
                       selected=selected[mine], selected_tokens=inputs.selected_tokens[mine],
                       selected_source=inputs.selected_source[mine], context_group=group)


def model_inputs(input_ids: torch.Tensor, attention_mask: torch.Tensor, remove_padding: bool,
                 output_mask: torch.Tensor | None = None, sequence_parallel: bool = False,
                 shared_prefix_columns: int | None = None) -> ModelInputs:
    """:func:`pack_thd` (slots padded to a multiple of this rank's TP size, so the packed row always splits
    into TP equal sequence shards) or :func:`trim_rows` (its width a multiple of the TP size under
    ``sequence_parallel``), with the :func:`select_outputs` of ``output_mask`` when one is given. With
    ``shared_prefix_columns`` (the prompts' end), :func:`pack_shared` whatever ``remove_padding`` says (the shared
    layout is packed), its outputs selected (``output_mask``, else every token). Under context parallelism,
    :func:`pack_thd` whatever ``remove_padding`` says (CP splits packed slots), its outputs selected, then
    :func:`split_over_context`."""
    from megatron.core import parallel_state

    tp = parallel_state.get_tensor_model_parallel_world_size()
    cp = parallel_state.get_context_parallel_world_size()
    multiple = pad_multiple_for(tp, cp)
    if cp > 1:
        if shared_prefix_columns is not None:
            raise ValueError("the shared-prompt layout does not run under context parallelism "
                             "(model_builder.shared_prompts_unsupported)")
        inputs = pack_thd(input_ids, attention_mask, multiple)
        select_outputs(inputs, attention_mask if output_mask is None else output_mask)
        return split_over_context(inputs, parallel_state.get_context_parallel_group())
    if shared_prefix_columns is not None:
        inputs = pack_shared(input_ids, attention_mask, shared_prefix_columns, multiple)
        output_mask = attention_mask if output_mask is None else output_mask
    elif not remove_padding:
        inputs = trim_rows(input_ids, attention_mask, tp if sequence_parallel else 1)
    else:
        inputs = pack_thd(input_ids, attention_mask, multiple)
    if output_mask is not None:
        select_outputs(inputs, output_mask)
    return inputs


def select_hidden(hidden_states: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """megatron's ``[n, r, h]`` hidden states at flat ``[r, n]`` ``positions`` -> ``[K, 1, h]``."""
    return hidden_states.transpose(0, 1).reshape(-1, hidden_states.shape[-1])[positions].unsqueeze(1)


def unpack(values: torch.Tensor, inputs: ModelInputs) -> torch.Tensor:
    """Per-position ``values[r, n]`` (the output at a token's predictor, ``ModelInputs.predictors``) -> ``[B, S]``
    token convention. With ``inputs.selected``, ``values`` holds the K selected outputs, one per token of
    ``selected_source``; the others count as 0."""
    flat = values.reshape(-1)
    batch, seq_len = inputs.shape
    out = flat.new_zeros(batch * seq_len)
    if inputs.selected is not None:
        out = out.index_put((inputs.selected_source,), flat)
        if inputs.context_group is not None:
            out = context_parallel.sum_over_context(out, inputs.context_group)
        return out.view(batch, seq_len)
    previous = flat[inputs.predictors().clamp(min=0)]
    real = torch.where(inputs.first, torch.zeros_like(previous), previous)
    return out.index_put((inputs.source_index,), real).view(batch, seq_len)


@dataclass(frozen=True)
class OutputRequest:
    """What the last stage computes from the model output, and the layout every stage runs:
    ``remove_padding`` packs each micro-batch (:func:`pack_thd`), else :func:`trim_rows`. Outputs are the
    same ``[B, S]`` tensors either way.

    ``temperature`` T > 0: ``log_probs = log_softmax(logits / T)[target]`` and
    ``entropy = -sum_i p_i log p_i`` with ``p = softmax(logits / T)``; gradients flow through the
    division (d/dlogits = (1/T) d/d(logits/T)). Pass the temperature the evaluated tokens were sampled
    at (the rollout's). Critic values ignore it.

    ``sum_pi_squared``: also ``sum_pi_squared = sum_v p_v^2`` per token, from the same (temperature-divided)
    logits, without a gradient (forward-only passes ask for it: the old-log-prob pass with
    ``actor.calculate_sum_pi_squared``); off, nothing is computed.

    ``fused_chunk_size`` N: a policy's log-probs and entropy (and Σπ²) come from the hidden states through the fused
    output layer (``meshrl.parallel.fused_output``), N tokens at a time, never holding more than
    ``[N, V/TP]`` logits; None: from the output layer's ``[tokens, V/TP]`` logits. Critic values ignore it.

    ``shared_prompts``: micro-batches that say where their prompts end (``shared_prefix.PROMPT_END``) and replay no
    routes run in the shared-prompt layout (``meshrl.parallel.shared_prefix``: a prompt computed once for the rows
    that share it), whatever ``remove_padding`` says; the outputs are the same. The model must support it
    (``model_builder.shared_prompts_unsupported``).
    """

    log_probs: bool = True
    entropy: bool = False
    sum_pi_squared: bool = False
    temperature: float = 1.0
    remove_padding: bool = False
    fused_chunk_size: int | None = None
    shared_prompts: bool = False

    def __post_init__(self) -> None:
        if self.fused_chunk_size is not None and not self.fused_chunk_size >= 1:
            raise ValueError(f"OutputRequest.fused_chunk_size must be >= 1 token (or None: unfused), got "
                             f"{self.fused_chunk_size}")
        if not (self.temperature > 0 and math.isfinite(self.temperature)):
            raise ValueError(
                f"OutputRequest.temperature must be a finite number > 0, got {self.temperature}: log-probs "
                "are those of softmax(logits / temperature), and temperature 0 is greedy decoding, whose "
                "argmax tokens have no sampling distribution to train on; pass the temperature the "
                "rollout sampled with")


def _targets(inputs: ModelInputs) -> torch.Tensor:
    """The token each output position predicts, shaped like the outputs (``[r, n]``, or ``[1, K]``)."""
    if inputs.selected is not None:
        return inputs.selected_tokens[None]
    # Position p predicts the token at p+1; targets that cross into another row or slot (or wrap
    # around) belong to positions unpack drops.
    return torch.roll(inputs.input_ids.reshape(-1), shifts=-1).view_as(inputs.input_ids)


def compute_outputs(model_output: torch.Tensor, inputs: ModelInputs, request: OutputRequest,
                    critic: bool, head: OutputHead | None = None) -> dict[str, torch.Tensor]:
    """Turn the last stage's ``[r, n, V/TP]`` logits (or ``[r, n, 1]`` values) into aligned outputs; with
    ``inputs.selected`` they are ``[1, K, V/TP]`` (or ``[1, K, 1]``), one per selected position.
    With ``head`` (a fused pass, ``fused_output.projection_skipped``) ``model_output`` holds the hidden
    states, ``[r, n, H]`` or ``[1, K, H]``, that ``head`` projects."""
    if critic:
        return {"values": unpack(model_output.squeeze(-1).float(), inputs)}
    if head is not None:
        log_probs, entropy, sum_pi_squared = fused_log_probs_entropy(
            model_output, head.weight, _targets(inputs) if request.log_probs else None,
            temperature=request.temperature, softcap=head.softcap, chunk_size=request.fused_chunk_size,
            entropy=request.entropy, sum_pi_squared=request.sum_pi_squared)
        return {**({"entropy": unpack(entropy, inputs)} if request.entropy else {}),
                **({"sum_pi_squared": unpack(sum_pi_squared, inputs)} if request.sum_pi_squared else {}),
                **({"log_probs": unpack(log_probs, inputs)} if request.log_probs else {})}
    # The log-softmax in fp32 whatever the parameters' dtype: in bf16 it would sum the vocabulary's
    # exponentials and round each log-prob to 8 mantissa bits (±0.03 near -10). Entropy and log-probs
    # share this one copy (a no-op for fp32 models); the bf16 logits' own rounding remains.
    logits = model_output.float()
    if request.temperature != 1.0:
        # In place, so no second [tokens, V/TP] fp32 tensor: autograd allows it because neither the
        # output layer's backward nor the division's needs these values (both functions below save
        # their own results, not their input).
        logits.div_(request.temperature)
    outputs = {}
    if request.sum_pi_squared:  # before the log-probs, whose cross entropy modifies the logits in place
        outputs["sum_pi_squared"] = unpack(vocab_parallel_sum_pi_squared(logits), inputs)
    if request.entropy:
        outputs["entropy"] = unpack(vocab_parallel_entropy(logits), inputs)
    if request.log_probs:
        outputs["log_probs"] = unpack(vocab_parallel_log_probs(logits, _targets(inputs)), inputs)
    return outputs
