"""meshrl's additions to megatron-core's layer specs: the CPU core attention and the structure some families
need that megatron-core 0.16.1 has no option for (``meshrl.parallel.model_builder`` puts them in the spec).

- ``sdpa_core_attention_class``: megatron's local ``DotProductAttention`` run by torch's fused SDPA, with
  sliding windows (megatron's ``window_size``) and attention logit soft-capping (explicit softmax).
- ``RMSNorm``: torch's RMSNorm honouring ``layernorm_zero_centered_gamma`` (scale ``1 + w``) and
  ``sequence_parallel``, which megatron's local torch norm refuses (``WrappedTorchNorm`` asserts both off); TE's
  norms honour them natively.
- ``post_normed(linear)``: an output projection followed by a norm of its full (TP-reduced) output: Gemma
  2/3's post-attention and post-feed-forward norms, named ``<linear>.post_norm.weight``.
- ``LocalRopeSelfAttention``: megatron's ``SelfAttention`` whose windowed layers rotate with their own RoPE
  base (Gemma 3's ``sliding_attention`` theta).
- ``tp_split_moe_layer_class``: megatron's ``MoELayer`` that, at TP > 1 without sequence parallelism (which
  megatron's MoE layer requires for training, and the local spec's torch norms cannot run), routes each TP
  rank's share of the tokens only and all-gathers the results, as sequence parallelism would.
- ``mean_aux_loss_router_class``: megatron's top-k router attaching its load-balancing and z-losses so that a
  training pass adds their mean over micro-batches and data-parallel ranks (megatron's and verl's scaling) under
  meshrl's gradient contract.
- ``interleaved_mrope_class``: megatron's multimodal rotary embedding with Qwen3-VL's interleaved (temporal,
  height, width) frequencies (``ModelSpec.mrope_interleaved``), GPTModel's ``rotary_pos_emb`` for those models.
- ``scale_embeddings`` / ``softcap_logits``: forward hooks on the embedding (``x * sqrt(hidden)`` in the
  embedding's dtype) and on the policy's output layer (``c * tanh(logits / c)``, elementwise, so it commutes
  with the vocabulary split).
"""

from __future__ import annotations

import copy
import functools

import torch
import torch.nn.functional as F

from meshrl.parallel import context_parallel
from meshrl.parallel.shared_prefix import prefix_mask


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
    else falls back to megatron. Multi-latent attention builds it with ``k_channels`` (query / key head width) and
    ``v_channels`` (value head width, the config's ``kv_channels``, by which the output is sized): SDPA takes
    keys and values of different widths as they come. Under context parallelism (packed sequences only, which
    megatron's local class refuses) each rank's chunks of a slot attend to the slot's keys gathered over the CP
    group (``meshrl.parallel.context_parallel``).
    """
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    class SDPACoreAttention(DotProductAttention):
        def __init__(self, config, *args, logit_softcap: float | None = None, k_channels: int | None = None,
                     v_channels: int | None = None, **kwargs):
            # megatron's class asserts CP == 1 (its CP attention is Transformer Engine's); _packed_context runs it
            single = copy.copy(config)
            single.context_parallel_size = 1
            super().__init__(single, *args, **kwargs)
            self.config = config
            if v_channels is not None and v_channels != self.hidden_size_per_attention_head:
                raise ValueError(f"value heads of {v_channels} need kv_channels={v_channels} in the config")
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
            which computes and stores all t^2 scores. Each slot goes in as a batch of one (``[1, heads, s, d]``):
            torch's CPU flash kernel takes 4-D inputs only, and a 3-D call falls back to the math path, which
            keeps every slot's ``[heads, s, s]`` probabilities for the backward (SmolLM2 at TP3, one 2,048-token
            slot: 1.36 GiB more saved over 30 layers, ``bench/sequence_parallel.py``).

            The slots are cut with one ``split`` per tensor, not sliced one by one: a slice's backward allocates a
            zero tensor of the whole packed size for each slot and the engine then adds them up, where a split's
            backward concatenates the slots' gradients once (SmolLM2, two 3,006-token micro-batches of 40 slots:
            38 GB of zero-filled gradients per update, the most of its page faults under the fixed mmap threshold)."""
            cu = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q
            if self.config.context_parallel_size > 1:
                return self._packed_context(query, key, value, cu)
            bounds = cu.tolist()
            sizes = [bounds[0], *(end - start for start, end in zip(bounds[:-1], bounds[1:])),
                     query.shape[0] - bounds[-1]]
            queries, keys, values = (t.split(sizes) for t in (query, key, value))
            starts = {start: index for index, start in enumerate(bounds[:-1], start=1)}
            prefixes = getattr(params, "segments", None) or [None] * (len(bounds) - 1)
            slots = []
            for index, prefix in enumerate(prefixes, start=1):
                if not sizes[index]:
                    continue
                q, k, v = (pieces[index].transpose(0, 1)[None] for pieces in (queries, keys, values))
                if prefix is None:
                    out = self._causal(q, k, v)
                else:  # a response of the shared-prompt layout: the prompt's real tokens lead its slot
                    begin, length = prefix
                    k, v = (torch.cat([pieces[starts[begin]][:length], pieces[index]]).transpose(0, 1)[None]
                            for pieces in (keys, values))
                    out = self._masked(q, k, v, prefix_mask(length, sizes[index], self.window, query.device))
                slots.append(out[0].transpose(0, 1))
            return torch.cat(slots).reshape(query.shape[0], self.hidden_size_per_partition)

        def _packed_context(self, query, key, value, cu):
            """``[t, heads, d]`` -> ``[t, heads * d]`` for this CP rank's chunks of every slot of ``cu`` (global slot
            offsets, ``meshrl.parallel.context_parallel``): keys and values gathered over the CP group, each chunk's
            queries causal over the slot's keys up to their own position."""
            from megatron.core import parallel_state

            group = parallel_state.get_context_parallel_group()
            size, rank, width = group.size(), group.rank(), key.shape[-1]
            gathered = context_parallel.gather_over_context(torch.cat([key, value], dim=-1), group)
            bounds = (cu // size).tolist()
            halves = [(end - start) // 2 for start, end in zip(bounds[:-1], bounds[1:])]
            sizes = [bounds[0], *(half for half in halves for _ in range(2)), query.shape[0] - bounds[-1]]
            queries, keys = query.split(sizes), gathered.split(sizes, dim=1)  # split, not sliced: see _packed
            out = []
            for slot, half in enumerate(halves):
                if not half:
                    continue
                pieces = (1 + 2 * slot, 2 + 2 * slot)
                for which, first, seen in context_parallel.chunk_keys(*(keys[i] for i in pieces), rank, size):
                    q = queries[pieces[which]].transpose(0, 1)[None]
                    k, v = (t.transpose(0, 1)[None] for t in seen.split([width, seen.shape[-1] - width], dim=-1))
                    if first == 0:
                        out.append(self._causal(q, k, v)[0].transpose(0, 1))
                    else:
                        mask = prefix_mask(first, half, self.window, query.device)
                        out.append(self._masked(q, k, v, mask)[0].transpose(0, 1))
            return torch.cat(out).reshape(query.shape[0], self.hidden_size_per_partition)

        def _causal(self, q, k, v):
            """Causal (windowed, soft-capped) attention on ``[..., heads, s, d]`` (GQA: fewer key/value heads)."""
            mask = _window_mask(q.shape[-2], self.window, q.device)
            if mask is None and self.logit_softcap is None:
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale,
                                                      enable_gqa=self._gqa_groups > 1)
            return self._masked(q, k, v, _window_mask(q.shape[-2], q.shape[-2], q.device) if mask is None else mask)

        @property
        def _gqa_groups(self) -> int:
            return self.num_attention_heads_per_partition // self.num_query_groups_per_partition

        def _masked(self, q, k, v, mask):
            """Attention of ``[..., heads, s, d]`` queries over ``[..., groups, s_k, d]`` keys where ``mask``
            (``[s, s_k]`` bool) allows, soft-capped when the layer is."""
            groups = self._gqa_groups
            if self.logit_softcap is None:
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.softmax_scale,
                                                      enable_gqa=groups > 1)
            k, v = (t.repeat_interleave(groups, dim=-3) for t in (k, v))
            scores = torch.matmul(q, k.transpose(-1, -2)) * self.softmax_scale
            scores = torch.tanh(scores / self.logit_softcap) * self.logit_softcap
            scores = scores.masked_fill(~mask, float("-inf"))
            return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)

    return SDPACoreAttention


class RMSNorm(torch.nn.RMSNorm):
    """megatron's local RMSNorm (``WrappedTorchNorm``'s torch norm, same signature) with
    ``layernorm_zero_centered_gamma``: ``y = x / rms(x) * (1 + w)``, computed in fp32 and cast back as HF's
    ``GemmaRMSNorm``; ``w`` starts at 0. Without the option it is torch's RMSNorm. Unlike megatron's torch
    norm it runs under ``sequence_parallel``: each TP rank normalises its sequence shard, and the weight is
    marked as TE's norms mark theirs, so that megatron's ``finalize_model_grads`` sums its gradient over TP."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5) -> None:
        super().__init__(hidden_size, eps=eps)
        self.weight.sequence_parallel = config.sequence_parallel
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
            self.local_rope = (RotaryEmbedding(config.kv_channels, rotary_percent=1.0, rotary_base=local_rope_theta,
                                               use_cpu_initialization=config.use_cpu_initialization)
                               if windowed else None)

        def forward(self, hidden_states, attention_mask, *args, rotary_pos_emb=None, **kwargs):
            if self.local_rope is not None and rotary_pos_emb is not None:
                if not isinstance(rotary_pos_emb, torch.Tensor):
                    raise ValueError("a local RoPE base needs GPTModel's single rotary embedding tensor")
                # packed (THD): the whole table, which megatron's THD rotary splits per CP rank itself
                packed = kwargs.get("packed_seq_params")
                rotary_pos_emb = self.local_rope(rotary_pos_emb.shape[0],
                                                 packed_seq=packed is not None and packed.qkv_format == "thd")
            return super().forward(hidden_states, attention_mask, *args, rotary_pos_emb=rotary_pos_emb, **kwargs)

    return LocalRopeSelfAttention


def interleaved_mrope_axes(sections, frequencies: int) -> torch.Tensor:
    """``[frequencies]`` long: the position axis (0 temporal, 1 height, 2 width) that turns each rotary frequency
    under interleaved M-RoPE, transformers' ``Qwen3VLTextRotaryEmbedding.apply_interleaved_mrope``: frequency ``i``
    takes axis ``a = i % 3`` when ``a > 0`` and ``i < 3 * sections[a]`` (its ``slice(a, 3 * sections[a], 3)``),
    the temporal axis otherwise. Qwen3-VL's ``[24, 20, 20]`` over 64 frequencies: ``T H W`` 20 times, then ``T T
    T T``."""
    index = torch.arange(frequencies)
    axis = index % 3
    limit = 3 * torch.tensor([0, sections[1], sections[2]])[axis]
    return torch.where(index < limit, axis, torch.zeros_like(axis))


@functools.cache
def interleaved_mrope_class():
    """megatron's ``MultimodalRotaryEmbedding`` (GPTModel's ``rotary_pos_emb`` under ``position_embedding_type``
    "mrope") with Qwen3-VL's interleaved axes (``interleaved_mrope_axes``) instead of megatron's consecutive
    sections. Same contract: ``forward(position_ids [3, b, s], mrope_section, cp_group)`` -> the angles
    ``[s, b, 1, D]`` (``D`` the rotated head width), ``[f, f]`` with ``f_i = p_axis(i) * inv_freq_i``, the
    rotate-half layout megatron's ``apply_rotary_pos_emb`` and transformers' both turn; this context-parallel rank's
    part of the sequence when CP splits it (as megatron's). ``f`` is the elementwise fp32 product, as transformers
    computes it (megatron's class takes it from a one-term matmul)."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import (MultimodalRotaryEmbedding,
                                                                             get_pos_emb_on_this_cp_rank)

    class InterleavedMultimodalRotaryEmbedding(MultimodalRotaryEmbedding):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            if self.rotary_interleaved:  # adjacent-pair rotation would need its own frequency layout
                raise ValueError("interleaved M-RoPE turns the two halves of each head (rotary_interleaved=False)")

        def forward(self, position_ids: torch.Tensor, mrope_section, cp_group=None) -> torch.Tensor:
            seq = position_ids.to(device=self.inv_freq.device, dtype=self.inv_freq.dtype)
            if self.seq_len_interpolation_factor is not None:
                seq = seq * (1 / self.seq_len_interpolation_factor)
            freqs = seq[..., None] * self.inv_freq  # [3, b, s, D / 2]
            axes = interleaved_mrope_axes(mrope_section, freqs.shape[-1]).to(freqs.device)
            freqs = freqs.gather(0, axes.expand_as(freqs[:1]))[0]  # [b, s, D / 2], each frequency its axis'
            emb = torch.cat((freqs, freqs), dim=-1)[:, :, None, :].transpose(0, 1).contiguous()  # [s, b, 1, D]
            cp_group = cp_group if cp_group is not None else self.cp_group
            if cp_group is not None and cp_group.size() > 1:
                emb = get_pos_emb_on_this_cp_rank(emb, 0, cp_group)
            return emb

    return InterleavedMultimodalRotaryEmbedding


def scale_embeddings(module, args, output: torch.Tensor, *, factor: float) -> torch.Tensor:
    """Forward hook of the embedding: ``output * factor`` with ``factor`` rounded to the output's dtype, as
    HF's Gemma ``normalizer`` (sqrt(640) = 25.298 is 25.25 in bf16)."""
    return output * torch.tensor(factor, dtype=output.dtype, device=output.device)


def softcap_logits(module, args, output: tuple, *, cap: float) -> tuple:
    """Forward hook of the policy's output layer (``(logits, bias)``): logits -> ``cap * tanh(logits / cap)``."""
    logits, bias = output
    return torch.tanh(logits / cap) * cap, bias


@functools.cache
def local_mla_without_transformer_engine() -> None:
    """Let megatron's ``MLASelfAttention`` run on the local spec without Transformer Engine: megatron-core 0.16.1
    stands TE's classes in by mocks when TE is missing yet still sets ``HAVE_TE`` in that module, and then tests
    ``isinstance(self.linear_proj, TELinear)`` against the mock (a TypeError)."""
    from megatron.core.transformer import multi_latent_attention

    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        multi_latent_attention.HAVE_TE = False


class _GatherLatentRows(torch.autograd.Function):
    """Forward: every TP rank's rows of MLA's down projection (``[latent; rope key]`` split over TP) all-gathered
    along the last dim, as megatron's ``gather_from_tensor_model_parallel_region``. Backward: this rank's slice of
    the gradient, its last ``rope`` columns (the RoPE key's) summed over TP first.

    megatron's own backward takes the slice alone, which is right for the latent (its gradient arrives whole on every
    rank, all-reduced by ``linear_kv_up_proj``'s column-parallel input) but not for the RoPE key every head shares:
    each rank's gradient of it sums over its own heads only. Measured on tiny:deepseek_v3 at TP2: gradients up to
    0.038 off transformers' (embedding; 0.021 on ``kv_a_proj_with_mqa``) while the outputs agreed."""

    @staticmethod
    def forward(ctx, rows, rope, group):
        ctx.rope, ctx.group = rope, group
        parts = [torch.empty_like(rows) for _ in range(group.size())]
        torch.distributed.all_gather(parts, rows.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        rope = grad[..., grad.shape[-1] - ctx.rope:].contiguous()  # a collective needs its own storage
        torch.distributed.all_reduce(rope, group=ctx.group)
        grad[..., grad.shape[-1] - ctx.rope:] = rope
        width = grad.shape[-1] // ctx.group.size()
        start = ctx.group.rank() * width
        return grad[..., start:start + width].contiguous(), None, None


@functools.cache
def mla_self_attention_class():
    """megatron's ``MLASelfAttention`` (local spec) whose ``linear_kv_down_proj``, at TP > 1, gathers its rows itself
    with ``_GatherLatentRows`` (megatron then splits the full output without gathering it again), so that the
    shared RoPE key's gradient is summed over the TP ranks' heads. The projection keeps its class's parameters and
    names (megatron builds it only from a fixed list of linear classes, hence the swap after construction)."""
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    class KVDownProjection(torch.nn.Module):
        def forward(self, hidden_states):
            rows, bias = super().forward(hidden_states)
            return _GatherLatentRows.apply(rows, self.meshrl_rope, self.tp_group), bias

    class TPRopeKeyMLASelfAttention(MLASelfAttention):
        def __init__(self, config, *args, **kwargs):
            super().__init__(config, *args, **kwargs)
            down = self.linear_kv_down_proj
            if down.tp_group.size() > 1:  # without sequence parallelism (model_builder refuses it with MLA)
                down.__class__ = type(f"KVDown{type(down).__name__}", (KVDownProjection, type(down)), {})
                down.meshrl_rope = self.config.qk_pos_emb_head_dim

    return TPRopeKeyMLASelfAttention


# Attribute marking a parameter whose gradient each TP rank computes from its own share of the tokens:
# ``model_builder``'s gradient finalisation sums it over the TP group.
TP_PARTIAL_GRAD = "meshrl_tp_partial_grad"
# Likewise over the expert-tensor-parallel group: the replicated factor of a routed expert's LoRA adapter, whose
# expert-TP ranks each add their own term (``parallel.lora``).
ETP_PARTIAL_GRAD = "meshrl_etp_partial_grad"


def _token_shares(count: int, parts: int) -> list[int]:
    """``count`` tokens cut into ``parts`` contiguous shares, the first ``count % parts`` one longer."""
    return [count // parts + (index < count % parts) for index in range(parts)]


def _all_gather_rows(rows: torch.Tensor, shares: list[int], group) -> torch.Tensor:
    """Every rank's ``rows`` (``shares[r]`` of them on rank r) concatenated in rank order, on every rank."""
    import torch.distributed as dist

    width = max(shares)
    padded = rows.new_zeros((width,) + tuple(rows.shape[1:]))
    padded[: rows.shape[0]] = rows
    gathered = [torch.empty_like(padded) for _ in shares]
    dist.all_gather(gathered, padded.contiguous(), group=group)
    return torch.cat([part[:share] for part, share in zip(gathered, shares)])


class _TakeShare(torch.autograd.Function):
    """Forward: this TP rank's share of replicated rows. Backward: the full gradient, every rank's share of it
    all-gathered (each rank's share of the tokens flowed through that rank only)."""

    @staticmethod
    def forward(ctx, rows, shares, rank, group):
        ctx.shares, ctx.group = shares, group
        start = sum(shares[:rank])
        return rows[start:start + shares[rank]].clone()

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_rows(grad.contiguous(), ctx.shares, ctx.group), None, None, None


class _GatherShares(torch.autograd.Function):
    """Forward: every TP rank's share of rows all-gathered. Backward: this rank's share of the gradient (the
    layers after it compute the same replicated gradient on every TP rank)."""

    @staticmethod
    def forward(ctx, rows, shares, rank, group):
        ctx.start, ctx.count = sum(shares[:rank]), shares[rank]
        return _all_gather_rows(rows, shares, group)

    @staticmethod
    def backward(ctx, grad):
        return grad[ctx.start:ctx.start + ctx.count], None, None, None


# What megatron's MoE utilities take from Transformer Engine when it is installed (None without it).
TE_MOE_FUNCTIONS = ("fused_compute_score_for_moe_aux_loss", "fused_moe_aux_loss", "fused_permute",
                    "fused_permute_with_probs", "fused_sort_chunks_by_index", "fused_sort_chunks_by_index_with_probs",
                    "fused_topk_with_score_function", "fused_unpermute", "te_general_gemm")


@functools.cache
def tp_split_moe_layer_class():
    """megatron's ``MoELayer`` running, at TP > 1 without sequence parallelism, the routed experts on a share of
    the tokens per TP rank.

    Without sequence parallelism every TP rank holds all tokens; megatron's MoE layer refuses to train so, and
    its dispatcher would send each token once per TP rank (each expert's gradient TP times over). Here the
    ``s * b`` tokens are cut into TP contiguous shares (uneven when TP does not divide them); each rank routes,
    dispatches and runs experts on its share exactly as megatron does for a sequence-parallel share (the
    load-balancing statistics are summed over the TP group as there), then the outputs are all-gathered. The
    shared expert runs on all tokens as the dense TP-split MLP it is. The router's weight gradient is then a
    per-rank partial sum, marked ``TP_PARTIAL_GRAD``. At TP 1 or with sequence parallelism it is megatron's layer.
    """
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.moe.moe_layer import MoELayer

    # megatron-core 0.16.1 imports these from Transformer Engine only when TE is installed and then tests them
    # against None (``te_general_gemm is not None`` in the router's linear), which without TE is a NameError.
    for name in TE_MOE_FUNCTIONS:
        if not hasattr(moe_utils, name):
            setattr(moe_utils, name, None)

    class TPSplitMoELayer(MoELayer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.split_tokens = self.attn_tp_group.size() > 1 and not self.config.sequence_parallel
            if self.split_tokens:
                for param in self.router.parameters():
                    setattr(param, TP_PARTIAL_GRAD, True)

        def forward(self, hidden_states, intermediate_tensors=None, padding_mask=None):
            if not self.split_tokens:
                return super().forward(hidden_states, intermediate_tensors, padding_mask)
            if intermediate_tensors is not None or padding_mask is not None:
                raise ValueError("meshrl's TP-split MoE layer runs the whole layer at once, without a padding mask")
            seq, batch, hidden = hidden_states.shape
            group, rank = self.attn_tp_group, self.attn_tp_group.rank()
            shares = _token_shares(seq * batch, group.size())
            tokens = _TakeShare.apply(hidden_states.reshape(seq * batch, hidden), shares, rank, group)
            tokens = tokens.view(shares[rank], 1, hidden)
            probs, routing_map = self.route(tokens)
            tokens, probs = self.preprocess(tokens, probs, routing_map)
            tokens, probs = self.dispatch(tokens, probs)
            output, bias = self.routed_experts_compute(tokens, probs)
            output = self.postprocess(self.combine(output), None)
            output = _GatherShares.apply(output.reshape(shares[rank], hidden), shares, rank, group)
            output = output.view(seq, batch, hidden)
            shared = self.shared_experts_compute(hidden_states)
            return (output if shared is None else output + shared), bias

    return TPSplitMoELayer


# ``TransformerConfig`` attribute the schedule sets before each pass: 1 / (micro-batches x data-parallel ranks).
MOE_LOSS_SCALE = "meshrl_moe_loss_scale"


@functools.cache
def mean_aux_loss_router_class():
    """megatron's ``TopKRouter`` whose load-balancing loss (``moe_aux_loss_coeff``) and z-loss
    (``moe_z_loss_coeff``) enter training as their mean over the pass's micro-batches and data-parallel ranks:
    each micro-batch's loss ``l`` is attached as ``l * s`` with ``s`` the config's ``MOE_LOSS_SCALE``.

    That is the scaling megatron intends ("1 / (num_micro_batches * dp_size)", router.py) and the one verl gets
    (its schedule scales the aux-loss gradient by 1 / micro-batches, DDP averages over DP). megatron reaches it
    under ``calculate_per_token_loss`` by attaching ``l * tokens`` and dividing every gradient by the pass's
    tokens; meshrl keeps that flag but not the division (its losses come pre-normalised), so here the tokens
    factor is dropped and ``s`` applied instead. ``l`` is megatron's: the switch loss
    ``E * coeff / (k * T^2) * sum_e (sum_t p_te) * n_e`` over the micro-batch's T routed tokens (n_e: tokens
    routed to expert e), and ``coeff * mean_t logsumexp(r_t)^2`` for the z-loss.
    """
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler, z_loss_func
    from megatron.core.transformer.moe.router import TopKRouter

    class MeanAuxLossRouter(TopKRouter):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.calculate_per_token_loss = False  # attach l itself, not l * tokens (see above)

        def _scale(self) -> float:
            scale = getattr(self.config, MOE_LOSS_SCALE, None)
            if scale is None:
                raise RuntimeError("an MoE load-balancing / z-loss needs the pass's scale: run training passes "
                                   "through meshrl.parallel.schedule.forward_backward")
            return scale

        def attach_and_log_load_balancing_loss(self, activation, aux_loss_coeff, aux_loss, *args, **kwargs):
            return super().attach_and_log_load_balancing_loss(activation, aux_loss_coeff, aux_loss * self._scale(),
                                                              *args, **kwargs)

        def apply_z_loss(self, logits, padding_mask=None):
            if self.config.moe_z_loss_coeff is None or not self.training or not torch.is_grad_enabled():
                return logits
            # megatron divides by the TP size: each TP rank's share of the tokens adds its own (TP_PARTIAL_GRAD)
            z_loss = z_loss_func(logits, self.config.moe_z_loss_coeff / self.tp_cp_group.size(), padding_mask)
            return MoEAuxLossAutoScaler.apply(logits, z_loss * self._scale())

    return MeanAuxLossRouter
