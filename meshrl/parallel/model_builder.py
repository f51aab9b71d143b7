"""Build megatron-core ``GPTModel`` chunks (policy or critic) from a Hugging Face config of a registered family.

The family (``meshrl.models.families``) reads the HF config into a ``ModelSpec`` — refusing fields meshrl
would drop — and names the megatron-core options of its structure (``transformer_options``: RMSNorm,
SwiGLU, QKV bias, q/k layernorm; ``layer_spec_options``). This module maps the rest — layers, hidden, FFN,
heads, KV heads (GQA), head_dim (``kv_channels``), vocab, tied embeddings
(``share_embeddings_and_output_weights``), ``rope_theta`` (``rotary_base``), no dropout — and applies the
parallel layout; it knows no family by name.

Layer spec: Transformer Engine's when TE is importable (GPU), else megatron's local spec with
RMSNorm (CPU) whose core attention runs through torch's fused ``scaled_dot_product_attention``. Both
are served by ``meshrl.parallel.hf_conversion``, which knows their name differences.

Precision: fp32 on CPU, bf16 on GPU, unless ``dtype`` says otherwise (``param_dtype`` reads verl's
``megatron.dtype`` names). bf16 parameters train with megatron's mixed precision on CPU as on GPU:
fp32 softmax, fp32 gradient buffers and reduction (``grad_reduce_in_fp32``), fp32 main params and Adam
state in the optimizer, and per-token outputs computed from fp32 logits (``meshrl.parallel.forward``).

A critic is the same transformer with its vocabulary head replaced by ``ValueHead`` (hidden -> 1, with
bias, the layout of HF's ``*ForTokenClassification`` with ``num_labels=1``), never tied.

Gradient scaling contract (see ``meshrl.parallel.schedule``): the config sets
``calculate_per_token_loss=True`` so that megatron's schedule does not divide losses by the number of
micro-batches and DDP sums (rather than averages) gradients over data-parallel ranks; the
``finalize_model_grads_func`` installed here drops the per-token rescaling that flag would otherwise
apply. The total gradient is therefore exactly the gradient of the sum of the losses returned by the
loss function over micro-batches and DP ranks.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import torch
import torch.nn.functional as F

from meshrl.models.families import ModelSpec, layer_spec_options, model_spec, transformer_options
from meshrl.parallel import state

def check_layout(spec: ModelSpec, parallel: state.ParallelConfig) -> None:
    """Raise ``ValueError`` naming the constraint when ``parallel`` cannot shard ``spec``."""
    tp, pp, vpp = parallel.tensor_parallel, parallel.pipeline_parallel, parallel.virtual_pipeline or 1
    problems = []
    if spec.num_attention_heads % tp:
        problems.append(f"TP={tp} does not divide num_attention_heads={spec.num_attention_heads}")
    if spec.num_kv_heads % tp:
        problems.append(f"TP={tp} does not divide num_key_value_heads={spec.num_kv_heads} "
                        "(KV heads are split, not replicated)")
    if spec.num_attention_heads % spec.num_kv_heads:
        problems.append(f"num_key_value_heads={spec.num_kv_heads} does not divide "
                        f"num_attention_heads={spec.num_attention_heads}")
    if spec.ffn_hidden_size % tp:
        problems.append(f"TP={tp} does not divide intermediate_size={spec.ffn_hidden_size}")
    if spec.vocab_size % tp:
        problems.append(f"TP={tp} does not divide vocab_size={spec.vocab_size}; meshrl does not pad the "
                        "vocabulary, because padded logits would change every softmax and log-prob")
    if spec.num_layers % (pp * vpp):
        problems.append(f"PP={pp} x virtual PP={vpp} does not divide num_hidden_layers={spec.num_layers}")
    if parallel.context_parallel != 1:
        problems.append("context parallelism is not supported yet (context_parallel must be 1)")
    if parallel.expert_parallel != 1:
        problems.append(f"expert parallelism needs an MoE model; {spec.model_type} is dense")
    if problems:
        raise ValueError("impossible parallel layout for this model: " + "; ".join(problems))


# ``megatron.dtype`` values: verl's bfloat16, and float32 (meshrl's CPU default). verl's float16 is not
# offered: its dynamic loss scale would have to reach the schedules (``TransformerConfig.grad_scale_func``).
PARAM_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def default_dtype() -> torch.dtype:
    return torch.bfloat16 if torch.cuda.is_available() else torch.float32


def param_dtype(name: str) -> torch.dtype:
    """The parameters' dtype named by a ``megatron.dtype`` key: one of ``PARAM_DTYPES``, or ``auto``
    (:func:`default_dtype`: bf16 with CUDA, fp32 without)."""
    if name == "auto":
        return default_dtype()
    if name not in PARAM_DTYPES:
        raise ValueError(f"megatron dtype {name!r} is not one of auto, {', '.join(PARAM_DTYPES)}")
    return PARAM_DTYPES[name]


def transformer_engine_available() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def packed_sequences(requested: bool) -> bool:
    """Whether micro-batches run as packed THD rows (``use_remove_padding``): as requested, except on CUDA
    without Transformer Engine, where padded rows run instead and a warning says so.

    Packing needs a variable-length attention kernel. TE has one; on CPU ``SDPACoreAttention`` loops
    causal SDPA over the slots, which beats padding there (``bench/packing.py``: 1.77x tokens/s). On an
    H100 without TE the same loop is launch-bound — 128 sequences x 28 layers = 3,584 small SDPA calls, and
    megatron's THD rotary embedding loops per sequence too — so an actor update of a Qwen2.5-1.5B shape ran
    3.6x slower packed than padded (5.54 s vs 1.55 s, ``python -m bench.gpu``, sections rl_step and
    rl_step_padded). Outputs agree either way to rounding; only speed differs.
    """
    if requested and torch.cuda.is_available() and not transformer_engine_available():
        warnings.warn("use_remove_padding=True: running padded micro-batches, because packed sequences on "
                      "CUDA need Transformer Engine's variable-length attention (without it they ran 3.6x "
                      "slower); install transformer-engine to pack", stacklevel=2)
        return False
    return requested


def transformer_config(spec: ModelSpec, parallel: state.ParallelConfig, dtype: torch.dtype,
                       **overrides: Any):
    """megatron ``TransformerConfig`` for ``spec`` at ``parallel``; ``overrides`` win (e.g. recompute)."""
    from megatron.core.transformer import TransformerConfig

    check_layout(spec, parallel)
    kwargs: dict[str, Any] = dict(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        ffn_hidden_size=spec.ffn_hidden_size,
        num_attention_heads=spec.num_attention_heads,
        num_query_groups=spec.num_kv_heads,
        kv_channels=spec.head_dim,
        **transformer_options(spec),
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=parallel.tensor_parallel,
        pipeline_model_parallel_size=parallel.pipeline_parallel,
        virtual_pipeline_model_parallel_size=parallel.virtual_pipeline,
        context_parallel_size=parallel.context_parallel,
        sequence_parallel=False,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        attention_softmax_in_fp32=True,
        use_cpu_initialization=not torch.cuda.is_available(),
        # Weights are loaded right after building, but megatron only marks TP-sharded weights
        # (`tensor_model_parallel`, read by grad-norm and duplicate checks) when it initialises them.
        perform_initialization=True,
        gradient_accumulation_fusion=False,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        cross_entropy_loss_fusion=False,
        # Micro-batches may differ in length; with PP their shapes must travel with them. megatron
        # also insists on the all-to-all dispatcher for variable lengths, even for dense models.
        variable_seq_lengths=parallel.pipeline_parallel > 1,
        moe_token_dispatcher_type="alltoall",
        # Interleaved PP with batched p2p gives wrong gradients at PP=2 (upstream bug).
        batch_p2p_comm=parallel.virtual_pipeline is None,
        overlap_p2p_comm=parallel.virtual_pipeline is not None,
        deallocate_pipeline_outputs=True,
        calculate_per_token_loss=True,
    )
    kwargs.update(overrides)
    if isinstance(kwargs.get("attention_backend"), str):  # verl's configs name the enum member
        from megatron.core.transformer.enums import AttnBackend

        kwargs["attention_backend"] = AttnBackend[kwargs["attention_backend"]]
    return TransformerConfig(**kwargs)


class ValueHead(torch.nn.Module):
    """Critic head: hidden -> 1 scalar per token, replicated on every TP rank.

    Called by ``GPTModel._postprocess`` in place of the vocabulary projection, hence the
    ``(hidden, weight=None, runtime_gather_output=None) -> (out, bias)`` signature.
    """

    def __init__(self, hidden_size: int, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1, hidden_size, dtype=dtype, device=device))
        self.bias = torch.nn.Parameter(torch.zeros(1, dtype=dtype, device=device))
        # megatron's grad-norm and DDP code read this attribute; the head is not TP-sharded.
        for param in (self.weight, self.bias):
            param.tensor_model_parallel = False
        self.sequence_parallel = False

    def forward(self, hidden_states: torch.Tensor, weight: torch.Tensor | None = None,
                runtime_gather_output: bool | None = None) -> tuple[torch.Tensor, None]:
        return F.linear(hidden_states, self.weight, self.bias), None


@functools.cache
def _sdpa_core_attention_class():
    """megatron's local ``DotProductAttention`` computed by ``torch.nn.functional.scaled_dot_product_attention``.

    The local class materialises GQA-expanded keys/values and the ``[b, heads, s, s]`` scores and
    probabilities (kept for backward); torch's fused kernel does neither, which on CPU makes the
    attention ~15x faster and saves ~1.5 GiB of activations for SmolLM2 at 8x256 tokens. Serves the plain
    causal case (``[s, b, heads, d]``, no mask) and packed THD sequences (``[t, heads, d]`` with
    ``PackedSeqParams``, which the local class refuses): causal attention inside each slot of
    ``cu_seqlens_q_padded``, never across slots. Anything else falls back to megatron.
    """
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    class SDPACoreAttention(DotProductAttention):
        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None):
            mask_type = attn_mask_type or self.attn_mask_type
            if (attention_mask is not None or attention_bias is not None
                    or (packed_seq_params is not None and packed_seq_params.qkv_format != "thd")
                    or mask_type != AttnMaskType.causal or self.softmax_offset is not None
                    or self.scale_mask_softmax.window_size is not None or self.attention_dropout.p > 0):
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
            """Causal SDPA on ``[..., heads, s, d]`` (GQA: fewer key/value heads)."""
            return F.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=self.softmax_scale,
                enable_gqa=self.num_attention_heads_per_partition != self.num_query_groups_per_partition)

    return SDPACoreAttention


def _layer_spec(use_te: bool, model: ModelSpec):
    """Transformer Engine's spec, or megatron's local spec (RMSNorm) with SDPA core attention; both with the
    family's layer options (q/k layernorm)."""
    from megatron.core.models.gpt.gpt_layer_specs import (get_gpt_layer_local_spec,
                                                          get_gpt_layer_with_transformer_engine_spec)

    if use_te:
        return get_gpt_layer_with_transformer_engine_spec(**layer_spec_options(model))
    spec = get_gpt_layer_local_spec(normalization="RMSNorm", **layer_spec_options(model))
    spec.submodules.self_attention.submodules.core_attention = _sdpa_core_attention_class()
    return spec


def _finalize_model_grads(model, num_tokens=None, pg_collection=None, force_all_reduce=False):
    """megatron's grad finalisation (DP reduction, tied-embedding sync) without per-token rescaling."""
    from megatron.core.distributed import finalize_model_grads

    return finalize_model_grads(model, None, pg_collection=pg_collection, force_all_reduce=force_all_reduce)


def _gpt_chunks(hf_config, critic: bool, dtype: torch.dtype, config_overrides: dict[str, Any]):
    """This rank's bare ``GPTModel`` chunks (one per virtual pipeline stage) on the device, and their config."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core import parallel_state

    parallel = state.current()
    spec = model_spec(hf_config)
    config = transformer_config(spec, parallel, dtype, **config_overrides)
    use_te = transformer_engine_available()
    layer_spec = _layer_spec(use_te, spec)
    if "attention_backend" in config_overrides and not use_te:
        # Said, not silently dropped: only Transformer Engine's attention chooses among backends.
        warnings.warn(f"attention_backend={config_overrides['attention_backend']} selects a Transformer Engine "
                      "attention kernel; without Transformer Engine this run's attention is torch SDPA", stacklevel=2)
    vpp = parallel.virtual_pipeline
    chunks = []
    for vp_stage in range(vpp or 1):
        stage = vp_stage if vpp else None
        pre = parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage)
        post = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage)
        model = GPTModel(
            config=config,
            transformer_layer_spec=layer_spec,
            vocab_size=spec.vocab_size,
            max_sequence_length=spec.max_position_embeddings,
            pre_process=pre,
            post_process=post,
            parallel_output=True,
            share_embeddings_and_output_weights=spec.tie_word_embeddings and not critic,
            position_embedding_type="rope",
            rotary_base=spec.rope_theta,
            vp_stage=stage,
        )
        if critic and post:
            device = next(model.parameters()).device
            # Replaces the vocabulary projection GPTModel allocated (transiently) on the last stage.
            model.output_layer = ValueHead(spec.hidden_size, dtype, device)
        # megatron's local spec builds torch norms without a dtype: fp32 weights in a bf16 model, on which
        # torch's RMSNorm skips its fused kernel. TE's norms and HF's bf16 models hold the model's dtype.
        for module in model.modules():
            if isinstance(module, torch.nn.RMSNorm):
                module.to(dtype)
        model.meshrl_critic = critic
        model.meshrl_spec = spec
        model.meshrl_uses_te = use_te
        chunks.append(model)
    if torch.cuda.is_available():
        for model in chunks:
            model.cuda(torch.cuda.current_device())
    return chunks, config


def build_model(hf_config, *, critic: bool = False, dtype: torch.dtype | None = None,
                use_distributed_optimizer: bool = False, overlap_grad_reduce: bool = False,
                **config_overrides: Any) -> list[torch.nn.Module]:
    """This rank's trainable model chunks (one per virtual pipeline stage), wrapped in megatron DDP.

    Parameters hold megatron's random initialisation until weights are loaded with
    ``hf_conversion.load_hf_weights`` or ``checkpoint.load_checkpoint``. ``use_distributed_optimizer``
    must match the optimizer built later; ``config_overrides`` go to ``TransformerConfig`` (e.g.
    ``recompute_granularity="full"``). Needs ``state.initialize`` first.
    """
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    dtype = dtype or default_dtype()
    chunks, config = _gpt_chunks(hf_config, critic, dtype, config_overrides)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=dtype != torch.float32,
        overlap_grad_reduce=overlap_grad_reduce,
        use_distributed_optimizer=use_distributed_optimizer,
        check_for_nan_in_grad=False,
    )
    wrapped = [
        # As Megatron-LM does: only the first chunk's buffers are bucketed for overlapped reduction.
        DistributedDataParallel(config=config, ddp_config=ddp_config, module=model, disable_bucketing=index > 0)
        for index, model in enumerate(chunks)
    ]
    config.finalize_model_grads_func = _finalize_model_grads
    config.no_sync_func = [chunk.no_sync for chunk in wrapped] if len(wrapped) > 1 else wrapped[0].no_sync
    if overlap_grad_reduce:
        config.grad_sync_func = ([chunk.start_grad_sync for chunk in wrapped] if len(wrapped) > 1
                                 else wrapped[0].start_grad_sync)
    return wrapped


def build_forward_only_model(hf_config, *, dtype: torch.dtype | None = None,
                             **config_overrides: Any) -> list[torch.nn.Module]:
    """This rank's chunks of a model that is never trained, only run by ``schedule.forward_only``.

    The same ``GPTModel`` chunks as ``build_model`` in the same layout (same weight loaders, same
    outputs bit for bit), in eval mode, but not wrapped in megatron DDP: no gradient buffer, which
    would hold 4 bytes per parameter. They must not be given to ``schedule.forward_backward`` or to an
    optimizer. Needs ``state.initialize`` first.

    Parameters keep ``requires_grad=True``: ``forward_only`` runs under ``torch.no_grad`` so no
    gradient is ever stored, and freezing them would change the outputs. ATen's ``matmul`` folds a
    ``[s, b, h]`` input into one GEMM whenever the weight requires grad, but for a frozen weight only
    when the input's strides allow a view, else it runs a batched GEMM with another summation order:
    at TP=2 a frozen copy's log-probs differed from the trainable model's by 1e-6 (entropies by 4e-6).
    """
    chunks, _ = _gpt_chunks(hf_config, False, dtype or default_dtype(), config_overrides)
    for chunk in chunks:
        chunk.eval()
    return chunks


def unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    """The ``GPTModel`` inside a DDP (or other) wrapper."""
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def model_config(chunks: list[torch.nn.Module]):
    """The shared ``TransformerConfig`` of ``chunks``."""
    return unwrap(chunks[0]).config
