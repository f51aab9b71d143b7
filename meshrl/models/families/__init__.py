"""Model families: what meshrl knows of each Hugging Face decoder architecture, one small file per family.

A family (``Family``, one ``FAMILY`` constant per module here) says, as data:

- how its HF config reads into meshrl's ``ModelSpec``, and which config fields meshrl refuses because it
  would otherwise drop them silently (``Refusal``; the ones every family shares are ``COMMON_REFUSALS``);
- its structural features, each a megatron-core option where one exists: QKV bias (``add_qkv_bias``),
  per-head RMSNorm of queries and keys before RoPE (``qk_layernorm``), zero-centred norm gammas
  (``layernorm_zero_centered_gamma``), GeGLU (``activation_func`` tanh-GELU, ``gated_linear_unit``), the
  softmax scale (``softmax_scale``) and sliding-window layers (``window_size``, ``window_attn_skip_freq``) —
  ``transformer_options`` / ``layer_spec_options``; and the ones megatron-core 0.16.1 lacks, built by
  ``meshrl.parallel.layers`` from the spec: embedding scaling, post-attention / post-MLP norms, attention
  and final logit soft-capping, the sliding layers' own RoPE base;
- its transformers classes (``{hf_prefix}Config`` / ``ForCausalLM`` / ``ForTokenClassification``: the
  policy and the critic, whose value head is HF's ``score`` with ``num_labels=1``);
- the shape of its tiny random test model (``tiny_shape``, ``tiny_config``; built by ``meshrl.models.tiny``).

The HF <-> megatron tensor mapping is one table, ``hf_layout(spec, critic)``, built from the spec's features,
so a family made of existing features needs no mapping code. ``meshrl.parallel`` applies TP / PP to whatever
this table describes; it knows no family by name.

Adding a family: a new module with ``FAMILY = Family(...)`` and one line in ``FAMILY_MODULES``. A family
whose structure needs something no feature here describes (Gemma's embedding scaling and soft-capping, extra
norms, sliding-window layouts, fused HF tensors) needs that feature added to ``ModelSpec``, ``hf_layout`` and
the megatron options first (Gemma's did: ``ModelSpec``'s fields after ``qk_norm``).
"""

from __future__ import annotations

import importlib
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable

# model_type -> module of this package holding its ``FAMILY``: the registry, one line per family.
FAMILY_MODULES = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "mistral": "mistral",
    "gemma": "gemma",
    "gemma2": "gemma2",
    "gemma3_text": "gemma3",
    "qwen2_moe": "qwen2_moe",
    "qwen3_moe": "qwen3_moe",
    "mixtral": "mixtral",
    "phi3": "phi3",
    "glm4": "glm4",
    "deepseek_v3": "deepseek_v3",
}


@dataclass(frozen=True)
class ModelSpec:
    """The architecture facts meshrl reads from an HF config (compared field by field on conversion and
    stored in checkpoints; the fields from ``qk_norm`` on default to Llama's structure so checkpoints
    written before they existed load).

    - ``activation``: the gated MLP's activation, ``silu`` (SwiGLU) or ``gelu_tanh`` (GeGLU, HF's
      ``gelu_pytorch_tanh``).
    - ``zero_centered_norms``: every RMSNorm gamma ``w`` is stored zero-centred and scales by ``1 + w``.
    - ``embedding_scale``: the embeddings are multiplied by ``sqrt(hidden_size)`` rounded to the model's dtype.
    - ``post_norms``: an RMSNorm on the attention output and one on the MLP output, before each residual add.
    - ``softmax_scale``: attention scores are ``q.k * softmax_scale`` (None: ``head_dim ** -0.5``).
    - ``attn_logit_softcap`` / ``final_logit_softcap``: scores / logits ``x`` become ``c * tanh(x / c)``.
    - ``sliding_window``: the layers in ``sliding_layers`` (0-based) let query ``i`` see keys ``j`` with
      ``i - sliding_window < j <= i`` only; ``local_rope_theta`` is their RoPE base (None: ``rope_theta``).
    - ``num_experts`` (None: a dense MLP): every layer's MLP is a mixture of ``num_experts`` SwiGLU experts of
      width ``moe_ffn_hidden_size``. A router ``r = x W_r^T`` picks the ``moe_topk`` largest of ``softmax(r)``;
      the token's output is ``sum_e w_e expert_e(x)`` with ``w`` those probabilities (``moe_norm_topk`` False),
      or those renormalised to sum to 1 (True: HF's ``norm_topk_prob``, Mixtral's softmax over the top-k
      logits). ``shared_expert_ffn_hidden_size``: a dense SwiGLU MLP every token also runs, its output scaled
      by ``sigmoid(x w_g)`` when ``shared_expert_gate`` (Qwen2-MoE). ``expert_names``: the HF checkpoint's
      naming of the experts (a key of ``EXPERT_NAMES``).
    - ``rotary_fraction``: RoPE turns the first ``rotary_fraction * head_dim`` dimensions of each head (HF's
      ``partial_rotary_factor``), the rest pass unrotated; ``rotary_interleaved``: it rotates adjacent pairs
      ``(x_2i, x_2i+1)`` (GLM-4) instead of the two halves.
    - ``post_norm_names``: the HF names of the three norms around a ``post_norms`` layer's attention and MLP
      (a key of ``POST_NORM_NAMES``).
    - ``kv_lora_rank`` (None: ordinary attention): multi-latent attention (DeepSeek-V2/V3's MLA, megatron's
      ``MLASelfAttention``). Keys and values come from a latent ``c = RMSNorm(x W_kv_a[:kv_lora_rank])`` of width
      ``kv_lora_rank`` through ``W_kv_b``, each head's ``[k_nope (qk_nope_head_dim); v (v_head_dim)]``; one RoPE key
      of ``qk_rope_head_dim`` (``x W_kv_a[kv_lora_rank:]``) is shared by every head. Queries are ``x W_q`` or, with
      ``q_lora_rank``, ``RMSNorm(x W_q_a) W_q_b``, each head ``[q_nope; q_rope]``. RoPE turns adjacent pairs (HF's
      ``rope_interleave``); scores are scaled by ``(qk_nope_head_dim + qk_rope_head_dim) ** -0.5``. ``head_dim`` is
      then HF's (``qk_rope_head_dim``) and ``num_kv_heads`` equals ``num_attention_heads``.
    - ``dense_layers``: the first ``dense_layers`` layers of an MoE model have a dense MLP of width
      ``ffn_hidden_size`` (HF's ``first_k_dense_replace``).
    - ``moe_score`` "sigmoid" (DeepSeek-V3): the router scores ``s = sigmoid(r)``; the top-k is taken over
      ``s + b`` with ``b`` the router's expert bias when ``moe_expert_bias`` (HF's ``e_score_correction_bias``, a
      buffer megatron moves by ``moe_router_bias_update_rate`` after each step, never by gradients), within the
      ``moe_group_topk`` best of ``moe_groups`` equal groups of experts (a group scores the sum of its top two)
      when ``moe_groups``; the weights are the chosen ``s`` renormalised to sum to 1, times ``moe_scaling_factor``
      when set (HF's ``routed_scaling_factor``).
    - ``yarn`` (multi-latent attention only; empty: plain RoPE): YaRN RoPE scaling with the values of ``YARN_FIELDS``
      (HF's ``rope_parameters``): frequencies interpolated by ``factor`` below the ``beta_slow`` / ``beta_fast``
      rotations of ``original_max_position_embeddings`` (the correction range rounded outwards to whole dimensions,
      HF's ``truncate``), cos / sin scaled by ``m(mscale) / m(mscale_all_dim)`` and the attention scores by
      ``m(mscale_all_dim) ** 2``, with ``m(x) = 0.1 x ln(factor) + 1`` (1 for ``x`` 0): megatron's MLA YaRN.
    - ``hf_fused``: HF tensors that concatenate several of the table's pieces along dim 0 (keys of ``HF_FUSIONS``:
      Phi-3's ``qkv_proj`` = [q; k; v], ``gate_up_proj`` = [gate; up]); ``hf_layout`` keeps the parts' names and
      the checkpoint reader / writer map them onto the fused tensors (``hf_fusions``).
    """

    model_type: str
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool
    rope_theta: float
    rms_norm_eps: float
    qkv_bias: bool
    max_position_embeddings: int
    qk_norm: bool = False
    activation: str = "silu"
    zero_centered_norms: bool = False
    embedding_scale: bool = False
    post_norms: bool = False
    softmax_scale: float | None = None
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] = ()
    local_rope_theta: float | None = None
    num_experts: int | None = None
    moe_ffn_hidden_size: int | None = None
    moe_topk: int | None = None
    moe_norm_topk: bool = False
    shared_expert_ffn_hidden_size: int | None = None
    shared_expert_gate: bool = False
    expert_names: str | None = None
    hf_fused: tuple[str, ...] = ()
    rotary_fraction: float = 1.0
    rotary_interleaved: bool = False
    post_norm_names: str = "gemma2"
    q_lora_rank: int | None = None
    kv_lora_rank: int | None = None
    qk_nope_head_dim: int | None = None
    qk_rope_head_dim: int | None = None
    v_head_dim: int | None = None
    dense_layers: int = 0
    moe_score: str = "softmax"
    moe_expert_bias: bool = False
    moe_groups: int | None = None
    moe_group_topk: int | None = None
    moe_scaling_factor: float | None = None
    yarn: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        # A spec read back from a checkpoint's JSON holds a list here.
        object.__setattr__(self, "sliding_layers", tuple(self.sliding_layers))
        object.__setattr__(self, "hf_fused", tuple(self.hf_fused))
        object.__setattr__(self, "yarn", tuple(self.yarn))
        if self.yarn and len(self.yarn) != len(YARN_FIELDS):
            raise ValueError(f"yarn {self.yarn!r}: one value for each of {', '.join(YARN_FIELDS)}")
        if self.post_norm_names not in POST_NORM_NAMES:
            raise ValueError(f"post_norm_names {self.post_norm_names!r} is not one of {', '.join(POST_NORM_NAMES)}")
        if set(self.hf_fused) - set(HF_FUSIONS):
            raise ValueError(f"hf_fused {self.hf_fused!r}: each must be one of {', '.join(HF_FUSIONS)}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation {self.activation!r} is not one of {', '.join(ACTIVATIONS)}")
        if self.num_experts is not None and self.expert_names not in EXPERT_NAMES:
            raise ValueError(f"expert_names {self.expert_names!r} is not one of {', '.join(EXPERT_NAMES)}")

    @property
    def moe(self) -> bool:
        return self.num_experts is not None

    @property
    def mla(self) -> bool:
        return self.kv_lora_rank is not None

    def moe_layer(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` (0-based) has a mixture-of-experts MLP."""
        return self.moe and layer >= self.dense_layers

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def mismatches(self, other: "ModelSpec") -> list[str]:
        """Human-readable ``field: self vs other`` lines for every differing field."""
        mine, theirs = asdict(self), asdict(other)
        return [f"{key}: {mine[key]!r} vs {theirs[key]!r}" for key in mine if mine[key] != theirs[key]]


@dataclass(frozen=True)
class Refusal:
    """An HF config field meshrl does not implement: refused unless ``supported(value, hf_config)``.

    ``read`` gets the value (default: the attribute ``field``, None when absent); ``why`` says what meshrl
    lacks and what to do instead.
    """

    field: str
    supported: Callable[[Any, Any], bool]
    why: str
    read: Callable[[Any], Any] | None = None

    def problem(self, hf_config) -> str | None:
        value = self.read(hf_config) if self.read else getattr(hf_config, self.field, None)
        return None if self.supported(value, hf_config) else f"{self.field}={value!r}: {self.why}"


def _rope_type(hf_config) -> str:
    params = getattr(hf_config, "rope_parameters", None) or {}
    return params.get("rope_type", params.get("type", "default"))


# ModelSpec.yarn's values, in order: HF's rope_parameters keys of YaRN, megatron MLA's YarnRotaryEmbedding arguments
YARN_FIELDS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")

# ModelSpec.expert_names -> the HF checkpoint's (MoE block, gate, up, down projection) names: a layer's router is
# ``model.layers.{i}.{block}.gate.weight``, expert e's gate projection ``...{block}.experts.{e}.{gate}.weight``.
EXPERT_NAMES = {"qwen": ("mlp", "gate_proj", "up_proj", "down_proj"), "mixtral": ("block_sparse_moe", "w1", "w3", "w2"),
                "deepseek": ("mlp", "gate_proj", "up_proj", "down_proj")}
# ModelSpec.expert_names -> the HF module of the shared expert (Qwen2-MoE's one, DeepSeek's n_shared_experts as one).
SHARED_EXPERT_NAMES = {"qwen": "mlp.shared_expert", "deepseek": "mlp.shared_experts"}

# ModelSpec.post_norm_names -> the HF names of a post-normed layer's (attention output norm, MLP input norm, MLP
# output norm); the input norm is input_layernorm in both.
POST_NORM_NAMES = {
    "gemma2": ("post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm"),
    "glm4": ("post_self_attn_layernorm", "post_attention_layernorm", "post_mlp_layernorm"),
}

# ModelSpec.hf_fused -> (the fused HF tensor of a layer, the pieces it concatenates along dim 0, in order).
HF_FUSIONS = {
    "qkv": ("self_attn.qkv_proj.weight", ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                          "self_attn.v_proj.weight")),
    "gate_up": ("mlp.gate_up_proj.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight")),
}


@dataclass(frozen=True)
class Fusion:
    """One HF tensor (``name``) that is the concatenation of the ``hf_layout`` pieces ``parts`` along dim 0."""

    name: str
    parts: tuple[str, ...]


def hf_fusions(spec: "ModelSpec") -> list[Fusion]:
    """The fused HF tensors of every layer (``ModelSpec.hf_fused``), in layer order."""
    return [Fusion(f"model.layers.{i}.{fused}", tuple(f"model.layers.{i}.{part}" for part in parts))
            for i in range(spec.num_layers) for kind in spec.hf_fused for fused, parts in (HF_FUSIONS[kind],)]


# ModelSpec.activation -> the HF activation names it implements (``hidden_act`` / Gemma's ``hidden_activation``).
ACTIVATIONS = {"silu": ("silu",), "gelu_tanh": ("gelu_pytorch_tanh",)}

SILU_ONLY = Refusal("hidden_act", lambda v, c: v in (None, "silu"), "only SiLU (SwiGLU MLP) is implemented")
COMMON_REFUSALS = (
    Refusal("rope_type", lambda v, c: v == "default", "only 'default' RoPE is implemented (no rope_scaling: "
            "linear, dynamic, yarn, llama3, longrope); remove it or use a model without it", read=_rope_type),
    Refusal("partial_rotary_factor", lambda v, c: v in (None, 1, 1.0), "RoPE on every head dimension only"),
    Refusal("attention_dropout", lambda v, c: not v, "meshrl trains without dropout; set it to 0.0"),
)


@dataclass(frozen=True)
class Family:
    """One HF decoder architecture (see the module docstring)."""

    model_type: str
    hf_prefix: str  # transformers' class-name prefix: LlamaConfig, LlamaForCausalLM, ...
    qkv_bias: bool = False  # q/k/v projections carry biases (megatron ``add_qkv_bias``)
    qk_norm: bool = False  # RMSNorm over head_dim of each query / key head before RoPE (``qk_layernorm``)
    refusals: tuple[Refusal, ...] = ()
    # The activation's refusal: Llama's SiLU-only one, or the family's own
    activation_refusal: Refusal = SILU_ONLY
    # ModelSpec fields the family reads itself from a validated HF config (Gemma's structure), over the common ones
    spec_fields: Callable[[Any], dict[str, Any]] | None = None
    config_name: str | None = None  # the config class when it is not ``{hf_prefix}Config``
    critic_name: str | None = None  # the critic class when it is not ``{hf_prefix}ForTokenClassification``
    # head_dim is hidden_size / num_attention_heads by construction (the HF config has no head_dim field)
    derives_head_dim: bool = False
    # vLLM attends to the whole sequence where the HF model slides its window (it reads windows from layer_types,
    # which this family's config lacks): meshrl.rollout.serving_limits.engine_window_problems
    engine_ignores_window: bool = False
    lifts: tuple[str, ...] = ()  # fields of COMMON_REFUSALS the family implements itself (GLM-4's partial rotary)
    tiny_shape: dict[str, Any] = field(default_factory=dict)  # TinySpec fields of ``tiny:<model_type>``
    tiny_config: dict[str, Any] = field(default_factory=dict)  # HF config kwargs of every tiny model
    # the tiny model's persistent buffers (name suffixes) drawn at random like its biases (DeepSeek-V3's
    # e_score_correction_bias, zero in HF's init, so that the tests see it used)
    tiny_buffers: tuple[str, ...] = ()
    # HF config fields vLLM reads otherwise than transformers' class computes when they are absent: given to the engine
    # (its hf_overrides) and written into an HF export, so that every reader computes what the trainer does
    # (DeepSeek-V3's scoring_func / topk_method, which a transformers-written config lacks)
    implicit_fields: Callable[[Any], dict[str, Any]] | None = None
    # what a run says once at start about a config it takes with a part left out (DeepSeek-V3's MTP layers)
    config_notes: Callable[[Any], list[str]] | None = None

    @property
    def config_class(self) -> str:
        return self.config_name or f"{self.hf_prefix}Config"

    @property
    def policy_class(self) -> str:
        return f"{self.hf_prefix}ForCausalLM"

    @property
    def critic_class(self) -> str:
        return self.critic_name or f"{self.hf_prefix}ForTokenClassification"


def implicit_fields(hf_config) -> dict[str, Any]:
    """The fields of ``hf_config`` its family spells out for vLLM and the HF export (``Family.implicit_fields``)."""
    fam = family(getattr(hf_config, "model_type", None))
    return fam.implicit_fields(hf_config) if fam.implicit_fields else {}


def config_notes(hf_config) -> list[str]:
    """What a run on ``hf_config`` says once at start (``Family.config_notes``)."""
    fam = family(getattr(hf_config, "model_type", None))
    return fam.config_notes(hf_config) if fam.config_notes else []


def supported_model_types() -> tuple[str, ...]:
    return tuple(FAMILY_MODULES)


def family(model_type: str | None) -> Family:
    """The registered family of ``model_type``; ``ValueError`` naming the supported ones otherwise."""
    if model_type not in FAMILY_MODULES:
        raise ValueError(f"model_type {model_type!r} is not supported; supported: "
                         f"{', '.join(FAMILY_MODULES)} (a family is a module in meshrl/models/families/)")
    return importlib.import_module(f"{__name__}.{FAMILY_MODULES[model_type]}").FAMILY


def model_spec(hf_config) -> ModelSpec:
    """Validate ``hf_config`` (a ``PretrainedConfig``) against its family and extract the fields meshrl maps.

    Raises ``ValueError`` naming every refused field (``COMMON_REFUSALS`` + the family's), or the model_type.
    """
    model_type = getattr(hf_config, "model_type", None)
    fam = family(model_type)
    refusals = (fam.activation_refusal,) + tuple(r for r in COMMON_REFUSALS if r.field not in fam.lifts) \
        + fam.refusals
    problems = [p for r in refusals if (p := r.problem(hf_config))]
    if problems:
        raise ValueError(f"{model_type} config not supported by meshrl: " + "; ".join(problems))
    heads = hf_config.num_attention_heads
    params = getattr(hf_config, "rope_parameters", None) or {}
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", None))
    own = fam.spec_fields(hf_config) if fam.spec_fields else {}
    theta = own.pop("rope_theta", theta)
    if theta is None:
        raise ValueError("the HF config has no rope_theta")
    return ModelSpec(
        model_type=model_type,
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        ffn_hidden_size=hf_config.intermediate_size,
        num_attention_heads=heads,
        num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or heads,
        head_dim=getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads,
        vocab_size=hf_config.vocab_size,
        tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        rope_theta=float(theta),
        rms_norm_eps=float(hf_config.rms_norm_eps),
        qkv_bias=fam.qkv_bias,
        max_position_embeddings=hf_config.max_position_embeddings,
        qk_norm=fam.qk_norm,
        **own,
    )


def gelu_tanh(x):
    """GELU with the tanh approximation: HF's ``gelu_pytorch_tanh``."""
    import torch.nn.functional as F

    return F.gelu(x, approximate="tanh")


def transformer_options(spec: ModelSpec) -> dict[str, Any]:
    """megatron-core ``TransformerConfig`` options of the spec's structure: RMSNorm (zero-centred gamma or
    not), a gated MLP with SiLU or tanh-GELU, no bias except the family's QKV bias, q/k RMSNorm (eps
    ``rms_norm_eps``, as HF's q_norm / k_norm), the softmax scale, and the sliding-window layers
    (``window_size=(window - 1, 0)``: ``window`` keys including the query's own; ``window_attn_skip_freq``
    as a per-layer list, 1 = windowed), interleaved RoPE pairs (``rotary_interleaved``; the rotated fraction of
    each head is ``GPTModel``'s ``rotary_percent``, set by ``meshrl.parallel.model_builder``)."""
    import torch.nn.functional as F

    options = dict(normalization="RMSNorm", layernorm_epsilon=spec.rms_norm_eps, gated_linear_unit=True,
                   activation_func=F.silu if spec.activation == "silu" else gelu_tanh, add_bias_linear=False,
                   add_qkv_bias=spec.qkv_bias, qk_layernorm=spec.qk_norm,
                   layernorm_zero_centered_gamma=spec.zero_centered_norms, softmax_scale=spec.softmax_scale,
                   rotary_interleaved=spec.rotary_interleaved)
    if spec.sliding_window is not None:
        options.update(window_size=(spec.sliding_window - 1, 0),
                       window_attn_skip_freq=[int(i in spec.sliding_layers) for i in range(spec.num_layers)])
    if spec.moe:
        # Softmax then top-k (pre_softmax) keeps the probabilities as they are; top-k of the logits then a
        # softmax over those k equals softmax, top-k, renormalise. Sigmoid scores are always renormalised.
        options.update(num_moe_experts=spec.num_experts, moe_ffn_hidden_size=spec.moe_ffn_hidden_size,
                       moe_router_topk=spec.moe_topk, moe_router_score_function=spec.moe_score,
                       moe_router_pre_softmax=not spec.moe_norm_topk,
                       moe_router_enable_expert_bias=spec.moe_expert_bias, moe_router_num_groups=spec.moe_groups,
                       moe_router_group_topk=spec.moe_group_topk, moe_router_topk_scaling_factor=spec.moe_scaling_factor,
                       moe_shared_expert_intermediate_size=spec.shared_expert_ffn_hidden_size,
                       moe_shared_expert_gate=spec.shared_expert_gate, moe_grouped_gemm=False)
        if spec.dense_layers:  # megatron's per-layer pattern: 0 dense, 1 MoE
            options["moe_layer_freq"] = [int(spec.moe_layer(i)) for i in range(spec.num_layers)]
    if spec.mla:
        # megatron's MLA de-interleaves the RoPE pairs itself (HF's rope_interleave)
        options.update(multi_latent_attention=True, q_lora_rank=spec.q_lora_rank, kv_lora_rank=spec.kv_lora_rank,
                       qk_head_dim=spec.qk_nope_head_dim, qk_pos_emb_head_dim=spec.qk_rope_head_dim,
                       v_head_dim=spec.v_head_dim, rope_type="yarn" if spec.yarn else "rope",
                       rotary_base=spec.rope_theta)
        if spec.yarn:
            factor, original, fast, slow, mscale, mscale_all_dim = spec.yarn
            options.update(rotary_scaling_factor=factor, original_max_position_embeddings=int(original),
                           beta_fast=fast, beta_slow=slow, mscale=mscale, mscale_all_dim=mscale_all_dim)
    return options


def layer_spec_options(spec: ModelSpec) -> dict[str, Any]:
    """Arguments of megatron's ``get_gpt_layer_local_spec`` / ``get_gpt_layer_with_transformer_engine_spec``:
    both build ``q_layernorm`` / ``k_layernorm`` (torch RMSNorm / TE's ``TENorm``, parameter ``weight``) only
    when asked, and an MoE layer (router, token dispatcher, one ``SequentialMLP`` of per-expert MLPs: grouped
    GEMMs need CUDA kernels) when given ``num_experts`` (a model with ``dense_layers`` also builds the dense
    layer spec: ``num_experts`` dropped). MLA layers: ``multi_latent_attention``, with the latent norms."""
    options: dict[str, Any] = dict(qk_layernorm=spec.qk_norm)
    if spec.moe:
        options.update(num_experts=spec.num_experts, moe_grouped_gemm=False)
    if spec.mla:  # MLA's latent norms (q_layernorm on the q latent, kv_layernorm) come with qk_layernorm
        options.update(multi_latent_attention=True, qk_layernorm=True)
    return options


@dataclass(frozen=True)
class Piece:
    """One HF tensor and its place in megatron.

    ``stage``: "embed" (first stage), "layer" (``layer`` index), "head" (last stage).
    ``mcore``: parameter name inside the owning chunk, local-spec naming, ``{j}`` = local layer index.
    ``tp_dim``: HF dimension TP splits (None: replicated). ``part``: which slice of a fused parameter
    ("q", "k", "v", "gate", "up") or None. ``shape``: full HF shape. ``fields``: the config fields
    that determine the shape, for error messages. ``expert``: the routed expert it belongs to (MoE); its
    ``mcore`` name holds ``{k}``, the expert's index among its expert-parallel rank's local experts.
    ``buffer``: a megatron buffer, not a parameter (the router's fp32 expert bias): no gradient, held in fp32.
    """

    hf_name: str
    stage: str
    layer: int | None
    mcore: str
    tp_dim: int | None
    part: str | None
    shape: tuple[int, ...]
    fields: str
    expert: int | None = None
    buffer: bool = False


def layer_pieces(spec: ModelSpec, i: int) -> list[Piece]:
    """HF tensors of decoder layer ``i`` for the spec's features (Llama's layer, plus QKV bias, q/k norms)."""
    h, d, f = spec.hidden_size, spec.head_dim, spec.ffn_hidden_size
    nq, nkv = spec.num_attention_heads, spec.num_kv_heads
    p, layer = f"model.layers.{i}.", "decoder.layers.{j}."
    attn, qkv = layer + "self_attention.", layer + "self_attention.linear_qkv."
    q_rows, kv_rows = "num_attention_heads*head_dim", "num_key_value_heads*head_dim"

    def piece(hf: str, mcore: str, tp_dim: int | None, part: str | None, shape: tuple[int, ...], fields: str):
        return Piece(p + hf, "layer", i, mcore, tp_dim, part, shape, fields)

    pieces = [piece("input_layernorm.weight", layer + "input_layernorm.weight", None, None, (h,), "hidden_size")]
    if spec.mla:
        pieces += _mla_pieces(spec, piece, attn)
    else:
        pieces += [
            piece("self_attn.q_proj.weight", qkv + "weight", 0, "q", (nq * d, h), f"{q_rows}, hidden_size"),
            piece("self_attn.k_proj.weight", qkv + "weight", 0, "k", (nkv * d, h), f"{kv_rows}, hidden_size"),
            piece("self_attn.v_proj.weight", qkv + "weight", 0, "v", (nkv * d, h), f"{kv_rows}, hidden_size"),
        ]
    if spec.qkv_bias:
        pieces += [piece("self_attn.q_proj.bias", qkv + "bias", 0, "q", (nq * d,), q_rows),
                   piece("self_attn.k_proj.bias", qkv + "bias", 0, "k", (nkv * d,), kv_rows),
                   piece("self_attn.v_proj.bias", qkv + "bias", 0, "v", (nkv * d,), kv_rows)]
    if spec.qk_norm:  # one head_dim-sized gamma shared by every head: replicated over TP
        pieces += [piece("self_attn.q_norm.weight", attn + "q_layernorm.weight", None, None, (d,), "head_dim"),
                   piece("self_attn.k_norm.weight", attn + "k_layernorm.weight", None, None, (d,), "head_dim")]
    fc1, fc2, ffn = layer + "mlp.linear_fc1.weight", layer + "mlp.linear_fc2.weight", "intermediate_size, hidden_size"
    if not spec.mla:
        pieces.append(piece("self_attn.o_proj.weight", attn + "linear_proj.weight", 1, None, (h, nq * d),
                            f"hidden_size, {q_rows}"))
    attn_out_norm, mlp_in_norm, mlp_out_norm = POST_NORM_NAMES[spec.post_norm_names]
    if spec.post_norms:
        # Gemma2/3's post_attention_layernorm (GLM-4's post_self_attn_layernorm) normalises the attention output
        # (meshrl.parallel.layers' norm after linear_proj); the MLP's input norm is pre_feedforward_layernorm
        # (GLM-4's post_attention_layernorm).
        pieces += [piece(f"{attn_out_norm}.weight", attn + "linear_proj.post_norm.weight", None, None, (h,),
                         "hidden_size"),
                   piece(f"{mlp_in_norm}.weight", layer + "pre_mlp_layernorm.weight", None, None, (h,), "hidden_size")]
    else:
        pieces.append(piece("post_attention_layernorm.weight", layer + "pre_mlp_layernorm.weight", None, None, (h,),
                            "hidden_size"))
    if spec.moe_layer(i):
        pieces += _moe_pieces(spec, piece, layer + "mlp.")
    else:
        pieces += [
            piece("mlp.gate_proj.weight", fc1, 0, "gate", (f, h), ffn),
            piece("mlp.up_proj.weight", fc1, 0, "up", (f, h), ffn),
            piece("mlp.down_proj.weight", fc2, 1, None, (h, f), "hidden_size, intermediate_size"),
        ]
    if spec.post_norms:
        pieces.append(piece(f"{mlp_out_norm}.weight", layer + "mlp.linear_fc2.post_norm.weight", None, None, (h,),
                            "hidden_size"))
    return pieces


def _mla_pieces(spec: ModelSpec, piece: Callable[..., Piece], attn: str) -> list[Piece]:
    """Multi-latent attention's HF tensors on megatron's local-spec ``MLASelfAttention``. Every projection is a
    column-parallel linear split on its rows over TP (the down projections too: megatron gathers their outputs),
    ``linear_proj`` on its columns; the latent norms are replicated. The rows of ``kv_a_proj_with_mqa`` are
    ``[latent (kv_lora_rank); rope key (qk_rope_head_dim)]`` and those of ``q_proj`` / ``q_b_proj`` /
    ``kv_b_proj`` per head ``[nope; rope]`` / ``[k_nope; v]``, megatron's order too."""
    h, nq, lora, rope = spec.hidden_size, spec.num_attention_heads, spec.kv_lora_rank, spec.qk_rope_head_dim
    q_head, v_head = spec.qk_nope_head_dim + rope, spec.v_head_dim
    qk = "num_attention_heads*(qk_nope_head_dim+qk_rope_head_dim)"
    if spec.q_lora_rank is None:
        pieces = [piece("self_attn.q_proj.weight", attn + "linear_q_proj.weight", 0, None, (nq * q_head, h),
                        f"{qk}, hidden_size")]
    else:
        ql = spec.q_lora_rank
        pieces = [piece("self_attn.q_a_proj.weight", attn + "linear_q_down_proj.weight", 0, None, (ql, h),
                        "q_lora_rank, hidden_size"),
                  piece("self_attn.q_a_layernorm.weight", attn + "q_layernorm.weight", None, None, (ql,), "q_lora_rank"),
                  piece("self_attn.q_b_proj.weight", attn + "linear_q_up_proj.weight", 0, None, (nq * q_head, ql),
                        f"{qk}, q_lora_rank")]
    return pieces + [
        piece("self_attn.kv_a_proj_with_mqa.weight", attn + "linear_kv_down_proj.weight", 0, None, (lora + rope, h),
              "kv_lora_rank+qk_rope_head_dim, hidden_size"),
        piece("self_attn.kv_a_layernorm.weight", attn + "kv_layernorm.weight", None, None, (lora,), "kv_lora_rank"),
        piece("self_attn.kv_b_proj.weight", attn + "linear_kv_up_proj.weight", 0, None,
              (nq * (spec.qk_nope_head_dim + v_head), lora), "num_attention_heads*(qk_nope_head_dim+v_head_dim), "
              "kv_lora_rank"),
        piece("self_attn.o_proj.weight", attn + "linear_proj.weight", 1, None, (h, nq * v_head),
              "hidden_size, num_attention_heads*v_head_dim"),
    ]


def _moe_pieces(spec: ModelSpec, piece: Callable[..., Piece], mlp: str) -> list[Piece]:
    """An MoE layer's HF tensors: the router, each expert's SwiGLU (split over expert-tensor-parallel ranks like a
    dense MLP over TP; megatron's ``SequentialMLP`` holds the local ones), the shared expert and its gate."""
    h, f, n = spec.hidden_size, spec.moe_ffn_hidden_size, spec.num_experts
    block, gate, up, down = EXPERT_NAMES[spec.expert_names]
    width = "intermediate_size" if spec.expert_names == "mixtral" else "moe_intermediate_size"  # the HF field
    ffn, local = f"{width}, hidden_size", mlp + "experts.local_experts.{k}."
    pieces = [piece(f"{block}.gate.weight", mlp + "router.weight", None, None, (n, h), "num_experts, hidden_size")]
    if spec.moe_expert_bias:
        pieces.append(replace(piece(f"{block}.gate.e_score_correction_bias", mlp + "router.expert_bias", None, None,
                                    (n,), "num_experts"), buffer=True))
    for e in range(n):
        expert = f"{block}.experts.{e}."
        pieces += [replace(piece(expert + f"{gate}.weight", local + "linear_fc1.weight", 0, "gate", (f, h), ffn), expert=e),
                   replace(piece(expert + f"{up}.weight", local + "linear_fc1.weight", 0, "up", (f, h), ffn), expert=e),
                   replace(piece(expert + f"{down}.weight", local + "linear_fc2.weight", 1, None, (h, f),
                                 f"hidden_size, {width}"), expert=e)]
    if spec.shared_expert_ffn_hidden_size:
        fs, shared, hf = spec.shared_expert_ffn_hidden_size, mlp + "shared_experts.", SHARED_EXPERT_NAMES[spec.expert_names]
        width = ("n_shared_experts*moe_intermediate_size" if spec.expert_names == "deepseek"
                 else "shared_expert_intermediate_size")
        pieces += [piece(f"{hf}.gate_proj.weight", shared + "linear_fc1.weight", 0, "gate", (fs, h), f"{width}, hidden_size"),
                   piece(f"{hf}.up_proj.weight", shared + "linear_fc1.weight", 0, "up", (fs, h), f"{width}, hidden_size"),
                   piece(f"{hf}.down_proj.weight", shared + "linear_fc2.weight", 1, None, (h, fs), f"hidden_size, {width}")]
        if spec.shared_expert_gate:
            pieces.append(piece("mlp.shared_expert_gate.weight", shared + "gate_weight", None, None, (1, h),
                                "hidden_size"))
    return pieces


def checkpoint_shapes(spec: ModelSpec, critic: bool = False) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor as the family's HF checkpoints hold them: ``hf_layout``'s pieces, with the parts
    of a fused tensor (``hf_fusions``) replaced by it."""
    shapes = {piece.hf_name: piece.shape for piece in hf_layout(spec, critic)}
    for fusion in hf_fusions(spec):
        parts = [shapes.pop(part) for part in fusion.parts]
        shapes[fusion.name] = (sum(shape[0] for shape in parts), *parts[0][1:])
    return shapes


def hf_layout(spec: ModelSpec, critic: bool = False) -> list[Piece]:
    """Every HF tensor of the model (``*ForCausalLM``, or the critic's ``*ForTokenClassification``), in the
    order ``meshrl.parallel.hf_conversion.iter_hf_weights`` yields them."""
    h, v = spec.hidden_size, spec.vocab_size
    pieces = [Piece("model.embed_tokens.weight", "embed", None, "embedding.word_embeddings.weight", 0, None,
                    (v, h), "vocab_size, hidden_size")]
    for i in range(spec.num_layers):
        pieces += layer_pieces(spec, i)
    pieces.append(Piece("model.norm.weight", "head", None, "decoder.final_layernorm.weight", None, None, (h,),
                        "hidden_size"))
    if critic:
        pieces += [Piece("score.weight", "head", None, "output_layer.weight", None, None, (1, h), "hidden_size"),
                   Piece("score.bias", "head", None, "output_layer.bias", None, None, (1,), "num_labels=1")]
    elif not spec.tie_word_embeddings:
        pieces.append(Piece("lm_head.weight", "head", None, "output_layer.weight", 0, None, (v, h),
                            "vocab_size, hidden_size"))
    return pieces

