"""The vocabulary of model families: ``ModelSpec`` (the architecture facts meshrl reads from an HF config), the
naming tables its fields are keys of, ``Refusal`` (an HF config field meshrl does not implement) and ``Family``
(one HF decoder architecture, as data). ``meshrl.models.families`` registers the families and reads configs."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Callable


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
    - ``mrope_section`` (empty: RoPE over one position): multimodal RoPE (Qwen2-VL's M-RoPE, megatron's ``mrope``).
      Each token has a (temporal, height, width) position; the ``head_dim / 2`` rotary frequencies are split in
      consecutive sections of these widths, section ``i`` turned by axis ``i``'s position (text tokens have the same
      value on all three, so it is plain RoPE for them). The positions come from ``meshrl.data.mrope_positions``.
    - ``mrope_interleaved`` (with ``mrope_section``): Qwen3-VL's interleaved M-RoPE (transformers'
      ``apply_interleaved_mrope``): rotary frequency ``i`` (of ``head_dim / 2``) is turned by the height position when
      ``i % 3 == 1 and i < 3 * mrope_section[1]``, by the width position when ``i % 3 == 2 and i < 3 *
      mrope_section[2]``, by the temporal one otherwise (``meshrl.parallel.layers.interleaved_mrope_axes``).
    - ``vision``: the model is a vision-language model: a vision tower (``meshrl.parallel.vision``, read from the HF
      config's ``vision_config``) whose merged patch features replace the embeddings of the image pad tokens; the
      fields above are its language model's (the HF config's ``text_config``).
    - ``deepstack_layers`` (Qwen3-VL's deepstack; 0: none): the tower also gives one feature per merged patch for
      each of this many of its blocks (``vision_config.deepstack_visual_indexes``); feature ``i`` is added to the
      hidden states at the image pad tokens after decoder layer ``i`` (``h_i <- h_i + f_i`` there, elsewhere
      unchanged), ``i = 0 .. deepstack_layers - 1``.
    - ``lm_prefix``: the HF checkpoint's prefix of the language model's tensors (``embed_tokens``, ``layers.{i}``,
      ``norm``): ``model.`` for the causal LMs, ``model.language_model.`` for transformers 5's Qwen3-VL; the output
      layer is ``lm_head`` (``score`` for a critic) either way.
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
    mrope_section: tuple[int, ...] = ()
    mrope_interleaved: bool = False
    vision: bool = False
    deepstack_layers: int = 0
    lm_prefix: str = "model."

    @property
    def lm_module_prefix(self) -> str:
        """The language model's module path in transformers 5's class of the family, which PEFT's adapter names follow
        (not the checkpoint's names, ``lm_prefix``): ``model.language_model.`` in a ``*ForConditionalGeneration`` with
        a vision tower, ``model.`` in the causal LMs."""
        return "model.language_model." if self.vision else "model."

    def __post_init__(self) -> None:
        # A spec read back from a checkpoint's JSON holds a list here.
        object.__setattr__(self, "sliding_layers", tuple(self.sliding_layers))
        object.__setattr__(self, "hf_fused", tuple(self.hf_fused))
        object.__setattr__(self, "yarn", tuple(self.yarn))
        object.__setattr__(self, "mrope_section", tuple(self.mrope_section))
        if self.mrope_section and sum(self.mrope_section) * 2 != self.head_dim:
            raise ValueError(f"mrope_section {self.mrope_section!r}: its sections must cover half of head_dim "
                             f"{self.head_dim} (each rotates pairs of dimensions)")
        if self.mrope_interleaved and (not self.mrope_section or self.rotary_interleaved):
            raise ValueError("mrope_interleaved interleaves the mrope_section axes over the rotate-half frequencies: "
                             "it needs mrope_section and rotary_interleaved=False")
        if self.deepstack_layers and not (self.vision and 0 < self.deepstack_layers <= self.num_layers):
            raise ValueError(f"deepstack_layers={self.deepstack_layers}: deepstack features need a vision tower and "
                             f"at most one per decoder layer ({self.num_layers})")
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
    policy_name: str | None = None  # the policy class when it is not ``{hf_prefix}ForCausalLM`` (VL models)
    # a vision-language model: its language model is the config's text_config, its tiny model has a vision tower
    # (meshrl.models.tiny_vision, not tiny_shape / tiny_config) and no reward-model head
    vision_language: bool = False
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
        return self.policy_name or f"{self.hf_prefix}ForCausalLM"

    @property
    def critic_class(self) -> str:
        return self.critic_name or f"{self.hf_prefix}ForTokenClassification"
