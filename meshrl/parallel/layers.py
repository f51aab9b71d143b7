"""meshrl's additions to megatron-core's layer specs: the CPU core attention and the structure some families
need that megatron-core 0.16.1 has no option for (``meshrl.parallel.model_builder`` puts them in the spec).

- ``sdpa_core_attention_class``: megatron's local ``DotProductAttention`` run by torch's fused SDPA, with
  sliding windows (megatron's ``window_size``) and attention logit soft-capping (explicit softmax).
- ``RMSNorm``: torch's RMSNorm honouring ``layernorm_zero_centered_gamma`` (scale ``1 + w``), which
  megatron's local torch norm refuses (``WrappedTorchNorm`` asserts it off); TE's norms honour it natively.
- ``post_normed(linear)``: an output projection followed by a norm of its full (TP-reduced) output: Gemma
  2/3's post-attention and post-feed-forward norms, named ``<linear>.post_norm.weight``.
- ``LocalRopeSelfAttention``: megatron's ``SelfAttention`` whose windowed layers rotate with their own RoPE
  base (Gemma 3's ``sliding_attention`` theta).
- ``scale_embeddings`` / ``softcap_logits``: forward hooks on the embedding (``x * sqrt(hidden)`` in the
  embedding's dtype) and on the policy's output layer (``c * tanh(logits / c)``, elementwise, so it commutes
  with the vocabulary split).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


def _window_mask(length: int, window: int | None, device) -> torch.Tensor | None:
    """``[s, s]`` bool, True where query i may see key j: causal, and ``i - j <= window`` when windowed
    (megatron's ``window_size[0]``); None for plain causal without a window."""
    if window is None:
        return None
    index = torch.arange(length, device=device)
    distance = index[:, None] - index[None, :]
    return (distance >= 0) & (distance <= window)


@functools.cache
def sdpa_core_attention_class():
    """megatron's local ``DotProductAttention`` computed by ``torch.nn.functional.scaled_dot_product_attention``.

    The local class materialises GQA-expanded keys/values and the ``[b, heads, s, s]`` scores and
    probabilities (kept for backward); torch's fused kernel does neither, which on CPU makes the
    attention ~15x faster and saves ~1.5 GiB of activations for SmolLM2 at 8x256 tokens. Serves the plain
    causal case (``[s, b, heads, d]``, no mask) and packed THD sequences (``[t, heads, d]`` with
    ``PackedSeqParams``, which the local class refuses): causal attention inside each slot of
    ``cu_seqlens_q_padded``, never across slots. A sliding-window layer (megatron's ``window_size`` =
    ``(w - 1, 0)`` on the layers ``window_attn_skip_freq`` marks) also masks keys more than ``w - 1`` tokens
    back. ``logit_softcap`` c (a spec parameter) caps the scaled scores to ``c * tanh(s / c)`` before the
    mask and an fp32 softmax — SDPA has no such option, so those layers run the explicit product. Anything
    else falls back to megatron.
    """
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    class SDPACoreAttention(DotProductAttention):
        def __init__(self, *args, logit_softcap: float | None = None, **kwargs):
            super().__init__(*args, **kwargs)
            self.logit_softcap = logit_softcap
            window = self.scale_mask_softmax.window_size
            if window is not None and window[1] != 0:
                raise ValueError(f"window_size {window}: a causal decoder's window looks back only (right 0)")
            self.window = None if window is None else window[0]

        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None):
            mask_type = attn_mask_type or self.attn_mask_type
            if (attention_mask is not None or attention_bias is not None
                    or (packed_seq_params is not None and packed_seq_params.qkv_format != "thd")
                    or mask_type != AttnMaskType.causal or self.softmax_offset is not None
                    or self.attention_dropout.p > 0):
                if self.logit_softcap is not None:
                    raise ValueError("attention logit soft-capping needs the causal, unmasked, dropout-free "
                                     "attention meshrl runs")
                return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias,
                                       packed_seq_params)
            if packed_seq_params is not None:
                return self._packed(query, key, value, packed_seq_params)
            seq, batch = query.shape[0], query.shape[1]
            # [s, b, heads, d] -> [b, heads, s, d]
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
            return self._causal(q, k, v).permute(2, 0, 1, 3).reshape(seq, batch, self.hidden_size_per_partition)

        def _packed(self, query, key, value, params):
            """``[t, heads, d]`` -> ``[t, heads * d]``: one causal SDPA call per slot. On CPU this beat a
            single call with a block-diagonal mask 11-35x (fwd+bwd, 8-32 sequences of 100-600 tokens),
            which computes and stores all t^2 scores."""
            cu = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q
            bounds = cu.tolist()
            slots = [self._causal(*(t[start:end].transpose(0, 1) for t in (query, key, value))).transpose(0, 1)
                     for start, end in zip(bounds[:-1], bounds[1:]) if end > start]
            return torch.cat(slots).reshape(query.shape[0], self.hidden_size_per_partition)

        def _causal(self, q, k, v):
            """Causal (windowed, soft-capped) attention on ``[..., heads, s, d]`` (GQA: fewer key/value heads)."""
            mask = _window_mask(q.shape[-2], self.window, q.device)
            groups = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
            if self.logit_softcap is None:
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                                      scale=self.softmax_scale, enable_gqa=groups > 1)
            if mask is None:
                mask = _window_mask(q.shape[-2], q.shape[-2], q.device)
            k, v = (t.repeat_interleave(groups, dim=-3) for t in (k, v))
            scores = torch.matmul(q, k.transpose(-1, -2)) * self.softmax_scale
            scores = torch.tanh(scores / self.logit_softcap) * self.logit_softcap
            scores = scores.masked_fill(~mask, float("-inf"))
            return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)

    return SDPACoreAttention


class RMSNorm(torch.nn.RMSNorm):
    """megatron's local RMSNorm (``WrappedTorchNorm``'s torch norm, same signature) with
    ``layernorm_zero_centered_gamma``: ``y = x / rms(x) * (1 + w)``, computed in fp32 and cast back as HF's
    ``GemmaRMSNorm``; ``w`` starts at 0. Without the option it is torch's RMSNorm."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5) -> None:
        super().__init__(hidden_size, eps=eps)
        self.zero_centered = config.layernorm_zero_centered_gamma
        if self.zero_centered:
            torch.nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.zero_centered:
            return super().forward(x)
        normed = F.rms_norm(x.float(), self.normalized_shape, eps=self.eps)
        return (normed * (1.0 + self.weight.float())).type_as(x)


@functools.cache
def post_normed(linear_cls: type, norm_cls: type) -> type:
    """``linear_cls`` (a row-parallel output projection returning ``(out, bias)``) followed by ``norm_cls`` on
    its output: the output is complete (reduced over TP) there, so the norm is replicated like the others."""

    class PostNormed(linear_cls):
        def __init__(self, input_size: int, output_size: int, *, config, **kwargs) -> None:
            super().__init__(input_size, output_size, config=config, **kwargs)
            self.post_norm = norm_cls(config=config, hidden_size=output_size, eps=config.layernorm_epsilon)

        def forward(self, *args, **kwargs):
            out, bias = super().forward(*args, **kwargs)
            if bias is not None:
                raise ValueError("a post-normed projection has no bias to add after the norm (add_bias_linear)")
            return self.post_norm(out), None

    PostNormed.__name__ = f"PostNormed{linear_cls.__name__}"
    return PostNormed


@functools.cache
def local_rope_self_attention_class():
    """megatron's ``SelfAttention`` taking ``local_rope_theta`` (a spec parameter): on the layers megatron
    windows (``is_layer_window_attention``) the rotary embedding GPTModel passes is replaced by one of the
    same length with that base; the other layers keep the model's ``rotary_base``."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.utils import is_layer_window_attention

    class LocalRopeSelfAttention(SelfAttention):
        def __init__(self, config, submodules, layer_number: int, *args, local_rope_theta: float, **kwargs):
            super().__init__(config, submodules, layer_number, *args, **kwargs)
            windowed = is_layer_window_attention(config.window_size, config.window_attn_skip_freq, self.layer_number)
            self.local_rope = RotaryEmbedding(config.kv_channels, rotary_percent=1.0, rotary_base=local_rope_theta,
                                              use_cpu_initialization=config.use_cpu_initialization) if windowed else None

        def forward(self, hidden_states, attention_mask, *args, rotary_pos_emb=None, **kwargs):
            if self.local_rope is not None and rotary_pos_emb is not None:
                if not isinstance(rotary_pos_emb, torch.Tensor):
                    raise ValueError("a local RoPE base needs GPTModel's single rotary embedding tensor")
                rotary_pos_emb = self.local_rope(rotary_pos_emb.shape[0])
            return super().forward(hidden_states, attention_mask, *args, rotary_pos_emb=rotary_pos_emb, **kwargs)

    return LocalRopeSelfAttention


def scale_embeddings(module, args, output: torch.Tensor, *, factor: float) -> torch.Tensor:
    """Forward hook of the embedding: ``output * factor`` with ``factor`` rounded to the output's dtype, as
    HF's Gemma ``normalizer`` (sqrt(640) = 25.298 is 25.25 in bf16)."""
    return output * torch.tensor(factor, dtype=output.dtype, device=output.device)


def softcap_logits(module, args, output: tuple, *, cap: float) -> tuple:
    """Forward hook of the policy's output layer (``(logits, bias)``): logits -> ``cap * tanh(logits / cap)``."""
    logits, bias = output
    return torch.tanh(logits / cap) * cap, bias
