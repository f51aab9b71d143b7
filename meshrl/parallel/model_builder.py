"""Build megatron-core ``GPTModel`` chunks (policy or critic) from a Hugging Face config of a registered family.

The family (``meshrl.models.families``) reads the HF config into a ``ModelSpec`` — refusing fields meshrl
would drop — and names the megatron-core options of its structure (``transformer_options``: RMSNorm,
SwiGLU, QKV bias, q/k layernorm; ``layer_spec_options``). This module maps the rest — layers, hidden, FFN,
heads, KV heads (GQA), head_dim (``kv_channels``), vocab, tied embeddings
(``share_embeddings_and_output_weights``), ``rope_theta`` (``rotary_base``), no dropout — and applies the
parallel layout; it knows no family by name.

Layer spec: Transformer Engine's when TE is importable (GPU), else megatron's local spec with
RMSNorm (CPU) whose core attention runs through torch's fused ``scaled_dot_product_attention``. Both
are served by ``meshrl.parallel.hf_conversion``, which knows their name differences. What a family needs
beyond megatron-core's options (Gemma's zero-centred norms on the local spec, post norms, soft-capping,
embedding scaling, local RoPE base) comes from ``meshrl.parallel.layers``; on the TE spec those additions
are built from TE's own norm but have not run here (TE cannot be installed on these machines).

Precision: fp32 on CPU, bf16 on GPU, unless ``dtype`` says otherwise (``param_dtype`` reads verl's
``megatron.dtype`` names). bf16 parameters train with megatron's mixed precision on CPU as on GPU:
fp32 softmax, fp32 gradient buffers and reduction (``grad_reduce_in_fp32``), fp32 main params and Adam
state in the optimizer, and per-token outputs computed from fp32 logits (``meshrl.parallel.forward``).

Sequence parallelism (``sequence_parallel``, verl's ``megatron.sequence_parallel``; off at TP 1, as verl does):
megatron's own, splitting the activations outside attention and MLP along the sequence over the TP ranks.
On the local spec every norm is then ``layers.RMSNorm``, which marks its weight for megatron's sum of its
gradient over TP; the schedule pads row micro-batches to a multiple of TP (packed ones always are) and
gathers the sequence before the output layer (``meshrl.parallel.schedule``).

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
import importlib.util
import math
import warnings
from typing import Any

import torch
import torch.nn.functional as F

from meshrl.config.key_policy import FUSED_KERNEL_SWITCHES, MOE_EXPERT_LAYER
from meshrl.config.refusals import Checked, refusal
from meshrl.models.families import ModelSpec, layer_spec_options, model_spec, transformer_options
from meshrl.parallel import layers, state, vision_language

def check_layout(spec: ModelSpec, parallel: state.ParallelConfig) -> None:
    """Raise ``ValueError`` naming each constraint ``parallel`` breaks when it cannot shard ``spec``
    (``layout_problems``)."""
    if problems := layout_problems(spec, parallel):
        raise ValueError("impossible parallel layout for this model: " + "; ".join(why for _, why in problems))


@refusal("model", "actor_rollout_ref.actor.megatron", "critic.megatron")
def layouts_shard_the_model(c: Checked) -> list[str]:
    """The policy's (and the critic's) parallel layout must shard the model: ``layout_problems``, each naming the
    megatron key it concerns. (The learned reward model's is checked with its own model: ``reward_model_problems``.)"""
    spec = model_spec(c.hf_config)
    roles = [("actor_rollout_ref.actor.megatron", c.plan.actor_layout)]
    if c.plan.use_critic:
        roles.append(("critic.megatron", c.plan.critic_layout))
    return [line for section, layout in roles for line in layout_problem_lines(spec, layout, section)]


def layout_problem_lines(spec: ModelSpec, layout, section: str) -> list[str]:
    """``layout_problems`` of a run plan's ``layout`` (``ParallelLayout``) as ``<section>.<key>: why`` lines;
    ``section``: the role's ``megatron`` section (``critic.megatron``)."""
    return [f"{section}.{key}: {why}" for key, why in layout_problems(spec, state.ParallelConfig.from_layout(layout))]


def layout_problems(spec: ModelSpec, parallel: state.ParallelConfig) -> list[tuple[str, str]]:
    """(the ``megatron`` key, why) of each constraint ``parallel`` breaks when sharding ``spec``."""
    tp, pp, vpp = parallel.tensor_parallel, parallel.pipeline_parallel, parallel.virtual_pipeline or 1
    tp_key, problems = "tensor_model_parallel_size", []
    if spec.num_attention_heads % tp:
        problems.append((tp_key, f"TP={tp} does not divide num_attention_heads={spec.num_attention_heads}"))
    if spec.num_kv_heads % tp:
        problems.append((tp_key, f"TP={tp} does not divide num_key_value_heads={spec.num_kv_heads} "
                                 "(KV heads are split, not replicated)"))
    if spec.num_attention_heads % spec.num_kv_heads:
        problems.append((tp_key, f"num_key_value_heads={spec.num_kv_heads} does not divide "
                                 f"num_attention_heads={spec.num_attention_heads}"))
    if spec.ffn_hidden_size % tp:
        problems.append((tp_key, f"TP={tp} does not divide intermediate_size={spec.ffn_hidden_size}"))
    if spec.vocab_size % tp:
        problems.append((tp_key, f"TP={tp} does not divide vocab_size={spec.vocab_size}; meshrl does not pad the "
                                 "vocabulary, because padded logits would change every softmax and log-prob"))
    if spec.num_layers % (pp * vpp):
        problems.append(("pipeline_model_parallel_size",
                         f"PP={pp} x virtual PP={vpp} does not divide num_hidden_layers={spec.num_layers}"))
    elif spec.deepstack_layers > spec.num_layers // (pp * vpp):
        # the features come from the tower, which runs on the first stage's first chunk only (vision_language)
        problems.append(("pipeline_model_parallel_size",
                         f"PP={pp} x virtual PP={vpp} gives the first stage's first chunk "
                         f"{spec.num_layers // (pp * vpp)} of the {spec.num_layers} decoder layers, but the vision "
                         f"tower's deepstack features are added after layers 0..{spec.deepstack_layers - 1}, which "
                         "must run there with the tower: choose PP x virtual PP of at most "
                         f"{spec.num_layers // spec.deepstack_layers}"))
    if parallel.context_parallel > 1:
        for what, has in (("a mixture-of-experts model (its routers' load-balancing statistics would be per sequence "
                           "chunk)", spec.moe), ("multi-latent attention (its rotary split is its own)", spec.mla),
                          ("a vision-language model (its image features are scattered by position in the whole "
                           "sequence)", spec.vision)):
            if has:
                problems.append(("context_parallel_size", f"CP={parallel.context_parallel} on {what} is not built "
                                 "yet: set 1, and raise TP or shorten the token budget to fit long sequences"))
    etp = parallel.expert_tensor_parallel_size
    if not spec.moe and (parallel.expert_parallel != 1 or etp != tp):
        problems.append(("expert_model_parallel_size", f"expert parallelism needs an MoE model; {spec.model_type} is "
                         "dense (leave expert_model_parallel_size at 1 and expert_tensor_parallel_size unset)"))
    if spec.moe:
        if spec.num_experts % parallel.expert_parallel:
            problems.append(("expert_model_parallel_size",
                             f"EP={parallel.expert_parallel} does not divide num_experts={spec.num_experts}"))
        if spec.moe_ffn_hidden_size % etp:
            problems.append(("expert_tensor_parallel_size", f"expert TP={etp} does not divide the experts' "
                                                            f"intermediate size {spec.moe_ffn_hidden_size}"))
        if spec.shared_expert_ffn_hidden_size and spec.shared_expert_ffn_hidden_size % tp:
            problems.append((tp_key, f"TP={tp} does not divide shared_expert_intermediate_size="
                                     f"{spec.shared_expert_ffn_hidden_size}"))
    if spec.mla:  # megatron's local MLA splits the down projections' rows over TP too
        if (spec.kv_lora_rank + spec.qk_rope_head_dim) % tp:
            problems.append((tp_key, f"TP={tp} does not divide kv_lora_rank + qk_rope_head_dim = "
                                     f"{spec.kv_lora_rank + spec.qk_rope_head_dim}"))
        if spec.q_lora_rank and spec.q_lora_rank % tp:
            problems.append((tp_key, f"TP={tp} does not divide q_lora_rank={spec.q_lora_rank}"))
    return problems


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


# TransformerConfig switches that select Transformer Engine's fused CUDA kernels (verl's scripts set them through
# override_transformer_config): moe_permute_fusion (the MoE token permutation), apply_rope_fusion (RoPE),
# persist_layer_norm (the norms; megatron's torch norm refuses it) and gradient_accumulation_fusion (the weight
# gradients accumulated in place; megatron's local linear layers need Apex's CUDA extension for it). Honoured
# where those kernels run: CUDA with a Transformer Engine that has them (megatron's own test: its imports of them
# are not None). Elsewhere megatron would refuse to build; the same computation runs unfused instead, and the run
# plan says so in one start-up note (``meshrl.config.validate``; ``fused_kernel_switches_off`` here). The switches:
# ``meshrl.config.key_policy.FUSED_KERNEL_SWITCHES``.


def fused_kernels_run(switch: str) -> bool:
    """Whether ``switch`` (one of ``FUSED_KERNEL_SWITCHES``) has its kernels in this process."""
    if not transformer_engine_available():
        return False
    if switch == "moe_permute_fusion":
        from megatron.core.transformer.moe import moe_utils

        return all(getattr(moe_utils, name, None) is not None for name in (
            "fused_permute", "fused_permute_with_probs", "fused_sort_chunks_by_index",
            "fused_sort_chunks_by_index_with_probs", "fused_unpermute"))
    if switch == "apply_rope_fusion":
        from megatron.core.models.common.embeddings import rope_utils

        return (rope_utils.fused_apply_rotary_pos_emb is not None
                or rope_utils.fused_apply_rotary_pos_emb_thd is not None)
    if switch in ("persist_layer_norm", "gradient_accumulation_fusion"):
        return True  # with Transformer Engine the layers are its own (model_builder._layer_spec), which take them
    raise ValueError(f"not a fused-kernel switch: {switch}")


def fused_kernel_switches_off(settings: dict[str, Any]) -> list[str]:
    """The ``FUSED_KERNEL_SWITCHES`` turned on in ``settings`` whose kernels this process lacks: each is set False
    in ``settings``. Said once at start-up by the driver (``trainer.device=cpu`` or no transformer_engine); a
    process that finds the kernels missing although transformer_engine is installed warns here too."""
    off = [key for key in FUSED_KERNEL_SWITCHES if settings.get(key) and not fused_kernels_run(key)]
    for key in off:
        settings[key] = False
    if off and importlib.util.find_spec("transformer_engine") is not None:
        warnings.warn(f"{', '.join(f'{key}=True' for key in off)}: off in this process (its Transformer Engine "
                      f"kernels need CUDA and a Transformer Engine that has them); computed unfused", stacklevel=3)
    return off


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
    from megatron.core.transformer import MLATransformerConfig, TransformerConfig

    check_layout(spec, parallel)
    kwargs: dict[str, Any] = dict(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        ffn_hidden_size=spec.ffn_hidden_size,
        num_attention_heads=spec.num_attention_heads,
        num_query_groups=spec.num_kv_heads,
        # an MLA head's attention output is v_head_dim wide (megatron's local core attention sizes it by this)
        kv_channels=spec.v_head_dim if spec.mla else spec.head_dim,
        **transformer_options(spec),
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=parallel.tensor_parallel,
        expert_model_parallel_size=parallel.expert_parallel,
        expert_tensor_parallel_size=parallel.expert_tensor_parallel_size,
        pipeline_model_parallel_size=parallel.pipeline_parallel,
        virtual_pipeline_model_parallel_size=parallel.virtual_pipeline,
        context_parallel_size=parallel.context_parallel,
        sequence_parallel=False,  # an override (megatron.sequence_parallel) turns it on; see below for TP 1
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
    dropped = sorted(key for key in overrides if key.startswith("moe_"))
    if dropped and not spec.moe:
        raise ValueError(f"{', '.join(dropped)}: mixture-of-experts settings, but {spec.model_type} is dense; "
                         "drop them")
    if "moe_router_bias_update_rate" in overrides and not spec.moe_expert_bias:
        raise ValueError(f"moe_router_bias_update_rate: {spec.model_type}'s router has no expert bias to move "
                         "(DeepSeek-V3's e_score_correction_bias); drop it")
    if spec.moe:
        # verl's default: no load-balancing loss in RL (it hurts there); override_transformer_config's
        # moe_router_load_balancing_type / moe_aux_loss_coeff / moe_z_loss_coeff turn it on.
        kwargs.update(moe_router_load_balancing_type="none")
    kwargs.update(overrides)
    if spec.moe:  # how meshrl's expert layer computes (key_policy.MOE_EXPERT_LAYER: speed only; the run notes it)
        kwargs.update(MOE_EXPERT_LAYER)
    fused_kernel_switches_off(kwargs)
    if kwargs["sequence_parallel"] and parallel.tensor_parallel == 1:
        # verl's Megatron engine turns it off at TP 1 with a warning (megatron would refuse it): there is no
        # TP group to split the sequence over, and the numbers are the same either way.
        warnings.warn("sequence_parallel=True at tensor_model_parallel_size=1: off, as in verl (it splits "
                      "activations over TP ranks)", stacklevel=2)
        kwargs["sequence_parallel"] = False
    if spec.deepstack_layers and kwargs.get("recompute_granularity") == "full" and \
            kwargs.get("recompute_method") != "uniform":
        # the deepstack layers' recompute takes their features as checkpoint arguments in megatron's uniform loop only
        # (vision_language.recompute_deepstack_layers)
        raise ValueError(f"recompute_method={kwargs.get('recompute_method')} with Qwen3-VL's deepstack features is not "
                         "built in meshrl; use recompute_method=uniform (model.enable_gradient_checkpointing's)")
    if spec.mla and kwargs["sequence_parallel"]:
        raise ValueError("sequence_parallel with multi-latent attention is not built in meshrl (megatron's local MLA "
                         "and meshrl's TP fix of its RoPE-key gradient are checked without it); set "
                         "megatron.sequence_parallel=False")
    if isinstance(kwargs.get("attention_backend"), str):  # verl's configs name the enum member
        from megatron.core.transformer.enums import AttnBackend

        kwargs["attention_backend"] = AttnBackend[kwargs["attention_backend"]]
    return (MLATransformerConfig if spec.mla else TransformerConfig)(**kwargs)


class ValueHead(torch.nn.Module):
    """Critic head: hidden -> 1 scalar per token, replicated on every TP rank.

    Called by ``GPTModel._postprocess`` in place of the vocabulary projection, hence the
    ``(hidden, weight=None, runtime_gather_output=None) -> (out, bias)`` signature. It takes the full
    sequence: under sequence parallelism the schedule gathers the TP ranks' shards before it
    (``schedule._output_layer_on``), so its weight gradient is whole on every rank (never summed over TP).
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


def _layer_spec(use_te: bool, model: ModelSpec, sequence_parallel: bool = False, moe: bool | None = None):
    """Transformer Engine's spec, or megatron's local spec (RMSNorm) with SDPA core attention; both with the
    family's layer options (q/k layernorm) and ``meshrl.parallel.layers``' additions for what megatron-core
    lacks: local norms that are zero-centred or sequence-parallel (``layers.RMSNorm``), post-attention /
    post-MLP norms, attention logit soft-capping (TE's attention has none: such layers run meshrl's SDPA
    attention on any device), the windowed layers' RoPE base, multi-latent attention whose shared RoPE key's
    gradient is summed over TP (``layers.mla_self_attention_class``). ``moe``: whether the layer's MLP is the
    mixture of experts (None: the model's; False for the ``dense_layers`` of an MoE model)."""
    from megatron.core.models.gpt.gpt_layer_specs import (get_gpt_layer_local_spec,
                                                          get_gpt_layer_with_transformer_engine_spec)
    from megatron.core.transformer.spec_utils import ModuleSpec

    moe = model.moe if moe is None else moe  # False: the dense layers of an MoE model (``dense_layers``)
    options = {key: value for key, value in layer_spec_options(model).items() if moe or key != "num_experts"}
    if use_te:
        from megatron.core.extensions.transformer_engine import TENorm

        if model.mla:  # TE's MLA spec replicates the down projections, which meshrl's conversion splits over TP
            raise ValueError("multi-latent attention runs on megatron's local layer spec only (meshrl's HF conversion "
                             "has not been built for Transformer Engine's MLA layout); uninstall transformer-engine")
        spec, norm = get_gpt_layer_with_transformer_engine_spec(**options), TENorm
    else:
        if model.mla:
            layers.local_mla_without_transformer_engine()
        spec, norm = get_gpt_layer_local_spec(normalization="RMSNorm", **options), layers.RMSNorm
        spec.submodules.self_attention.submodules.core_attention = layers.sdpa_core_attention_class()
        if model.mla:  # the RoPE key's gradient summed over TP (megatron's local MLA drops other ranks' shares)
            spec.submodules.self_attention.module = layers.mla_self_attention_class()
        # megatron's local torch norm refuses layernorm_zero_centered_gamma and sequence_parallel
        if _local_norms_replaced(model, sequence_parallel):
            spec.submodules.input_layernorm = spec.submodules.pre_mlp_layernorm = norm
            if model.qk_norm:
                spec.submodules.self_attention.submodules.q_layernorm = norm
                spec.submodules.self_attention.submodules.k_layernorm = norm
    if moe:  # routed per TP rank's share of the tokens: its sequence shard, or with TP > 1 alone its share
        spec.submodules.mlp.module = layers.tp_split_moe_layer_class()
        spec.submodules.mlp.submodules.router = layers.mean_aux_loss_router_class()
    attention = spec.submodules.self_attention
    if model.attn_logit_softcap is not None:
        attention.submodules.core_attention = ModuleSpec(module=layers.sdpa_core_attention_class(),
                                                         params={"logit_softcap": model.attn_logit_softcap})
    if model.post_norms:
        attention.submodules.linear_proj = layers.post_normed(attention.submodules.linear_proj, norm)
        mlp = spec.submodules.mlp.submodules
        mlp.linear_fc2 = layers.post_normed(mlp.linear_fc2, norm)
    if model.local_rope_theta is not None and model.local_rope_theta != model.rope_theta:
        attention.module = layers.local_rope_self_attention_class()
        attention.params = {**attention.params, "local_rope_theta": model.local_rope_theta}
    return spec


def _local_norms_replaced(model: ModelSpec, sequence_parallel: bool) -> bool:
    """Whether the local spec's norms are ``layers.RMSNorm`` instead of megatron's torch norm, which asserts
    both zero-centred gammas and sequence parallelism off."""
    return model.zero_centered_norms or sequence_parallel


def _decoder_spec(layer_spec, use_te: bool, model: ModelSpec, config, vp_stage: int | None, dense_spec=None):
    """What GPTModel builds its decoder from: the layer spec (megatron adds its final norm), or, when the local
    spec's norms are replaced (``_local_norms_replaced``), the block of this stage's layers with
    ``layers.RMSNorm`` as the final norm (megatron's would refuse the option)."""
    if dense_spec is not None:
        return _with_dense_layers(layer_spec, dense_spec, use_te, model, config, vp_stage)
    if use_te or not _local_norms_replaced(model, config.sequence_parallel):
        return layer_spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    return TransformerBlockSubmodules(layer_specs=[layer_spec] * get_num_layers_to_build(config, vp_stage),
                                      layer_norm=layers.RMSNorm)


def _with_dense_layers(moe_spec, dense_spec, use_te: bool, model: ModelSpec, config, vp_stage: int | None):
    """The block of this stage's layers of an MoE model whose first ``dense_layers`` layers have the dense MLP (the
    ``moe_layer_freq`` pattern megatron's own block spec reads), with TE's or ``layers.RMSNorm`` as the final norm."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    first, count = get_transformer_layer_offset(config, vp_stage), get_num_layers_to_build(config, vp_stage)
    specs = [moe_spec if model.moe_layer(i) else dense_spec for i in range(first, first + count)]
    if use_te:
        from megatron.core.extensions.transformer_engine import TENorm

        return TransformerBlockSubmodules(layer_specs=specs, layer_norm=TENorm)
    return TransformerBlockSubmodules(layer_specs=specs, layer_norm=layers.RMSNorm)


def _finalize_model_grads(model, num_tokens=None, pg_collection=None, force_all_reduce=False):
    """megatron's grad finalisation (DP reduction, tied-embedding sync; under sequence parallelism the sum over
    TP ranks of the replicated parameters marked ``sequence_parallel``: norms and MoE routers, which see one
    sequence shard per rank) without per-token rescaling, then the sum over TP ranks of the gradients each TP
    rank computed from its share of the tokens only (``layers.TP_PARTIAL_GRAD``: the MoE routers at TP > 1
    without sequence parallelism), and over expert-TP ranks of those marked ``layers.ETP_PARTIAL_GRAD`` (routed
    experts' LoRA factors)."""
    from megatron.core import parallel_state
    from megatron.core.distributed import finalize_model_grads

    finalize_model_grads(model, None, pg_collection=pg_collection, force_all_reduce=force_all_reduce)
    for marker, size, group in (
            (layers.TP_PARTIAL_GRAD, parallel_state.get_tensor_model_parallel_world_size(),
             parallel_state.get_tensor_model_parallel_group),
            (layers.ETP_PARTIAL_GRAD, parallel_state.get_expert_tensor_parallel_world_size(),
             parallel_state.get_expert_tensor_parallel_group)):
        if size > 1:
            for grad in [param.main_grad for chunk in model for param in chunk.parameters()
                         if param.requires_grad and getattr(param, marker, False)]:  # a frozen router has none
                torch.distributed.all_reduce(grad, group=group())


def _gpt_chunks(hf_config, critic: bool, dtype: torch.dtype, config_overrides: dict[str, Any],
                freeze_vision_tower: bool = False):
    """This rank's bare ``GPTModel`` chunks (one per virtual pipeline stage) on the device, and their config."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core import parallel_state

    parallel = state.current()
    spec = model_spec(hf_config)
    config = transformer_config(spec, parallel, dtype, **config_overrides)
    use_te = transformer_engine_available()
    layer_spec = _layer_spec(use_te, spec, config.sequence_parallel)
    dense_spec = _layer_spec(use_te, spec, config.sequence_parallel, moe=False) if spec.dense_layers else None
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
            transformer_layer_spec=_decoder_spec(layer_spec, use_te, spec, config, stage, dense_spec),
            vocab_size=spec.vocab_size,
            max_sequence_length=spec.max_position_embeddings,
            pre_process=pre,
            post_process=post,
            parallel_output=True,
            share_embeddings_and_output_weights=spec.tie_word_embeddings and not critic,
            position_embedding_type="mrope" if spec.mrope_section else "rope",
            rotary_base=spec.rope_theta,
            rotary_percent=spec.rotary_fraction,
            vp_stage=stage,
        )
        if spec.mrope_interleaved:  # Qwen3-VL's T / H / W frequencies interleaved, not megatron's sections
            model.rotary_pos_emb = layers.interleaved_mrope_class()(
                kv_channels=config.kv_channels, rotary_percent=spec.rotary_fraction, rotary_base=spec.rope_theta)
        if critic and post:
            device = next(model.parameters()).device
            # Replaces the vocabulary projection GPTModel allocated (transiently) on the last stage.
            model.output_layer = ValueHead(spec.hidden_size, dtype, device)
        elif post and spec.final_logit_softcap is not None:
            model.output_layer.register_forward_hook(
                functools.partial(layers.softcap_logits, cap=spec.final_logit_softcap))
        if pre and spec.vision:
            vision_language.attach_vision_tower(model, hf_config, dtype, config.sequence_parallel)
            if spec.deepstack_layers and config.recompute_granularity == "full":
                vision_language.recompute_deepstack_layers(model)
            # verl's actor.freeze_vision_tower: no gradient, so no DDP buffer or optimizer state for the tower
            model.vision_tower.requires_grad_(not freeze_vision_tower)
        if pre and spec.embedding_scale:
            model.embedding.register_forward_hook(
                functools.partial(layers.scale_embeddings, factor=math.sqrt(spec.hidden_size)))
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
                freeze_vision_tower: bool = False, **config_overrides: Any) -> list[torch.nn.Module]:
    """This rank's trainable model chunks (one per virtual pipeline stage), wrapped in megatron DDP.

    Parameters hold megatron's random initialisation until weights are loaded with
    ``hf_conversion.load_hf_weights`` or ``checkpoint.load_checkpoint``. ``use_distributed_optimizer``
    must match the optimizer built later; ``freeze_vision_tower`` leaves a vision-language model's tower untrained
    (verl's ``actor.freeze_vision_tower``); ``config_overrides`` go to ``TransformerConfig`` (e.g.
    ``recompute_granularity="full"``). Needs ``state.initialize`` first.
    """
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    dtype = dtype or default_dtype()
    chunks, config = _gpt_chunks(hf_config, critic, dtype, config_overrides, freeze_vision_tower)
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


def build_forward_only_model(hf_config, *, critic: bool = False, dtype: torch.dtype | None = None,
                             **config_overrides: Any) -> list[torch.nn.Module]:
    """This rank's chunks of a model that is never trained, only run by ``schedule.forward_only`` (the
    reference policy; with ``critic`` the value-head structure, for a reward model).

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
    chunks, _ = _gpt_chunks(hf_config, critic, dtype or default_dtype(), config_overrides)
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


def shared_prompts_unsupported(chunks: list[torch.nn.Module]) -> str | None:
    """Why the model chunks (megatron GPTModels, wrapped or not) cannot run the shared-prompt layout
    (``meshrl.parallel.shared_prefix``), or None: it
    needs meshrl's SDPA core attention in every layer (Transformer Engine's takes no prefix spans), rotary
    positions applied by megatron from the model's tables (not multi-latent attention's), and no context
    parallelism."""
    sdpa = layers.sdpa_core_attention_class()
    for chunk in chunks:
        model = unwrap(chunk)
        if getattr(model, "position_embedding_type", None) != "rope":
            return f"the model's positions are {getattr(model, 'position_embedding_type', None)!r}, not plain rope"
        if model.config.context_parallel_size > 1:
            return "context parallelism splits each sequence itself"
        if model.config.multi_latent_attention:
            return "multi-latent attention applies its rotary positions itself"
        for name, module in model.named_modules():
            core = getattr(module, "core_attention", None)
            if core is not None and not isinstance(core, sdpa):
                return f"{name}'s attention is {type(core).__name__}, which takes no shared prompt"
    return None
