"""The policy's output layer fused with log-probs and entropy: no ``[tokens, V/TP]`` logits kept for backward.

For the hidden states ``h [N, H]`` of the selected positions (replicated over the TP group), this rank's
vocabulary shard ``W [V/TP, H]`` of the output weight (the output layer's, or the input embedding's when the
model ties them), targets ``y [N]`` (vocabulary ids), temperature ``T`` and the family's final soft-cap ``c``:

    z = h W^T                       this rank's logits, in the model's dtype, then fp32 (as the unfused path)
    s = c tanh(z / c)               soft-capped families (Gemma 2); else s = z
    x = s / T
    m = max_v x_v,  l = log sum_v exp(x_v - m)        max and sum reduced over the TP group
    log_prob = (x_y - m) - l        x_y from the rank whose shard holds y, summed over the group
    entropy  = -sum_v p_v log p_v,  log p = (x - m) - l,  summed over the group
    sum_pi_squared = sum_v exp(x_v - m)^2 / exp(l)^2           (asked for only; no gradient)

the same operations, in the same order and precision, as ``forward.vocab_parallel_log_probs`` (megatron's
vocab-parallel cross entropy) and ``forward.vocab_parallel_entropy`` on the full logits. It runs over chunks of
``chunk_size`` tokens, so at most one chunk's ``[chunk, V/TP]`` logits exist at a time, in the forward and in
the backward. The backward recomputes each chunk's logits from ``h`` and ``W`` (kept by reference: the
unfused output layer keeps them too) and the per-token ``m``, ``l`` and entropy saved by the forward:

    dL/dx_v = g_lp (1[v = y] - p_v) - g_H p_v (log p_v + H)
    dL/dz   = dL/dx / T    (times 1 - tanh^2(z / c) when soft-capped)
    dL/dh   = dL/dz W      this shard's term; the caller's ``copy_to_tensor_model_parallel_region`` sums
                           it over the TP group, as megatron's column-parallel output layer does
    dL/dW   = dL/dz^T h    this shard's rows, accumulated over the chunks in fp32

Cost: the backward's recomputation is one more ``[N, H] x [H, V/TP]`` product per trained token (4 instead
of 3); forward-only passes cost the same as unfused.

A pass runs the model inside :func:`projection_skipped` (the last stage returns the hidden states its output
layer would have projected, and the block gets the ``OutputHead`` that projects them).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist


def _capped_logits(hidden: torch.Tensor, weight: torch.Tensor, softcap: float | None
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(s in fp32, tanh(z / c) or None) of one chunk; the soft-cap in the model's dtype, as the unfused
    output layer's hook (``layers.softcap_logits``) applies it before the fp32 upcast."""
    logits = torch.matmul(hidden, weight.t())
    if softcap is None:
        return logits.float(), None
    capped = torch.tanh(logits / softcap)
    return (capped * softcap).float(), capped.float()


def _chunks(count: int, chunk_size: int) -> list[slice]:
    """``count`` rows in the fewest chunks of at most ``chunk_size``, of equal sizes up to one row: no
    small remainder chunk, whose product BLAS would round differently from the full one (a few-row
    product takes another kernel) and run slower."""
    pieces = -(-count // chunk_size)
    return [slice(count * i // pieces, count * (i + 1) // pieces) for i in range(pieces)]


def _target_in_shard(target: torch.Tensor, shard: int, group) -> tuple[torch.Tensor, torch.Tensor]:
    """(local column of each target in this rank's vocabulary shard (0 where absent), whether absent)."""
    local = target - dist.get_rank(group) * shard
    absent = (local < 0) | (local >= shard)
    return local.masked_fill(absent, 0), absent


class _FusedLogProbsEntropy(torch.autograd.Function):
    """``(log_probs [N], entropy [N], sum_pi_squared [N])`` from ``hidden [N, H]`` and ``weight [V/TP, H]``; the
    module docstring's formulas. ``target`` None: no log-probs (an empty tensor comes back); ``entropy`` False,
    ``sum_pi_squared`` False: likewise. Σπ² has no gradient."""

    @staticmethod
    def forward(ctx, hidden, weight, target, temperature, softcap, chunk_size, entropy, group, sum_pi_squared=False):
        count, shard = hidden.shape[0], weight.shape[0]
        stats = hidden.new_empty((3, count), dtype=torch.float32)  # m, sum exp(x - m), entropy per token
        log_probs = hidden.new_empty(count if target is not None else 0, dtype=torch.float32)
        squares = hidden.new_empty(count if sum_pi_squared else 0, dtype=torch.float32)
        for rows in _chunks(count, chunk_size):
            logits, _ = _capped_logits(hidden[rows], weight, softcap)
            if temperature != 1.0:
                logits.div_(temperature)
            maximum = logits.max(dim=-1).values
            dist.all_reduce(maximum, op=dist.ReduceOp.MAX, group=group)
            shifted = logits.sub_(maximum.unsqueeze(-1))
            if target is not None:
                local, absent = _target_in_shard(target[rows], shard, group)
                picked = shifted.gather(1, local.unsqueeze(1)).squeeze(1).masked_fill(absent, 0.0)
            exp = shifted.exp()
            sum_exp = exp.sum(dim=-1)
            # one all-reduce for the sum of exponentials, the target's logit and the sum of squares
            parts = [sum_exp] + ([picked] if target is not None else []) \
                + ([exp.square_().sum(dim=-1)] if sum_pi_squared else [])
            del exp
            reduced = torch.stack(parts)
            dist.all_reduce(reduced, group=group)
            log_sum = reduced[0].log()
            if target is not None:
                log_probs[rows] = reduced[1] - log_sum
            if sum_pi_squared:
                squares[rows] = reduced[-1] / reduced[0].square()
            stats[0, rows], stats[1, rows] = maximum, reduced[0]
            if entropy:
                log_p = shifted.sub_(log_sum.unsqueeze(-1))
                stats[2, rows] = -log_p.exp().mul_(log_p).sum(dim=-1)
        if entropy:
            dist.all_reduce(stats[2], group=group)
        ctx.save_for_backward(hidden, weight, target if target is not None else hidden.new_empty(0), stats)
        ctx.config = (temperature, softcap, chunk_size, target is not None, entropy, group)
        ctx.mark_non_differentiable(squares)
        return log_probs, stats[2].clone() if entropy else hidden.new_empty(0, dtype=torch.float32), squares

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy, grad_squares):
        hidden, weight, target, stats = ctx.saved_tensors
        temperature, softcap, chunk_size, has_target, has_entropy, group = ctx.config
        want_hidden, want_weight = ctx.needs_input_grad[:2]
        grad_hidden = torch.empty_like(hidden) if want_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_weight else None
        count, shard = hidden.shape[0], weight.shape[0]
        for rows in _chunks(count, chunk_size):
            chunk = hidden[rows]
            x, capped = _capped_logits(chunk, weight, softcap)
            if temperature != 1.0:
                x.div_(temperature)
            shifted = x.sub_(stats[0, rows].unsqueeze(-1))
            sum_exp = stats[1, rows].unsqueeze(-1)
            # Each output's gradient as the unfused functions compute it, so the two paths round alike.
            grad = None
            if has_entropy:  # forward.vocab_parallel_entropy's -p (log p + H) g_H, as ((log p + H) p) (-g_H)
                log_p = shifted - sum_exp.log()
                p = log_p.exp()
                grad = log_p.add_(stats[2, rows].unsqueeze(-1)).mul_(p).mul_(-grad_entropy[rows].unsqueeze(-1))
                del p
            if has_target:  # megatron's cross entropy's, whose loss is -log_prob: (softmax - onehot(y)) (-g_lp)
                softmax = shifted.exp_().div_(sum_exp)
                local, absent = _target_in_shard(target[rows], shard, group)
                softmax[torch.arange(len(local), device=local.device), local] -= (~absent).float()
                softmax.mul_(-grad_log_probs[rows].unsqueeze(-1))
                grad = softmax if grad is None else grad.add_(softmax)
            if temperature != 1.0:
                grad.div_(temperature)
            if softcap is not None:  # autograd's order through c * tanh(z / c)
                grad = grad.mul_(softcap).mul_(1 - capped * capped).div_(softcap)
            grad = grad.to(hidden.dtype)
            if want_hidden:
                grad_hidden[rows] = torch.matmul(grad, weight)
            if want_weight:
                grad_weight.add_(torch.matmul(grad.t(), chunk).float())
        return (grad_hidden, grad_weight.to(weight.dtype) if want_weight else None,
                None, None, None, None, None, None, None)


def fused_log_probs_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor | None, *,
                            temperature: float, softcap: float | None, chunk_size: int, entropy: bool,
                            sum_pi_squared: bool = False
                            ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """``(log_probs, entropy, sum_pi_squared)`` of shape ``hidden.shape[:-1]`` (None where not asked: ``target``
    None, ``entropy`` False, ``sum_pi_squared`` False) by the module docstring's formulas, the first two
    differentiable in ``hidden`` and ``weight``.

    ``hidden [..., H]`` is replicated over the TP group (its gradient is summed over it here); ``weight``
    ``[V/TP, H]`` is this rank's vocabulary shard; ``target`` holds vocabulary ids, shaped like ``hidden[..., 0]``.
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    group = parallel_state.get_tensor_model_parallel_group()
    shape = hidden.shape[:-1]
    flat = copy_to_tensor_model_parallel_region(hidden).reshape(-1, hidden.shape[-1])
    log_probs, entropies, squares = _FusedLogProbsEntropy.apply(
        flat, weight, target.reshape(-1) if target is not None else None, float(temperature), softcap,
        int(chunk_size), bool(entropy), group, bool(sum_pi_squared))
    return (log_probs.view(shape) if target is not None else None,
            entropies.view(shape) if entropy else None,
            squares.view(shape) if sum_pi_squared else None)


@dataclass(frozen=True)
class OutputHead:
    """A last pipeline stage's vocabulary projection, for :func:`fused_log_probs_entropy`."""

    weight: torch.Tensor  # [V/TP, H]: the output layer's, or the embedding's when tied (as GPTModel passes it)
    softcap: float | None  # the family's final logit soft-cap


class _HiddenStates(torch.nn.Module):
    """Stands in for the output layer: returns the hidden states it is given (``ColumnParallelLinear``'s
    call signature and ``(output, bias)`` result). It shows the layer's ``weight`` (None when tied on the
    first stage): a tied model's last stage reads the shared weight from there."""

    def __init__(self, layer: torch.nn.Module):
        super().__init__()
        self.weight = layer.weight
        self.sequence_parallel = layer.sequence_parallel

    def forward(self, hidden_states, weight=None, runtime_gather_output=None):
        return hidden_states, None


@contextlib.contextmanager
def projection_skipped(model: torch.nn.Module) -> Iterator[OutputHead | None]:
    """While the block runs, the last stage of ``model`` (a bare ``GPTModel`` built by ``model_builder``)
    returns its final hidden states (``[b, s, H]``, where it returned logits) and the block gets the
    ``OutputHead`` that projects them; other stages run as they are and get None.

    The output layer is replaced by a stand-in for the block, so its own hooks do not run (the soft-cap:
    :func:`fused_log_probs_entropy` applies it); hooks meant for the stand-in (position selection, and under
    sequence parallelism the gather of the sequence shards, ``schedule._output_layer_on``) are registered
    inside the block.
    """
    if not getattr(model, "post_process", False):
        yield None
        return
    layer = model.output_layer
    # The weight GPTModel's _postprocess passes the output layer: the shared embedding when tied.
    weight = model.shared_embedding_or_output_weight() if model.share_embeddings_and_output_weights else layer.weight
    model.output_layer = _HiddenStates(layer)
    try:
        yield OutputHead(weight=weight, softcap=model.meshrl_spec.final_logit_softcap)
    finally:
        model.output_layer = layer
