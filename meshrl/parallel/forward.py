"""Per-token model outputs from vocab-parallel logits, and the forward step the pipeline schedules run.

Alignment convention (every output is ``[batch, seq]``, like the micro-batch's ``input_ids``):
``out[b, t]`` concerns token ``t`` and is computed from tokens ``< t`` of the same row:

- ``log_probs[b, t] = log pi(input_ids[b, t] | input_ids[b, <t])``
- ``entropy[b, t]``  = entropy of that next-token distribution
- ``values[b, t]``   = critic value of the prefix before token ``t`` (the state that emits it)

Positions without a prediction (the first valid token of a row, padding) are 0.

Padding: a micro-batch carries ``input_ids`` and ``attention_mask`` (1 = token). The valid tokens of a
row form the sequence, in order, wherever the padding is (left, right, or between prompt and
response): they are moved to the front (positions 0..n-1), the batch is trimmed to its longest row,
the model runs with a plain causal mask (valid tokens never see padding, which sits after them), and
outputs are scattered back to the original positions. This equals HF with ``position_ids =
cumsum(mask) - 1`` and padding masked out.

Full-vocabulary logits are never materialised on one rank: log-probs use megatron's
``vocab_parallel_cross_entropy`` and entropy uses ``vocab_parallel_entropy`` below, both reducing over
the TP group, both differentiable, both from the logits upcast to fp32 whatever the model's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

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


def vocab_parallel_log_probs(vocab_parallel_logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[target] via megatron's vocab-parallel cross entropy (modifies fp32 logits in place)."""
    from megatron.core import tensor_parallel

    return -tensor_parallel.vocab_parallel_cross_entropy(vocab_parallel_logits, target)


@dataclass
class PackedBatch:
    """A micro-batch with each row's valid tokens moved to the front and the batch trimmed."""

    input_ids: torch.Tensor  # [b, n]
    position_ids: torch.Tensor  # [b, n]
    valid: torch.Tensor  # [b, n] bool
    order: torch.Tensor  # [b, n]: original column of each packed column
    seq_len: int  # original s


def pack(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> PackedBatch:
    """Move valid tokens to the front of each row (stable) and trim to the longest row."""
    mask = attention_mask.bool()
    batch, seq_len = input_ids.shape
    order = torch.sort((~mask).to(torch.int8), dim=1, stable=True).indices
    counts = mask.sum(dim=1)
    width = max(int(counts.max()), 1)
    order = order[:, :width]
    positions = torch.arange(width, device=input_ids.device).expand(batch, width)
    return PackedBatch(input_ids=input_ids.gather(1, order), position_ids=positions.contiguous(),
                       valid=positions < counts.unsqueeze(1), order=order, seq_len=seq_len)


def unpack(values: torch.Tensor, packed: PackedBatch) -> torch.Tensor:
    """Shift packed per-position ``values[b, n]`` (position t predicts t+1) to the token convention."""
    shifted = torch.zeros_like(values)
    shifted[:, 1:] = values[:, :-1]
    shifted = torch.where(packed.valid & (packed.position_ids > 0), shifted, torch.zeros_like(shifted))
    out = torch.zeros(values.shape[0], packed.seq_len, dtype=values.dtype, device=values.device)
    return out.scatter(1, packed.order, shifted)


@dataclass(frozen=True)
class OutputRequest:
    """What the last stage computes from the model output. ``temperature`` divides the logits."""

    log_probs: bool = True
    entropy: bool = False
    temperature: float = 1.0


def compute_outputs(model_output: torch.Tensor, packed: PackedBatch, request: OutputRequest,
                    critic: bool) -> dict[str, torch.Tensor]:
    """Turn the last stage's ``[b, n, V/TP]`` logits (or ``[b, n, 1]`` values) into aligned outputs."""
    if critic:
        return {"values": unpack(model_output.squeeze(-1).float(), packed)}
    # The log-softmax in fp32 whatever the parameters' dtype: in bf16 it would sum the vocabulary's
    # exponentials and round each log-prob to 8 mantissa bits (±0.03 near -10). Entropy and log-probs
    # share this one copy (a no-op for fp32 models); the bf16 logits' own rounding remains.
    logits = model_output.float()
    if request.temperature != 1.0:
        logits = logits / request.temperature
    outputs = {}
    if request.entropy:
        outputs["entropy"] = unpack(vocab_parallel_entropy(logits), packed)
    if request.log_probs:
        # Position t predicts token t+1; the last column's target is a placeholder, dropped by unpack.
        target = torch.roll(packed.input_ids, shifts=-1, dims=1)
        outputs["log_probs"] = unpack(vocab_parallel_log_probs(logits, target), packed)
    return outputs
