"""The typed configuration tree, with verl's section and key names.

Users arrive from verl and type its keys (``algorithm.adv_estimator=remax``,
``actor_rollout_ref.actor.ppo_max_token_len_per_gpu=24000``, ``trainer.n_gpus_per_node=8``), so the
tree mirrors verl's ``ppo_trainer`` config. Keys verl has for its FSDP backend (``fsdp_config.*``)
are accepted so that verl scripts parse unchanged; ``param_offload`` / ``optimizer_offload`` there
mean the same thing for meshrl's Megatron backend. Keys of verl features meshrl lacks (MoE,
learned reward models, multi-modal data, ...) are here with verl's defaults, so that a script which
sets them to those loads; ``meshrl.config.key_policy`` refuses any other value, naming the feature.

Defaults differ from verl's where meshrl's design says so: dynamic token-budget micro-batches are
on by default, and ``trainer.device="auto"`` picks CUDA when present, CPU otherwise.

Every field is typed: OmegaConf rejects a wrong type, and ``meshrl.config.loader`` rejects an
unknown key with a did-you-mean suggestion. Semantic checks live in ``meshrl.config.validate``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from omegaconf import II

# Values a few string keys may take; validate.py checks them and names the alternatives.
TRUNCATION_MODES = ("error", "left", "right", "middle")
LOSS_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
KL_CTRL_TYPES = ("fixed", "adaptive")
ROLLOUT_ENGINES = ("vllm", "hf")
ROLLOUT_MODES = ("sync", "async")
MEGATRON_DTYPES = ("auto", "bfloat16", "float32")
# megatron.override_transformer_config.moe_router_load_balancing_type values meshrl applies (validate.py says why)
MOE_BALANCING = ("none", "aux_loss")
ROUTER_REPLAY_MODES = ("disabled", "R2", "R3")  # verl's router_replay.mode values (meshrl.parallel.router_replay)
DEVICES = ("auto", "cpu", "cuda")
LR_SCHEDULES = ("constant", "cosine")  # verl FSDP's lr_scheduler_type / warmup_style
LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse_square_root", "WSD")  # verl Megatron's lr_decay_style
WD_INCR_STYLES = ("constant", "linear", "cosine")
WSD_DECAY_STYLES = ("linear", "cosine", "exponential", "minus_sqrt")
RESUME_MODES = ("auto", "disable", "resume_path")
NONFINITE_ACTIONS = ("skip", "stop")  # what a NaN / inf score, loss or gradient norm does (see the keys)
MISMATCH_ACTIONS = ("stop", "warn", "ignore")  # trainer.on_mismatch: what a train/rollout log-prob alarm does
LOGGERS = ("console", "jsonl", "tensorboard", "wandb")
# verl's training backends (``model_engine``, a Hydra config group in verl): megatron is meshrl's; verl's
# FSDP names (dp, its own; fsdp) load with a warning that meshrl trains with Megatron.
MODEL_ENGINES = ("megatron", "dp", "fsdp")


@dataclass
class CustomDatasetClassConfig:
    """verl's ``data.custom_cls`` and ``data.datagen``: a dataset (or data generator) class of the user's; meshrl reads
    verl's row layout only (refused)."""

    path: Optional[str] = None
    name: Optional[str] = None


@dataclass
class SamplerClassConfig:
    """verl's ``data.sampler``: a custom sampler class (refused)."""

    class_path: Optional[str] = None
    class_name: Optional[str] = None


@dataclass
class DataConfig:
    tokenizer: Optional[str] = None  # default: the policy model's tokenizer
    train_files: Any = "~/data/gsm8k/train.parquet"  # a path or a list of paths
    val_files: Any = "~/data/gsm8k/test.parquet"
    # -1: every row; N: N rows of the files (first N, or N drawn with data.seed when data.shuffle), chosen
    # before filter_overlong_prompts, as verl does
    train_max_samples: int = -1
    prompt_key: str = "prompt"
    reward_fn_key: str = "data_source"
    max_prompt_length: int = 512
    max_response_length: int = 512
    train_batch_size: int = 1024
    # verl's prompts per generation call (DAPO's dynamic sampling generates more than a train batch; verl's fully
    # async rollouter takes 1): null or the train batch, or 1 with the fully async trainer (meshrl.config.async_keys)
    gen_batch_size: Optional[int] = None
    val_batch_size: Optional[int] = None  # None: the whole validation set in one generate call
    val_max_samples: int = -1  # as train_max_samples, for the validation files
    # Each training and validation row keeps its chat messages (verl's raw_prompt) on the driver, for
    # multi-turn and agent code; the engines still get the templated token ids.
    return_raw_chat: bool = True
    return_raw_input_ids: bool = False
    shuffle: bool = True
    seed: int = 1
    filter_overlong_prompts: bool = False
    filter_overlong_prompts_workers: int = 1
    truncation: str = "error"
    dataloader_num_workers: int = 0
    trust_remote_code: bool = False  # the driver's tokenizer (prompts) may run the model folder's code (verl's key)
    # keyword arguments of the tokenizer's apply_chat_template, e.g. {enable_thinking: false}
    apply_chat_template_kwargs: Dict[str, Any] = field(default_factory=dict)
    # verl's multi-modal columns: meshrl trains text-only policies, and the dataset refuses rows that carry
    # images or videos under these keys (verl's defaults, which every verl script sets).
    image_key: str = "images"
    video_key: str = "videos"
    image_patch_size: int = 14
    custom_cls: CustomDatasetClassConfig = field(default_factory=CustomDatasetClassConfig)
    datagen: CustomDatasetClassConfig = field(default_factory=CustomDatasetClassConfig)
    sampler: SamplerClassConfig = field(default_factory=SamplerClassConfig)
    audio_key: str = "audios"
    mm_processor_kwargs: Dict[str, Any] = field(default_factory=dict)
    return_multi_modal_inputs: bool = True
    return_full_prompt: bool = False
    use_shm: bool = False
    validation_shuffle: bool = False
    # the dataset's copies of the multi-turn tool paths (verl interpolates them): refused set apart from those
    tool_config_path: Optional[str] = II("actor_rollout_ref.rollout.multi_turn.tool_config_path")
    function_tool_path: Optional[str] = II("actor_rollout_ref.rollout.multi_turn.function_tool_path")


@dataclass
class FusedKernelOptionsConfig:
    impl_backend: str = "torch"  # verl's FSDP kernels' backend; its Megatron backend does not read it either
    # meshrl's: tokens per chunk of the fused output layer (meshrl.parallel.fused_output), which holds
    # [chunk_size, vocab / TP] logits at a time
    chunk_size: int = 512


@dataclass
class LoraConfig:
    """verl's ``model.lora`` (its Megatron LoRA spelling; ``meshrl.config.lora_keys`` reads it)."""

    type: str = "lora"
    merge: bool = False
    rank: int = 0
    alpha: int = 32
    dropout: float = 0.0
    target_modules: List[str] = field(default_factory=lambda: ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"])
    exclude_modules: List[str] = field(default_factory=list)
    dropout_position: str = "pre"
    lora_A_init_method: str = "xavier"
    lora_B_init_method: str = "zero"
    a2a_experimental: bool = False
    dtype: Optional[str] = None
    adapter_path: Optional[str] = None
    freeze_vision_model: bool = True
    freeze_vision_projection: bool = True
    freeze_language_model: bool = True


@dataclass
class TiledMLPConfig:
    """verl's FSDP TiledMLP patch of HF models (FSDP-only)."""

    enabled: bool = False
    num_shards: int = 4


@dataclass
class MTPConfig:
    """verl's multi-token-prediction layers and speculative decoding (refused)."""

    enable: bool = False
    enable_train: bool = False
    enable_rollout: bool = False
    detach_encoder: bool = False
    method: str = "mtp"
    mtp_loss_scaling_factor: float = 0.1
    num_speculative_tokens: int = 1
    speculative_algorithm: str = "EAGLE"
    speculative_num_steps: int = 3
    speculative_eagle_topk: int = 1
    speculative_num_draft_tokens: int = 4


@dataclass
class ModelConfig:
    # A local HF folder, or "embedded:smollm2" (the packaged SmolLM2-135M-Instruct), "embedded:gemma3-270m", or
    # "tiny:<family>" (tiny:llama, tiny:qwen2, tiny:qwen3, tiny:mistral, tiny:gemma, tiny:gemma2, tiny:gemma3:
    # tiny random models of each family).
    path: str = "embedded:smollm2"
    tokenizer_path: Optional[str] = None
    use_remove_padding: bool = True
    enable_gradient_checkpointing: bool = False
    trust_remote_code: bool = False  # HF config and tokenizer loads may run the model folder's code (verl's key)
    use_shm: bool = False
    external_lib: Optional[str] = None
    override_config: Dict[str, Any] = field(default_factory=dict)
    # The policy's and reference's log-probs and entropy by the fused output layer, without [tokens, vocab / TP]
    # logits (verl's key; on by default, unlike verl: its outputs are the unfused path's up to rounding)
    use_fused_kernels: bool = True
    fused_kernel_options: FusedKernelOptionsConfig = field(default_factory=FusedKernelOptionsConfig)
    enable_activation_offload: bool = False  # verl's FSDP activation offload
    torch_dtype: Optional[str] = None  # verl's FSDP load dtype (some scripts set it); warned, megatron.dtype rules
    # verl's LoRA keys (its FSDP names, then its Megatron section; meshrl.config.lora_keys reads them).
    lora_rank: int = 0
    lora_alpha: int = 16
    target_modules: Any = "all-linear"
    exclude_modules: Any = None
    lora_adapter_path: Optional[str] = None
    lora: LoraConfig = field(default_factory=LoraConfig)
    custom_chat_template: Optional[str] = None
    hf_config_path: Optional[str] = None
    use_liger: bool = False
    tiled_mlp: TiledMLPConfig = field(default_factory=TiledMLPConfig)
    mtp: MTPConfig = field(default_factory=MTPConfig)


@dataclass
class OptimConfig:
    """verl's optimizer keys of both its backends (``meshrl.workers.actor_rollout_ref.optimizer_config``
    maps them onto megatron's optimizer and ``OptimizerParamScheduler``). The schedule is sized in RL
    steps and advances once per RL step, as in verl."""

    lr: float = 1e-6
    lr_warmup_steps: int = -1  # -1: use lr_warmup_steps_ratio
    lr_warmup_steps_ratio: float = 0.0  # of lr_decay_steps (default: the run's RL steps)
    min_lr_ratio: float = 0.0  # verl FSDP's floor, a fraction of lr; min_lr is its Megatron form
    warmup_style: str = "constant"  # verl's name for the schedule after warm-up
    lr_scheduler_type: Optional[str] = None  # newer verl name; wins over warmup_style when set
    num_cycles: float = 0.5  # verl FSDP's cosine cycles; the cosine is a half cycle, other values are refused
    weight_decay: float = 0.01
    betas: List[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    clip_grad: float = 1.0  # the gradient-norm clip (verl's Megatron key; actor.grad_clip is its FSDP one)
    total_training_steps: int = -1  # filled in by the trainer from the data and epochs
    # verl's Megatron-only keys
    optimizer: str = "adam"  # megatron's Adam with decoupled weight decay (AdamW); the only one wired
    lr_warmup_init: float = 0.0  # the warm-up's first learning rate
    lr_decay_steps: Optional[int] = None  # None: total_training_steps
    # constant | linear | cosine | inverse_square_root | WSD; None: lr_scheduler_type
    lr_decay_style: Optional[str] = None
    min_lr: Optional[float] = None  # None: lr * min_lr_ratio
    weight_decay_incr_style: str = "constant"  # constant | linear | cosine (verl starts and ends at weight_decay)
    lr_wsd_decay_style: str = "exponential"  # the WSD schedule's anneal: linear | cosine | exponential | minus_sqrt
    lr_wsd_decay_steps: Optional[int] = None  # the WSD anneal's length (needed with lr_decay_style=WSD)
    # False (verl's default): on resume the schedule's settings come from this config, its position from
    # the checkpoint; True: both from the checkpoint.
    use_checkpoint_opt_param_scheduler: bool = False
    # Fields of megatron's OptimizerConfig set directly (verl's key), e.g. {adam_beta2: 0.95}; unknown ones are refused.
    override_optimizer_config: Dict[str, Any] = field(default_factory=dict)
    # verl's FSDP optimizer's module and LR-schedule step indexing (FSDP-only)
    optimizer_impl: str = "torch.optim"
    zero_indexed_step: bool = True
    # megatron's precision-aware optimizer, the Muon optimizer and its layer-wise distributed optimizer (refused)
    use_precision_aware_optimizer: bool = False
    main_grads_dtype: str = "fp32"
    exp_avg_dtype: str = "fp32"
    exp_avg_sq_dtype: str = "fp32"
    use_layer_wise_distributed_optimizer: bool = False
    muon_momentum: float = 0.95
    muon_split_qkv: bool = True
    muon_nesterov: bool = False
    muon_scale_mode: str = "spectral"
    muon_fp32_matmul_prec: str = "medium"
    muon_num_ns_steps: int = 5
    muon_tp_mode: str = "blockwise"
    muon_extra_scale_factor: float = 1.0
    muon_coefficient_type: str = "quintic"
    muon_scalar_optimizer: str = "adam"
    muon_match_adamw_update_rms: bool = False


@dataclass
class RouterReplayConfig:
    """verl's MoE router replay (``meshrl.parallel.router_replay``): ``mode`` disabled | R2 (the old-log-prob pass's
    experts replayed in the update; the actor's section only) | R3 (the rollout's; refused: vLLM on CPU cannot
    report routing); verl reads neither file key."""

    mode: str = "disabled"
    record_file: Optional[str] = None
    replay_file: Optional[str] = None


@dataclass
class QATConfig:
    """verl's quantization-aware training (refused), with its FSDP engine's defaults."""

    enable: bool = False
    mode: str = "w4a16"
    group_size: int = 16
    ignore_patterns: List[str] = field(default_factory=lambda: ["lm_head", "embed_tokens", "re:.*mlp.gate$"])
    activation_observer: Optional[str] = "static_minmax"
    quantization_config_path: Optional[str] = None


def _megatron_qat() -> QATConfig:
    return QATConfig(ignore_patterns=["lm_head", "*mlp.gate"], activation_observer=None)  # verl's Megatron defaults


@dataclass
class MegatronConfig:
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: Optional[int] = None
    context_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    # megatron's sequence parallelism (verl's key): norms and the residual stream split along the sequence over the
    # TP ranks, the same numbers with less activation memory; off at TP 1, as in verl. Off by default, where verl's
    # engine defaults it on: meshrl does not build it with multi-latent attention (DeepSeek-V3, Moonlight), whose
    # verl scripts leave the key unset and would be refused
    sequence_parallel: bool = False
    use_distributed_optimizer: bool = False
    param_offload: bool = False
    grad_offload: bool = False
    optimizer_offload: bool = False
    seed: int = 42
    # TransformerConfig fields set directly (verl's key), e.g. recompute_granularity / recompute_method /
    # recompute_num_layers; they win over model.enable_gradient_checkpointing. Unknown fields are refused.
    override_transformer_config: Dict[str, Any] = field(default_factory=dict)
    # Start from a megatron distributed checkpoint instead of the HF weights: dist_checkpointing_path is a
    # folder written by `meshrl convert hf-to-mcore` (verl's keys; the model's HF config still gives its shape).
    use_dist_checkpointing: bool = False
    dist_checkpointing_path: Optional[str] = None
    # Parameters' dtype (verl's key): bfloat16 trains with mixed precision (fp32 main params, gradients
    # and Adam state in the optimizer), float32 throughout; auto: bfloat16 with CUDA, float32 without.
    # The reference's auto is the actor's dtype, so that it starts as the policy's exact copy. verl's
    # float16 is refused (its loss scaling is not wired).
    dtype: str = "auto"
    # verl's choice of HF<->Megatron weight bridge (mbridge, or its legacy "vanilla" one). meshrl always
    # converts with meshrl.parallel.hf_conversion: accepted so verl scripts parse, no effect.
    use_mbridge: bool = True
    vanilla_mbridge: bool = False
    # verl's packing switch of its Megatron engine; verl's workers overwrite it with the role's
    # model.use_remove_padding, which meshrl reads (inert).
    use_remove_padding: bool = True
    use_megatron_fsdp: bool = False  # Megatron's own FSDP; refused
    # the experts' tensor-parallel size (verl's; None: the tensor-parallel size)
    expert_tensor_parallel_size: Optional[int] = None
    router_replay: RouterReplayConfig = field(default_factory=RouterReplayConfig)
    # verl-project's engine keys: checkpoint naming and resharding, dynamic context parallelism, padding for its
    # static shapes, its chunked entropy, the engine's forward-only flag (key_policy says what each does here)
    dist_checkpointing_prefix: str = ""
    dist_ckpt_optim_fully_reshardable: bool = False
    distrib_optim_fully_reshardable_mem_efficient: bool = False
    dynamic_context_parallel: bool = False
    max_seqlen_per_dp_cp_rank: Optional[int] = None
    override_ddp_config: Dict[str, Any] = field(default_factory=dict)
    override_mcore_model_config: Dict[str, Any] = field(default_factory=dict)
    pad_bshd_to_minibatch_max: bool = True
    pad_to_length: bool = False
    pad_to_length_bucket: int = 512
    entropy_from_logits_with_chunking: bool = False
    entropy_from_logits_chunk_size: int = 2048
    forward_only: bool = False
    qat: QATConfig = field(default_factory=_megatron_qat)


@dataclass
class FSDPCompatConfig:
    """verl's FSDP keys, accepted so verl scripts parse; offload flags carry over to Megatron."""

    param_offload: bool = False
    optimizer_offload: bool = False
    offload_policy: bool = False
    reshard_after_forward: bool = True
    fsdp_size: int = -1
    forward_prefetch: bool = False
    model_dtype: Optional[str] = None
    wrap_policy: Dict[str, Any] = field(default_factory=dict)
    use_orig_params: bool = False
    ulysses_sequence_parallel_size: int = 1
    entropy_from_logits_with_chunking: bool = False
    entropy_checkpointing: bool = False
    mixed_precision: Dict[str, Any] = field(default_factory=dict)  # param_dtype / reduce_dtype / buffer_dtype
    turbo_config: Dict[str, Any] = field(default_factory=dict)  # verl's fsdp_turbo settings
    strategy: str = "fsdp"  # fsdp | fsdp2 (verl's engine config)
    dtype: str = "bfloat16"
    seed: int = 42
    full_determinism: bool = False
    use_torch_compile: bool = True
    forward_only: bool = False
    pad_to_length: bool = False
    pad_to_length_bucket: int = 1024
    entropy_from_logits_chunk_size: int = 2048
    qat: QATConfig = field(default_factory=QATConfig)


def _profiler_tool_config() -> Dict[str, Any]:
    return {"npu": {"contents": [], "level": "level0", "analysis": True, "discrete": False},
            "torch": {"contents": [], "discrete": False}}


@dataclass
class ProfilerConfig:
    """verl's per-role profiler hooks (``actor.profiler`` ...), so verl scripts parse; inert (meshrl's
    profiling lives in bench/)."""

    tool: Optional[str] = None
    enable: bool = False
    all_ranks: bool = False
    ranks: List[int] = field(default_factory=list)
    save_path: Optional[str] = None
    tool_config: Dict[str, Any] = field(default_factory=_profiler_tool_config)
    finish_hook_cmd: Optional[str] = None
    finish_hook_ranks: List[int] = field(default_factory=list)
    finish_hook_all_ranks: bool = False
    relocate_results: bool = False


@dataclass
class CheckpointContentsConfig:
    save_contents: List[str] = field(default_factory=lambda: ["model", "optimizer", "extra"])
    load_contents: List[str] = field(default_factory=lambda: ["model", "optimizer", "extra"])
    async_save: bool = False  # refused
    strict: bool = True  # mbridge's HF export (inert)
    mbridge_config: Dict[str, Any] = field(default_factory=dict)  # mbridge's HF export (inert)


@dataclass
class PolicyLossConfig:
    # a name registered in meshrl.algorithms.policy_loss (verl's), or "package.module:function"
    loss_mode: str = "vanilla"
    clip_cov_ratio: float = 0.0002  # clip_cov: at most this fraction of the tokens loses its gradient
    clip_cov_lb: float = 1.0  # clip_cov: the covariance range of the tokens it may pick
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 0.0002  # kl_cov: the fraction of the tokens (largest covariance) penalised
    ppo_kl_coef: float = 0.1  # kl_cov: the coefficient of that penalty |logπ − logπ_old|
    dro_beta: Optional[float] = None  # dro: the quadratic log-ratio penalty; required (> 0) for loss_mode=dro
    # sapo: verl-project's SAPO scripts set these (+policy_loss.tau_pos / tau_neg), which verl's loss never reads:
    # it reads actor.tau_pos / tau_neg. meshrl reads the actor's, which follow these unless set themselves
    # (_actor_section; key_policy.ALIASES refuses the two set apart).
    tau_pos: float = 1.0
    tau_neg: float = 1.05


@dataclass
class ActorConfig:
    strategy: str = "megatron"
    ppo_mini_batch_size: int = 256  # in prompts, multiplied by rollout.n (as verl)
    # Sequences per micro-batch when use_dynamic_bsz=False (per rank; the global form is divided over
    # the data-parallel ranks); forward-only passes fall back on it (meshrl.config.micro_batching).
    ppo_micro_batch_size: Optional[int] = None
    ppo_micro_batch_size_per_gpu: Optional[int] = None
    use_dynamic_bsz: bool = True
    ppo_max_token_len_per_gpu: int = 16384
    grad_clip: float = 1.0
    clip_ratio: float = 0.2
    clip_ratio_low: Optional[float] = None  # None: clip_ratio
    clip_ratio_high: Optional[float] = None  # None: clip_ratio
    clip_ratio_c: float = 3.0
    loss_agg_mode: str = "token-mean"
    # seq-mean-token-sum-norm's divisor (verl's key); None: the response width (run_plan.UpdateSchedule.loss_scale)
    loss_scale_factor: Optional[int] = None
    entropy_coeff: float = 0.0
    tau_pos: float = 1.0  # sapo: the temperature of the gate for A > 0
    tau_neg: float = 1.05  # sapo: the temperature of the gate for A <= 0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    ppo_epochs: int = 1
    shuffle: bool = False
    # verl's key: the old-log-prob pass also gives each response token's Σ_v π_v² (sum_pi_squared), which the
    # optimal_token_baseline estimators read (they require it); off, it costs nothing (run_plan)
    calculate_sum_pi_squared: bool = False
    # verl's key (its default True compiles the FSDP entropy): meshrl compiles the layers' norms, SwiGLU and
    # rotary (meshrl.parallel.compiled); off by default, as measured on CPU (bench/compile.py)
    use_torch_compile: bool = False
    # meshrl's key (verl has none for it): when the update is exactly on-policy (one epoch, one
    # mini-batch, no KL in the reward) skip the old-log-prob forward pass and use logπ_θ.detach() in
    # its place (ratio 1, same gradient); False always recomputes (see run_plan.on_policy_update).
    skip_on_policy_old_log_prob: bool = True
    # verl's key, which its code reads nowhere (its fully async config sets it True); the engine's log-probs are the
    # old ones with algorithm.rollout_correction.bypass_mode (key_policy: inert)
    use_rollout_log_probs: bool = False
    # verl's memory savers of its FSDP actor (Ulysses sequence parallelism, entropy recompute, fixed-length
    # padding) and its entropy chunking: no effect on meshrl's numbers (key_policy)
    ulysses_sequence_parallel_size: int = 1
    entropy_from_logits_with_chunking: bool = False
    entropy_checkpointing: bool = False
    pad_to_length: bool = False
    freeze_vision_tower: bool = False  # a vision-language model's tower untrained (model_builder.build_model)
    profiler: ProfilerConfig = field(default_factory=ProfilerConfig)
    veomni: Dict[str, Any] = field(default_factory=dict)  # verl's VeOmni engine section; refused
    policy_loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    megatron: MegatronConfig = field(default_factory=MegatronConfig)
    fsdp_config: FSDPCompatConfig = field(default_factory=FSDPCompatConfig)
    checkpoint: CheckpointContentsConfig = field(default_factory=CheckpointContentsConfig)
    calculate_entropy: bool = False
    data_loader_seed: int = 42
    entropy_from_logits_chunk_size: int = 2048
    load_weight: bool = True
    sum_pi_squared_checkpointing: bool = False
    # verl's default is False (its FSDP-only PrefixGrouper); meshrl's None: on wherever the model runs the shared-prompt
    # layout (meshrl.parallel.shared_prefix: the same numbers, a group's prompt computed once); False: off
    use_prefix_grouper: bool | None = None
    router_replay: RouterReplayConfig = field(default_factory=RouterReplayConfig)  # verl's FSDP actor's home of it
    qat: QATConfig = field(default_factory=QATConfig)
    # verl's copies of other keys (its defaults interpolate them): refused set apart from those
    rollout_n: int = II("actor_rollout_ref.rollout.n")
    use_fused_kernels: bool = II("actor_rollout_ref.model.use_fused_kernels")
    use_remove_padding: bool = II("actor_rollout_ref.model.use_remove_padding")
    # verl's router-replay script sets the training backend here too (verl reads the top-level key)
    model_engine: str = II("model_engine")


@dataclass
class RefConfig:
    strategy: str = "megatron"
    use_torch_compile: Optional[bool] = None  # None: actor.use_torch_compile (verl's oc.select)
    log_prob_micro_batch_size: Optional[int] = None
    log_prob_micro_batch_size_per_gpu: Optional[int] = None
    log_prob_use_dynamic_bsz: Optional[bool] = None  # None: actor.use_dynamic_bsz
    log_prob_max_token_len_per_gpu: Optional[int] = None  # None: actor.ppo_max_token_len_per_gpu
    ulysses_sequence_parallel_size: int = 1
    entropy_from_logits_with_chunking: bool = False
    entropy_checkpointing: bool = False
    profiler: ProfilerConfig = field(default_factory=ProfilerConfig)
    veomni: Dict[str, Any] = field(default_factory=dict)
    megatron: MegatronConfig = field(default_factory=MegatronConfig)
    fsdp_config: FSDPCompatConfig = field(default_factory=FSDPCompatConfig)
    entropy_from_logits_chunk_size: int = 2048
    load_weight: bool = True
    pad_to_length: bool = False
    router_replay: RouterReplayConfig = field(default_factory=RouterReplayConfig)
    rollout_n: int = II("actor_rollout_ref.rollout.n")  # verl's copy of it: refused set apart from it


@dataclass
class ValKwargsConfig:
    top_k: int = -1
    top_p: float = 1.0
    temperature: float = 0.0
    n: int = 1
    do_sample: bool = False


@dataclass
class EngineKwargsConfig:
    """verl's ``rollout.engine_kwargs``: extra engine arguments per inference engine. ``vllm.*`` go to vLLM's
    ``EngineArgs`` (a None value leaves the argument unset, as in verl); meshrl refuses arguments it sets
    from its own keys, and the other engines' sections (``meshrl.rollout.engines.unsupported_rollout_features``)."""

    vllm: Dict[str, Any] = field(default_factory=dict)
    sglang: Dict[str, Any] = field(default_factory=dict)
    trtllm: Dict[str, Any] = field(default_factory=dict)


@dataclass
class MultiTurnConfig:
    """verl's ``rollout.multi_turn`` (both verl versions' keys): ``enable`` runs the multi-turn tool-calling
    rollout (``meshrl.rollout.agent_loop``) with the tools of ``tool_config_path`` and ``function_tool_path``
    and the interactions of ``interaction_config_path`` (``meshrl.rollout.interactions``); SGLang's repeats are
    refused (``meshrl.config.key_policy``)."""

    enable: bool = False
    max_assistant_turns: Optional[int] = None
    tool_config_path: Optional[str] = None
    function_tool_path: Optional[str] = None
    max_user_turns: Optional[int] = None
    max_parallel_calls: int = 1
    max_tool_response_length: int = 256
    tool_response_truncate_side: str = "middle"
    interaction_config_path: Optional[str] = None
    use_inference_chat_template: bool = False
    tokenization_sanity_check_mode: str = "strict"
    format: str = "hermes"
    num_repeat_rollouts: Optional[int] = None


@dataclass
class CustomAsyncServerConfig:
    path: Optional[str] = None
    name: Optional[str] = None


@dataclass
class AgentLoopConfig:
    """verl's ``rollout.agent`` (its agent-loop workers and servers), so verl scripts parse: meshrl runs the
    agent loop inside each engine replica (``rollout.mode=async``: one coroutine per sample), and any value
    other than these defaults is refused."""

    num_workers: int = 8
    default_agent_loop: str = "single_turn_agent"
    agent_loop_config_path: Optional[str] = None
    custom_async_server: CustomAsyncServerConfig = field(default_factory=CustomAsyncServerConfig)
    agent_loop_manager_class: Optional[str] = None


@dataclass
class CheckpointEngineConfig:
    """verl's ``rollout.checkpoint_engine``: how weights reach the rollout engine. meshrl syncs them in
    process to its colocated engine (verl's ``naive`` backend); the other backends are refused."""

    backend: str = "naive"
    # verl's newer name of rollout.update_weights_bucket_megabytes, which follows it; meshrl's default
    # (verl's is 2048).
    update_weights_bucket_megabytes: int = 512
    engine_kwargs: Dict[str, Any] = field(default_factory=dict)
    custom_backend_module: Optional[str] = None


@dataclass
class DisaggregationConfig:
    """verl's prefill / decode disaggregation of the rollout engine (refused)."""

    enabled: bool = False
    prefill_replicas: int = 1
    decode_replicas: int = 1
    decode_tensor_model_parallel_size: Optional[int] = None
    transfer_backend: str = "nixl"
    bootstrap_port: Optional[int] = None
    ib_device: Optional[str] = None


@dataclass
class PrometheusConfig:
    """verl's Prometheus export of the rollout engine's metrics (refused)."""

    enable: bool = False
    port: int = 9090
    file: str = "/tmp/ray/session_latest/metrics/prometheus/prometheus.yml"
    served_model_name: Optional[str] = None


@dataclass
class RolloutTraceConfig:
    """verl's rollout tracing (weave / mlflow; refused)."""

    backend: Optional[str] = None
    token2text: bool = False
    max_samples_per_step_per_worker: Optional[int] = None
    project_name: Optional[str] = None
    experiment_name: Optional[str] = None


def _layer_name_map() -> Dict[str, Any]:
    return {"qkv_layer_name": "qkv", "gate_proj_layer_name": "gate_up"}


@dataclass
class RolloutConfig:
    name: str = "vllm"
    mode: str = "sync"
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    do_sample: bool = True
    n: int = 1
    seed: int = 0
    prompt_length: Optional[int] = None  # None: data.max_prompt_length
    response_length: Optional[int] = None  # None: data.max_response_length
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on GPU
    gpu_memory_utilization: float = 0.5
    kv_cache_memory_bytes: Optional[int] = None  # CPU engines need it explicit; None: 1 GiB on CPU
    ignore_eos: bool = False
    enforce_eager: bool = True
    free_cache_engine: bool = True
    # verl's RolloutConfig field (its scripts add it with +): False builds the engine without sleep mode, so it never
    # sleeps between rollouts whatever free_cache_engine says (EngineConfig.from_rollout)
    enable_sleep_mode: bool = True
    # The engine's first weights (meshrl.rollout.base.LOAD_FORMATS): auto | hf | safetensors | pt read the
    # model folder; dummy (and verl's dummy_megatron / dummy_hf / dummy_dtensor) starts from random weights
    # that the policy worker's first weight sync replaces at start-up (verl's default: no second read of the folder).
    load_format: str = "dummy"
    tensor_model_parallel_size: int = 1
    max_num_batched_tokens: int = 8192
    max_model_len: Optional[int] = None
    max_num_seqs: int = 1024
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True  # vLLM reuses the KV cache of shared prompt prefixes (same outputs)
    disable_log_stats: bool = True
    calculate_log_probs: bool = False
    # Which log-probs of the sampled tokens the engine returns (rollout_log_probs): processed_logprobs
    # (verl's default; after temperature, top-k, top-p) or raw_logprobs (temperature 1); see meshrl.rollout.
    logprobs_mode: str = "processed_logprobs"
    log_prob_micro_batch_size: Optional[int] = None
    log_prob_micro_batch_size_per_gpu: Optional[int] = None
    log_prob_use_dynamic_bsz: Optional[bool] = None
    log_prob_max_token_len_per_gpu: Optional[int] = None
    update_weights_bucket_megabytes: int = 512  # follows checkpoint_engine's in a loaded config (_rollout_section)
    checkpoint_engine: CheckpointEngineConfig = field(default_factory=CheckpointEngineConfig)
    data_parallel_size: int = 1  # inert: every training process hosts rollout (key_policy)
    # verl's standalone rollout pool (its V1 separate_async mode; one-step-off and fully async copy the top-level
    # rollout section's here): nodes > 0 is asynchronous training, refused (meshrl.config.async_keys). verl's
    # n_gpus_per_node default follows trainer.n_gpus_per_node; it sizes nothing at nnodes=0.
    nnodes: int = 0
    n_gpus_per_node: int = 8
    layered_summon: bool = False  # verl's FSDP LoRA weight collection; inert
    multi_stage_wake_up: bool = False  # meshrl always wakes weights, syncs, then the KV cache; inert
    # verl's mixture-of-experts rollout keys: vLLM's expert parallelism (1 or the rollout's TP); moe_tensor_parallel_
    # size is TensorRT-LLM's, refused (key_policy)
    expert_parallel_size: int = 1
    moe_tensor_parallel_size: int = 1
    enable_rollout_routing_replay: bool = False
    val_kwargs: ValKwargsConfig = field(default_factory=ValKwargsConfig)
    engine_kwargs: EngineKwargsConfig = field(default_factory=EngineKwargsConfig)
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    agent: AgentLoopConfig = field(default_factory=AgentLoopConfig)
    # verl's engine keys of features meshrl's engine does not have, or does not need (key_policy says which)
    over_sample_rate: float = 0.0
    scheduling_policy: Optional[str] = "fcfs"
    quantization: Optional[str] = None
    quantization_config_file: Optional[str] = None
    skip_tokenizer_init: bool = True
    pipeline_model_parallel_size: int = 1
    cudagraph_capture_sizes: Optional[List[int]] = None
    full_determinism: bool = False
    moe_load_balance_metrics_interval: int = 0
    standalone_gpu_memory_utilization: Optional[float] = None
    skip_rollout: bool = False
    skip_dump_dir: str = "/tmp/rollout_dump"
    layer_name_map: Dict[str, Any] = field(default_factory=_layer_name_map)
    qat: Optional[Dict[str, Any]] = None  # verl's copy of the actor's qat section
    mtp: Optional[Dict[str, Any]] = None  # verl's copy of model.mtp
    disaggregation: DisaggregationConfig = field(default_factory=DisaggregationConfig)
    prometheus: PrometheusConfig = field(default_factory=PrometheusConfig)
    trace: RolloutTraceConfig = field(default_factory=RolloutTraceConfig)
    profiler: ProfilerConfig = field(default_factory=ProfilerConfig)


def _actor_section() -> ActorConfig:
    # SAPO's temperatures follow their policy_loss spelling unless set themselves (see PolicyLossConfig).
    return ActorConfig(tau_pos=II(".policy_loss.tau_pos"), tau_neg=II(".policy_loss.tau_neg"))


def _rollout_section() -> RolloutConfig:
    # The bucket size meshrl reads follows verl's newer name unless set itself (key_policy.ALIASES refuses
    # the two set apart). Here rather than in RolloutConfig's default: that section is also built alone.
    return RolloutConfig(update_weights_bucket_megabytes=II(".checkpoint_engine.update_weights_bucket_megabytes"))


@dataclass
class ActorRolloutRefConfig:
    hybrid_engine: bool = True
    # The torch.distributed timeout (seconds) of the workers' process groups, policy and critic (verl's key;
    # verl's critic has its own): a collective that waits longer on a dead or stuck peer fails. The driver
    # waits trainer.worker_timeout_s for each worker call, so a hung step fails after the smaller of the two.
    nccl_timeout: int = 600
    model: ModelConfig = field(default_factory=ModelConfig)
    actor: ActorConfig = field(default_factory=_actor_section)
    ref: RefConfig = field(default_factory=RefConfig)
    rollout: RolloutConfig = field(default_factory=_rollout_section)
    # the older verl's fully async config's copy of async_training.checkpoint_engine (inert, as that section)
    checkpoint_engine: Optional[Dict[str, Any]] = None


@dataclass
class CriticModelConfig:
    path: Optional[str] = None  # None: the actor's model
    tokenizer_path: Optional[str] = None
    trust_remote_code: bool = False  # as actor_rollout_ref.model.trust_remote_code, for the critic's model folder
    use_remove_padding: bool = True
    enable_gradient_checkpointing: bool = False
    override_config: Dict[str, Any] = field(default_factory=dict)
    # verl's critic FSDP section (its older place); the offload flags are the critic's offload
    fsdp_config: FSDPCompatConfig = field(default_factory=FSDPCompatConfig)
    # verl's model keys the critic shares with the policy's (key_policy: refused or FSDP-only)
    external_lib: Optional[str] = None
    custom_chat_template: Optional[str] = None
    hf_config_path: Optional[str] = None
    use_shm: bool = False
    use_liger: bool = False
    use_fused_kernels: bool = False
    enable_activation_offload: bool = False
    fused_kernel_options: Dict[str, Any] = field(default_factory=lambda: {"impl_backend": "torch"})
    tiled_mlp: TiledMLPConfig = field(default_factory=TiledMLPConfig)
    mtp: MTPConfig = field(default_factory=MTPConfig)
    lora_rank: int = 0
    lora_alpha: int = 16
    target_modules: Any = "all-linear"
    exclude_modules: Any = None
    lora_adapter_path: Optional[str] = None
    lora: LoraConfig = field(default_factory=LoraConfig)


@dataclass
class CriticConfig:
    strategy: str = "megatron"
    # verl's explicit critic switch; None: the estimator decides (gae trains one). A value that disagrees
    # with the estimator is refused.
    enable: Optional[bool] = None
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    model: CriticModelConfig = field(default_factory=CriticModelConfig)
    ppo_mini_batch_size: Optional[int] = None  # None: actor's
    ppo_micro_batch_size: Optional[int] = None
    ppo_micro_batch_size_per_gpu: Optional[int] = None
    forward_micro_batch_size_per_gpu: Optional[int] = None
    use_dynamic_bsz: Optional[bool] = None  # None: actor's
    ppo_max_token_len_per_gpu: int = 32768
    forward_max_token_len_per_gpu: Optional[int] = None  # None: ppo_max_token_len_per_gpu
    ppo_epochs: Optional[int] = None  # None: actor's
    shuffle: Optional[bool] = None  # None: actor's
    grad_clip: float = 1.0
    cliprange_value: float = 0.5
    loss_agg_mode: Optional[str] = None  # None: actor's
    loss_scale_factor: Optional[int] = None  # None: actor's (verl's oc.select), then the response width
    ulysses_sequence_parallel_size: int = 1
    profiler: ProfilerConfig = field(default_factory=ProfilerConfig)
    megatron: MegatronConfig = field(default_factory=MegatronConfig)
    fsdp_config: FSDPCompatConfig = field(default_factory=FSDPCompatConfig)
    fsdp: FSDPCompatConfig = field(default_factory=FSDPCompatConfig)  # verl-project's name of the critic's FSDP section
    checkpoint: CheckpointContentsConfig = field(default_factory=CheckpointContentsConfig)
    data_loader_seed: int = 42
    load_weight: bool = True
    # verl's copies of other keys (its defaults interpolate them; meshrl's critic ranks time out at
    # actor_rollout_ref.nccl_timeout): refused set apart from those
    rollout_n: int = II("actor_rollout_ref.rollout.n")
    forward_micro_batch_size: Optional[int] = II("critic.ppo_micro_batch_size")
    nccl_timeout: int = II("actor_rollout_ref.nccl_timeout")


@dataclass
class RewardModelRolloutConfig:
    """verl's ``reward_model.rollout``: the vLLM server of a generative reward model (``meshrl.rewards.judge``,
    which lists what is read); a discriminative one runs as a Megatron role and reads none of it."""

    name: Optional[str] = None
    dtype: str = "bfloat16"
    gpu_memory_utilization: float = 0.5
    enforce_eager: bool = True
    free_cache_engine: bool = True
    data_parallel_size: int = 1
    expert_parallel_size: int = 1
    tensor_model_parallel_size: int = 2
    max_num_batched_tokens: int = 8192
    max_model_len: Optional[int] = None
    max_num_seqs: int = 1024
    load_format: str = "auto"
    engine_kwargs: Dict[str, Any] = field(default_factory=dict)
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    disable_log_stats: bool = True
    skip_tokenizer_init: bool = False
    prompt_length: int = 2048
    response_length: int = 2048
    seed: int = 42
    kv_cache_memory_bytes: Optional[int] = None  # meshrl's: the judge's KV cache on CPU (null: 1 GiB)
    # verl-project's keys of its reward engine (key_policy: the sampling ones are inert, the rest as the policy's)
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    do_sample: bool = True
    n: int = 1
    ignore_eos: bool = False
    full_determinism: bool = False
    layered_summon: bool = False
    multi_stage_wake_up: bool = False
    limit_images: Optional[int] = None
    pipeline_model_parallel_size: int = 1
    quantization: Optional[str] = None
    quantization_config_file: Optional[str] = None
    scheduling_policy: Optional[str] = "fcfs"
    cudagraph_capture_sizes: Optional[List[int]] = None
    mtp: Optional[Dict[str, Any]] = None
    disaggregation: DisaggregationConfig = field(default_factory=DisaggregationConfig)


@dataclass
class SandboxFusionConfig:
    """verl-project's ``reward.sandbox_fusion``, followed by ``reward_model.sandbox_fusion`` (which meshrl reads)."""

    url: Optional[str] = None
    max_concurrent: int = 64
    memory_limit_mb: int = 1024


@dataclass
class RewardModelSandboxConfig:
    """Where code rewards run (``meshrl.rewards.code``): a SandboxFusion ``/run_code`` URL, or null for a local
    sandbox the run starts when its data holds code; programs in flight at once; memory per program. Each
    follows verl-project's ``reward.sandbox_fusion`` unless set itself."""

    url: Optional[str] = II("reward.sandbox_fusion.url")
    max_concurrent: int = II("reward.sandbox_fusion.max_concurrent")
    memory_limit_mb: int = II("reward.sandbox_fusion.memory_limit_mb")


@dataclass
class RewardModelModelConfig:
    """verl's ``reward_model.model``: a discriminative reward model, an HF ``*ForSequenceClassification``
    checkpoint with one label (``meshrl.workers.reward_model``)."""

    path: Optional[str] = II("reward.reward_model.model_path")  # follows verl-project's name unless set itself
    # verl: the tokenizer the responses are decoded with before the reward model's chat template renders them
    # (its default: the policy's); meshrl always decodes with the policy's tokenizer, which produced them (inert)
    input_tokenizer: Optional[str] = None
    trust_remote_code: bool = False
    external_lib: Optional[str] = None
    override_config: Dict[str, Any] = field(default_factory=dict)
    use_remove_padding: bool = True
    fsdp_config: FSDPCompatConfig = field(default_factory=FSDPCompatConfig)
    use_shm: bool = False
    use_fused_kernels: bool = False


@dataclass
class RewardModelConfig:
    # A learned (discriminative) reward model scores every response in place of the rule-based reward function;
    # with custom_reward_function.path the function scores and reads the model's score as extra_info["rm_score"].
    # Follows verl-project's reward.reward_model.enable unless set itself.
    enable: bool = II("reward.reward_model.enable")
    # naive | prime | gdpo (meshrl's reward pool is each of them); follows verl's reward.reward_manager.name
    reward_manager: str = II("reward.reward_manager.name")
    # verl's overlap: the reward function scores in the background while the reference / old-log-prob / value
    # passes run (meshrl.trainer.rl_trainer.RLTrainer.start_scoring)
    launch_reward_fn_async: bool = False
    num_workers: int = II("reward.num_workers")  # reward processes; 0: in the driver, where no timeout cuts in
    timeout_s: float = 10.0  # per response, in batches of every size; a timeout scores 0 and is counted
    # A score that is NaN, infinite or beyond float32 (where the trainer holds scores): skip scores it 0, counts
    # it (reward/num_nonfinite) and warns naming the function and the value; stop ends the run with that message.
    on_nonfinite_score: str = "skip"
    # Stop after this many scored batches in a row in which every reward call failed (raised, timed out or
    # returned a non-finite score): the run would train on all-zero scores. A training step scores one batch
    # (ReMax two), validation one per val batch; a systematic failure (a broken reward file) fails every batch
    # and costs two wasted steps, while one failed batch can be transient (a busy machine timing out a few
    # responses). 0: never stop.
    max_failed_batches: int = 3
    strategy: str = "megatron"
    model: RewardModelModelConfig = field(default_factory=RewardModelModelConfig)
    # verl: a separate GPU pool for the reward model; meshrl colocates it with the policy (refused when True)
    enable_resource_pool: bool = False
    n_gpus_per_node: int = 0
    nnodes: int = 0
    load_weight: bool = True
    megatron: MegatronConfig = field(default_factory=MegatronConfig)
    use_dynamic_bsz: Optional[bool] = None  # None: the critic's (verl interpolates ${critic.use_dynamic_bsz})
    forward_max_token_len_per_gpu: Optional[int] = None  # None: the critic's forward budget
    # verl's reward loop scores in workers beside the rollout, its legacy path in the trainer: the
    # same rule scores, which meshrl computes in its own process pool (inert)
    use_reward_loop: bool = True
    micro_batch_size: Optional[int] = None
    micro_batch_size_per_gpu: Optional[int] = None
    max_length: Optional[int] = None
    rollout: RewardModelRolloutConfig = field(default_factory=RewardModelRolloutConfig)
    sandbox_fusion: RewardModelSandboxConfig = field(default_factory=RewardModelSandboxConfig)
    reward_kwargs: Dict[str, Any] = field(default_factory=dict)  # a reward manager's arguments (DAPO's overlong buffer)
    profiler: ProfilerConfig = field(default_factory=ProfilerConfig)
    ulysses_sequence_parallel_size: int = 1
    reward_loop_source: Optional[str] = None
    reward_loop_module_path: Optional[str] = None
    reward_loop_class_name: Optional[str] = None
    nccl_timeout: int = II("actor_rollout_ref.nccl_timeout")  # verl's own: refused set apart from the policy's


@dataclass
class CustomRewardFunctionConfig:
    # path and name follow verl's newer reward.custom_reward_function unless set themselves
    path: Optional[str] = II("reward.custom_reward_function.path")
    name: str = II("reward.custom_reward_function.name")
    reward_kwargs: Dict[str, Any] = field(default_factory=dict)


@dataclass
class RewardFunctionConfig:
    path: Optional[str] = None
    name: str = "compute_score"


@dataclass
class RewardManagerModuleConfig:
    path: Optional[str] = None
    name: str = "custom_reward_manager"


@dataclass
class RewardManagerConfig:
    source: str = "register"
    name: str = "naive"
    module: RewardManagerModuleConfig = field(default_factory=RewardManagerModuleConfig)


@dataclass
class LearnedRewardModelConfig:
    enable: bool = False
    enable_resource_pool: bool = False
    n_gpus_per_node: int = 8
    nnodes: int = 0
    model_path: Optional[str] = None
    rollout: RewardModelRolloutConfig = field(default_factory=RewardModelRolloutConfig)


@dataclass
class RewardConfig:
    """verl-project's ``reward`` section, its newer home of the reward keys. ``num_workers`` and
    ``custom_reward_function`` are the older keys' other names (``reward_model.num_workers``,
    ``custom_reward_function.*`` follow them), and so is ``sandbox_fusion`` (``reward_model.sandbox_fusion``);
    ``reward_manager.name`` is ``reward_model.reward_manager``'s (naive, prime or gdpo); other reward managers and
    learned reward models are refused."""

    num_workers: int = 2  # meshrl's default (verl's is 8)
    custom_reward_function: RewardFunctionConfig = field(default_factory=RewardFunctionConfig)
    reward_manager: RewardManagerConfig = field(default_factory=RewardManagerConfig)
    reward_model: LearnedRewardModelConfig = field(default_factory=LearnedRewardModelConfig)
    sandbox_fusion: SandboxFusionConfig = field(default_factory=SandboxFusionConfig)
    reward_kwargs: Dict[str, Any] = field(default_factory=dict)


@dataclass
class KLControlConfig:
    type: str = "fixed"
    kl_coef: float = 0.001
    horizon: int = 10000
    target_kl: float = 0.1


@dataclass
class GPGConfig:
    # "paper": α = B/(B−M), M = responses in zero-signal groups (the GPG paper); "verl": α = B/#nonzero.
    alpha_mode: str = "paper"
    # True: F_norm = std of the group; False: F_norm = 1.
    norm_by_std: bool = True


@dataclass
class ReMaxConfig:
    # Outcome scores clipped to ±reward_clip before the KL penalty and the advantages (the ReMax paper
    # uses 5); <=0: off. With remax, the sampled scores and the greedy baseline's both; with any other
    # estimator (the key lives here, but is not remax-only), the sampled scores.
    reward_clip: float = 0.0


@dataclass
class RolloutCorrectionConfig:
    """verl's importance sampling and rejection of tokens against the rollout engine's log-probs, and its bypass
    mode (``meshrl.algorithms.rollout_correction``; the trainer's side ``meshrl.trainer.rollout_correction``)."""

    rollout_is: Optional[str] = None  # null | token | sequence: IS weights on the policy loss
    rollout_is_threshold: Any = 2.0  # U (truncation), or verl's "L_U" string (IcePop: weights outside [L, U] are 0)
    rollout_rs: Optional[str] = None  # rejection: token_k1 .. seq_max_k3, several separated by commas
    rollout_rs_threshold: Any = None  # one for all options or one per option; k1: "L_U" or U (L = 1/U)
    bypass_mode: bool = False  # old_log_probs := the engine's (no recompute); loss bypass_mode
    loss_type: str = "ppo_clip"  # bypass mode's loss: ppo_clip | reinforce (−A·logπ·w)
    rollout_is_batch_normalize: bool = False  # weights / their batch mean


@dataclass
class FilterGroupsConfig:
    """DAPO's dynamic sampling (refused)."""

    enable: bool = False
    metric: Optional[str] = None
    max_num_gen_batches: int = 0
    max_inflight_gen_batches: int = 1


@dataclass
class PFPPOConfig:
    reweight_method: str = "pow"
    weight_pow: float = 2.0


@dataclass
class AlgorithmConfig:
    gamma: float = 1.0
    lam: float = 1.0
    adv_estimator: str = "gae"
    norm_adv_by_std_in_grpo: bool = True
    use_kl_in_reward: bool = False
    kl_penalty: str = "kl"
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    use_pf_ppo: bool = False
    pf_ppo: PFPPOConfig = field(default_factory=PFPPOConfig)
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    gpg: GPGConfig = field(default_factory=GPGConfig)
    remax: ReMaxConfig = field(default_factory=ReMaxConfig)
    # gdpo: the reward components, by the names of the reward function's returned dict (beside "score"), each
    # normalised in its group on its own; required with adv_estimator=gdpo (verl's keys and defaults)
    gdpo_reward_keys: Optional[List[str]] = None
    gdpo_reward_weights: Optional[List[float]] = None  # one per key; None: all 1
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)


@dataclass
class HybridRolloutSwitchConfig:
    """verl's ``trainer.v1.separate_async.hybrid_rollout``: lending idle trainer GPUs to rollout (refused)."""

    enable_switch: bool = False
    switch_threshold_ratio: float = 0.4
    adaptive_switch_threshold: bool = True
    switch_threshold_step_up: float = 0.05
    switch_threshold_step_down: float = 0.03
    switch_threshold_release_steps: int = 2
    switch_cost_window_size: int = 3


@dataclass
class ColocateAsyncConfig:
    num_warmup_batches: int = 1


@dataclass
class SeparateAsyncConfig:
    num_warmup_batches: int = 1
    parameter_sync_step: int = 4
    hybrid_rollout: HybridRolloutSwitchConfig = field(default_factory=HybridRolloutSwitchConfig)


@dataclass
class CustomSamplerConfig:
    path: Optional[str] = None
    name: Optional[str] = None


@dataclass
class V1SamplerConfig:
    """verl's ``trainer.v1.sampler`` (its replay buffer): the off-policy limits act in its asynchronous modes only."""

    max_off_policy_threshold: int = 8
    max_off_policy_strategy: str = "drop"  # drop | wait
    sync_refill_failed_groups: bool = False
    custom_sampler: CustomSamplerConfig = field(default_factory=CustomSamplerConfig)
    sampler_kwargs: Dict[str, Any] = field(default_factory=dict)


@dataclass
class TrainerV1Config:
    """verl's ``trainer.v1``: its V1 trainer's mode (``sync``, meshrl's; ``colocate_async`` and ``separate_async``
    are refused: ``meshrl.config.async_keys``) and each mode's settings."""

    trainer_mode: str = "sync"
    sync: Dict[str, Any] = field(default_factory=dict)
    colocate_async: ColocateAsyncConfig = field(default_factory=ColocateAsyncConfig)
    separate_async: SeparateAsyncConfig = field(default_factory=SeparateAsyncConfig)
    sampler: V1SamplerConfig = field(default_factory=V1SamplerConfig)


@dataclass
class AsyncCheckpointEngineConfig:
    """The older verl's ``async_training.checkpoint_engine`` (parameter sync between trainer and rollouter)."""

    enable: bool = True
    device_buffer_size_M: int = 4096
    overlap_broadcast_and_consume: bool = False


@dataclass
class AsyncTrainingConfig:
    """verl's ``async_training``, which only its fully async trainer's config has, with that config's defaults
    (``fully_async_ppo_trainer.yaml``; the older verl's keys too, so its scripts parse). Read by meshrl's fully async
    trainer (``meshrl.trainer.async_trainer``, its sample queue: ``meshrl.trainer.sample_queue.StalenessBudget``);
    in a run of another trainer any of its keys is refused (``meshrl.config.async_keys``)."""

    staleness_threshold: float = 0.1
    trigger_parameter_sync_step: int = 4
    require_batches: int = 1
    partial_rollout: bool = True
    use_trainer_do_validate: bool = False
    use_dynamic_resource_scheduling: bool = False
    dynamic_schedule_policy: str = "default"
    dynamic_schedule_deactivate_ratio: float = 0.3
    dynamic_schedule_enable_rebalance: bool = True
    concurrent_samples_per_replica: int = 16
    # the older verl's (volcengine/verl) keys
    use_rollout_log_probs: bool = True
    compute_prox_log_prob: bool = False
    checkpoint_engine: AsyncCheckpointEngineConfig = field(default_factory=AsyncCheckpointEngineConfig)


@dataclass
class StandaloneRolloutConfig:
    """verl's top-level ``rollout``, which only its one-step-off and fully async configs have: the rollouter's own
    GPUs and the fully async run's length, with those configs' defaults (the older verl's ``total_epochs`` and
    ``test_freq`` too). Any of its keys asks for asynchronous training (``meshrl.config.async_keys``)."""

    nnodes: int = 1
    n_gpus_per_node: int = 8
    n: int = 4
    total_rollout_steps: Optional[int] = 100  # samples (prompts) to generate in all; verl's TODO renames it so
    total_epochs: int = 10
    test_freq: int = 1


@dataclass
class TrainerConfig:
    balance_batch: bool = True
    total_epochs: int = 30
    total_training_steps: Optional[int] = None
    project_name: str = "meshrl"
    experiment_name: str = "run"
    logger: List[str] = field(default_factory=lambda: ["console", "jsonl"])
    log_val_generations: int = 0
    nnodes: int = 1
    n_gpus_per_node: int = 8  # on CPU: training processes per node
    device: str = "auto"
    save_freq: int = -1
    resume_mode: str = "auto"
    resume_from_path: Optional[str] = None
    test_freq: int = -1
    critic_warmup: int = 0
    # A policy or critic update whose loss is NaN / inf: stop at once (before backward, nothing applied), or
    # skip the update (counted in <role>/skipped_updates and <role>/nonfinite_losses). A non-finite loss means
    # broken inputs (advantages, log-probs) or weights, which the next update would meet again.
    on_nonfinite_loss: str = "stop"
    # An update whose gradient norm is NaN / inf (over the whole model, so every rank agrees): skip it, as
    # megatron does under a loss scale (counted in <role>/skipped_updates; the LR schedule still advances), or
    # stop with the weights as they were.
    on_nonfinite_grad_norm: str = "skip"
    # The train/rollout log-prob alarm (meshrl.trainer.alarms): the engine must serve the policy the trainer
    # evaluates. The first checked step of a run and of every resume stops (stop), warns (warn) or passes (ignore)
    # when the token-mean |old_log_probs - rollout_log_probs| exceeds mismatch_tolerance; later steps do so on a
    # jump of that mean against its own recent history. verl has no such key (it logs
    # training/rollout_probs_diff_*; its algorithm.rollout_correction reweights the loss instead).
    on_mismatch: str = "stop"
    # None: by precision (meshrl.config.run_plan.MISMATCH_TOLERANCES): 1e-3 when trainer and engine both
    # compute in float32, 0.2 when either is 16-bit.
    mismatch_tolerance: Optional[float] = None
    val_before_train: bool = True
    val_only: bool = False
    default_local_dir: str = "checkpoints/${trainer.project_name}/${trainer.experiment_name}"
    max_actor_ckpt_to_keep: Optional[int] = None
    max_critic_ckpt_to_keep: Optional[int] = None
    rollout_data_dir: Optional[str] = None  # each training step's generations as <dir>/<step>.jsonl
    validation_data_dir: Optional[str] = None  # each validation's generations as <dir>/<step>.jsonl
    ray_wait_register_center_timeout: int = 300
    use_legacy_worker_impl: str = "auto"  # verl's choice between its worker generations; inert
    # the driver's wait for each worker call: a dead worker fails the step this fast (collectives time out at
    # actor_rollout_ref.nccl_timeout)
    worker_timeout_s: float = 600.0
    # SIGTERM (a scheduler's preemption): finish and save the step in progress, then stop, exit code 143; without
    # it SIGTERM stops at once, as Ctrl-C does (meshrl.trainer.interrupts). verl has no such key.
    save_on_preempt: bool = False
    # Library output (vLLM, Ray, Megatron, transformers, torch) on the console, as the libraries write it, instead
    # of in <default_local_dir>/logs/ (meshrl.logs). verl has no such key (its own loggers read VERL_LOGGING_LEVEL).
    verbose: bool = False
    # verl's HDFS copy of checkpoints, its deletion of the local copy after a load, and its save ahead of a
    # cloud instance's expiry (refused: key_policy says what to do instead)
    default_hdfs_dir: Optional[str] = None
    del_local_ckpt_after_load: bool = False
    esi_redundant_time: float = 0
    seed: int = 1
    # verl's choice between its V0 and V1 trainers (V1 is its default); both synchronous unless trainer.v1 says
    # otherwise: meshrl's trainer is trainer.async_mode's (use_v1: key_policy, inert; trainer.v1: async_keys)
    use_v1: bool = True
    v1: TrainerV1Config = field(default_factory=TrainerV1Config)
    # meshrl's: which trainer drives the run. verl picks it by entry module and --config-name; meshrl reads it from
    # here, set by those config names (one_step_off_ppo[_megatron]_trainer: one_step_off,
    # fully_async_ppo[_megatron]_trainer: fully_async; the default configs of meshrl.trainer.one_step_off_main and
    # fully_async_main; meshrl.trainer.async_trainer). null: the synchronous trainer.
    async_mode: Optional[str] = None


@dataclass
class RayInitConfig:
    """verl's ``ray_kwargs.ray_init``: what meshrl's Ray start takes from it (``meshrl.workers.cluster``)."""

    num_cpus: Optional[int] = None  # None: one per worker process plus two for the driver
    # Ray's runtime_env for every worker: env_vars and py_executable apply; other fields are refused.
    runtime_env: Dict[str, Any] = field(default_factory=dict)


@dataclass
class RayKwargsConfig:
    ray_init: RayInitConfig = field(default_factory=RayInitConfig)
    timeline_json_file: Optional[str] = None  # a finished run writes Ray's timeline (Chrome trace) here


def _global_tool_config() -> Dict[str, Any]:
    return {"nsys": {"discrete": False}, "torch_memory": {"trace_alloc_max_entries": 100000, "stack_depth": 32}}


@dataclass
class GlobalProfilerConfig:
    """verl's ``global_profiler``, so verl scripts parse; inert (meshrl's profiling lives in bench/)."""

    tool: Optional[str] = None
    steps: Optional[List[int]] = None
    profile_continuous_steps: bool = False
    save_path: str = "outputs/profile"
    global_tool_config: Dict[str, Any] = field(default_factory=_global_tool_config)
    finish_hook_cmd: Optional[str] = None
    finish_hook_ranks: List[int] = field(default_factory=list)
    finish_hook_all_ranks: bool = False
    relocate_results: bool = False


@dataclass
class DistillationLossConfig:
    loss_mode: str = "k3"
    topk: int = 32
    use_task_rewards: bool = True
    distillation_loss_coef: float = 1.0
    loss_max_clamp: Optional[float] = None
    log_prob_min_clamp: Optional[float] = None
    use_policy_gradient: bool = False
    policy_loss_mode: str = "vanilla"
    clip_ratio: float = 0.2
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2


@dataclass
class DistillationConfig:
    """verl-project's on-policy distillation from teacher models (refused). ``teacher_models`` maps a teacher's name
    to its settings (verl's example: ``teacher_model``)."""

    enabled: bool = False
    n_gpus_per_node: int = 8
    nnodes: int = 0
    teacher_key: str = "data_source"
    distillation_loss: DistillationLossConfig = field(default_factory=DistillationLossConfig)
    teacher_models: Dict[str, Any] = field(default_factory=dict)


def _transfer_queue_backend() -> Dict[str, Any]:
    return {"storage_backend": "SimpleStorage",
            "SimpleStorage": {"total_storage_size": 100000, "num_data_storage_units": 8},
            "MooncakeStore": {"auto_init": False, "metadata_server": "localhost:50123",
                              "master_server_address": "localhost:50124", "local_hostname": "localhost",
                              "protocol": "tcp", "global_segment_size": 4294967296, "local_buffer_size": 1073741824,
                              "device_name": ""}}


@dataclass
class TransferQueueConfig:
    """verl's TransferQueue data plane (refused)."""

    enable: bool = False
    metrics: Dict[str, Any] = field(default_factory=lambda: {"enabled": False, "port": 0})
    backend: Dict[str, Any] = field(default_factory=_transfer_queue_backend)


@dataclass
class SkipStageConfig:
    enable: bool = False
    dump_dir: str = "~/.verl/rollout_dump"
    steps: List[int] = field(default_factory=list)
    action: str = "cache"


@dataclass
class SkipConfig:
    """verl-project's dump and replay of generated batches (refused)."""

    rollout: SkipStageConfig = field(default_factory=SkipStageConfig)
    rollout_tq: SkipStageConfig = field(default_factory=SkipStageConfig)
    async_rollout: SkipStageConfig = field(default_factory=SkipStageConfig)


@dataclass
class LegacySandboxFusionConfig:
    """verl-project's top-level ``sandbox_fusion``, which its reward loop moves to ``reward.sandbox_fusion`` (refused:
    set that)."""

    url: Optional[str] = None
    max_concurrent: Optional[int] = None
    memory_limit_mb: Optional[int] = None


@dataclass
class MeshRLConfig:
    data: DataConfig = field(default_factory=DataConfig)
    actor_rollout_ref: ActorRolloutRefConfig = field(default_factory=ActorRolloutRefConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    custom_reward_function: CustomRewardFunctionConfig = field(default_factory=CustomRewardFunctionConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    # verl's asynchronous trainers' sections (refused: meshrl.config.async_keys)
    async_training: AsyncTrainingConfig = field(default_factory=AsyncTrainingConfig)
    rollout: StandaloneRolloutConfig = field(default_factory=StandaloneRolloutConfig)
    model_engine: str = "megatron"  # one of MODEL_ENGINES
    ray_kwargs: RayKwargsConfig = field(default_factory=RayKwargsConfig)
    global_profiler: GlobalProfilerConfig = field(default_factory=GlobalProfilerConfig)
    # verl sections of features meshrl does not have (key_policy: refused)
    distillation: DistillationConfig = field(default_factory=DistillationConfig)
    transfer_queue: TransferQueueConfig = field(default_factory=TransferQueueConfig)
    skip: SkipConfig = field(default_factory=SkipConfig)
    sandbox_fusion: LegacySandboxFusionConfig = field(default_factory=LegacySandboxFusionConfig)
    # the older verl's home of reward.reward_manager (its name a copy of reward_model.reward_manager; refused)
    reward_manager: RewardManagerConfig = field(
        default_factory=lambda: RewardManagerConfig(name=II("reward_model.reward_manager")))
