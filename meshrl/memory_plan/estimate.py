"""The estimate of a run (``estimate``): the phases of an RL step and their memory, the step's FLOPs, and the
verdict with the knobs to turn (``judge``)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from meshrl.memory_plan.activations import all_to_all_bytes_per_token
from meshrl.memory_plan.kv_cache import engine_memory, reward_judge_bytes
from meshrl.memory_plan.roles import RoleMemory, any_flag, reward_model_memory, runs_sequence_parallel
from meshrl.memory_plan.units import (BYTES_CPU, BYTES_GPU, FUSED_BYTES_FORWARD, FUSED_BYTES_TRAIN, GIB,
                                      LOGIT_BYTES_ENTROPY, LOGIT_BYTES_FORWARD, LOGIT_BYTES_TRAIN, OVERHEAD_GIB,
                                      PlanError, SUM_PI2_BYTES_FORWARD, gib)
from meshrl.memory_plan.weights import (active_parameters, load_hf_config, lora_parameters, matmul_parameters,
                                        stage_parameters)


@dataclass
class Phase:
    name: str
    items: dict[str, float]  # component -> bytes

    @property
    def total(self) -> float:
        return sum(self.items.values())


@dataclass
class MemoryPlan:
    model: dict[str, Any]
    layout: dict[str, Any]
    stage: dict[str, Any]  # pipeline stages held by the GPU the phases describe (the fullest one)
    phases: list[Phase]
    rollout: dict[str, Any]
    flops: dict[str, float]
    limit_bytes: float
    problems: list[str] = field(default_factory=list)
    advice: list[str] = field(default_factory=list)

    @property
    def peak(self) -> Phase:
        return max(self.phases, key=lambda p: p.total)

    @property
    def fits(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["phases"] = [{"name": p.name, "total_bytes": p.total, "items_bytes": p.items} for p in self.phases]
        out.update(fits=self.fits, peak_phase=self.peak.name, peak_bytes=self.peak.total)
        return out


def estimate(cfg, gpu_memory_gib: float = 80.0) -> MemoryPlan:
    """Estimate ``cfg`` (a loaded, validated config); raises ``PlanError`` for an impossible layout."""
    from meshrl.config.loader import ConfigError
    from meshrl.config.micro_batching import micro_batching
    from meshrl.config.run_plan import build_run_plan
    from meshrl.config.validate import validate_against_model, world_size
    from meshrl.parallel.model_builder import layout_problem_lines, model_spec
    from meshrl.parallel.vision import tower_parameters
    from meshrl.workers.model_setup import transformer_overrides

    arr, actor, rollout, ref, critic_cfg = (cfg.actor_rollout_ref, cfg.actor_rollout_ref.actor,
                                            cfg.actor_rollout_ref.rollout, cfg.actor_rollout_ref.ref, cfg.critic)
    data, trainer = cfg.data, cfg.trainer
    device = "cpu" if trainer.device == "cpu" else "cuda"
    dtype = BYTES_CPU if device == "cpu" else BYTES_GPU  # the rollout engine's (rollout.dtype auto)

    def precision(name: str) -> dict:
        """Byte table of a ``megatron.dtype``; auto follows the device (``model_builder.param_dtype``)."""
        return dtype if name == "auto" else (BYTES_GPU if name == "bfloat16" else BYTES_CPU)

    actor_dtype = precision(actor.megatron.dtype)
    ref_dtype = precision(ref.megatron.dtype) if ref.megatron.dtype != "auto" else actor_dtype
    critic_dtype = precision(critic_cfg.megatron.dtype)
    limit = gpu_memory_gib * GIB
    hf_config = load_hf_config(arr.model.path)
    run = build_run_plan(cfg)  # the roles and widths the trainer will use
    try:
        validate_against_model(cfg, run, hf_config)
        spec = model_spec(hf_config)
    except (ConfigError, ValueError) as exc:
        raise PlanError(str(exc)) from None
    world = world_size(cfg)
    use_ref, use_critic = run.use_reference, run.use_critic
    seq_len = data.max_prompt_length + run.response_length
    vision = tower_parameters(hf_config) if spec.vision else 0  # a vision-language policy's tower

    def trainer_of(section, model_section, model_spec_, is_critic: bool) -> RoleMemory:
        """The role's memory in its run-plan layout (the one its workers initialise)."""
        mg = section.megatron
        layout = run.critic_layout if is_critic else run.actor_layout
        megatron_key = "critic.megatron" if is_critic else "actor_rollout_ref.actor.megatron"
        if problems := layout_problem_lines(model_spec_, layout, megatron_key):
            raise PlanError("; ".join(problems))
        # verl's FSDP sections whose offload flags the workers read (the critic's has three places)
        fsdp = (section.fsdp_config,) + ((section.model.fsdp_config, section.fsdp) if is_critic else ())
        return RoleMemory(spec=model_spec_, tp=layout.tensor, pp=layout.pipeline, vpp=layout.virtual_pipeline or 1,
                          dp=layout.data, cp=layout.context, distributed_optimizer=mg.use_distributed_optimizer,
                          # full-layer recompute, as the workers build it (selective recompute is counted as none)
                          recompute=transformer_overrides(model_section, mg).get("recompute_granularity") == "full",
                          param_offload=any_flag(mg, *fsdp, key="param_offload"),
                          grad_offload=any_flag(mg, key="grad_offload"),
                          optimizer_offload=any_flag(mg, *fsdp, key="optimizer_offload"),
                          critic=is_critic, lora=None if is_critic else run.lora,
                          ep=layout.expert, etp=layout.expert_tensor, sequence_parallel=runs_sequence_parallel(mg),
                          vision_params=0 if is_critic else vision)

    policy = trainer_of(actor, arr.model, spec, False)
    critic = None
    if use_critic:
        critic_spec = spec if not critic_cfg.model.path else model_spec(load_hf_config(critic_cfg.model.path))
        critic = trainer_of(critic_cfg, critic_cfg.model, critic_spec, True)
    ref_offload = any_flag(ref.megatron, ref.fsdp_config, key="param_offload")
    reward_model = reward_model_memory(cfg, run.reward_model_layout) if run.use_reward_model else None
    rm_dtype = precision(cfg.reward_model.megatron.dtype)
    judge_bytes = reward_judge_bytes(cfg, precision, device, limit) if run.reward_judge else 0.0

    # tokens of one micro-batch on one rank: the phase's token budget, or its sequences × the longest sequence, split
    # over the context-parallel ranks
    def budget(phase: str, trained: RoleMemory) -> int:
        rule = micro_batching(cfg, phase, trained.dp)
        return (rule.max_token_len if rule.dynamic else rule.micro_batch_size * seq_len) // trained.cp

    train_tokens, logprob_tokens = budget("actor_update", policy), budget("actor_log_prob", policy)
    ref_tokens = budget("ref_log_prob", policy) if use_ref else 0
    critic_tokens = budget("critic_update", critic) if critic is not None else 0
    values_tokens = budget("critic_values", critic) if critic is not None else 0
    rm_tokens = budget("reward_model", reward_model) if reward_model is not None else 0

    vllm = engine_memory(spec, rollout, dtype, device, limit, seq_len, vision)
    # one process per role on each GPU: the policy's, the critic's and the reward model's
    overhead = OVERHEAD_GIB[device] * GIB * (1 + use_critic + (reward_model is not None))
    vocab_shard = spec.vocab_size // policy.tp
    logit_train = LOGIT_BYTES_TRAIN + (LOGIT_BYTES_ENTROPY if actor.entropy_coeff else 0)
    if actor_dtype is BYTES_CPU:
        logit_train += 2  # fp32 logits instead of bf16
    logit_forward = LOGIT_BYTES_FORWARD + (2 if actor_dtype is BYTES_CPU else 0)
    if run.sum_pi_squared:  # fp32 logits on CPU: .float() copies nothing, the exp is the one temporary
        logit_forward = max(logit_forward, SUM_PI2_BYTES_FORWARD - (2 if actor_dtype is BYTES_CPU else 0))
    chunk = run.fused_chunk_size

    def logits_bytes(tokens: int, train: bool) -> float:
        """The last stage's vocabulary-sized tensors for a micro-batch of ``tokens`` (module docstring)."""
        if chunk is None:
            return (logit_train if train else logit_forward) * tokens * vocab_shard
        if not train:
            return FUSED_BYTES_FORWARD * min(chunk, tokens) * vocab_shard
        return FUSED_BYTES_TRAIN * min(chunk, tokens) * vocab_shard + 4 * vocab_shard * spec.hidden_size

    def phases_for(stage: int, c_stage: int) -> tuple[list[Phase], float]:
        """Phases of a GPU that holds policy stage ``stage`` (critic stage ``c_stage`` for PPO), and the
        bytes its offload flags keep in host memory."""
        last = stage == policy.pp - 1
        a = policy.static(stage, actor_dtype)
        resident = {"actor params": a["params"], "actor grads": a["grads"], "actor optimizer": a["optimizer"]}
        offloaded = {"actor params": policy.param_offload, "actor grads": policy.grad_offload,
                     "actor optimizer": policy.optimizer_offload}
        if use_ref and run.lora is None:  # with LoRA the reference is the policy with its adapters off
            resident["ref params"] = policy.params(stage) * ref_dtype["param"]
            offloaded["ref params"] = ref_offload
        if critic is not None:
            c = critic.static(c_stage, critic_dtype)
            resident.update({"critic params": c["params"], "critic grads": c["grads"],
                             "critic optimizer": c["optimizer"]})
            offloaded.update({"critic params": critic.param_offload, "critic grads": critic.grad_offload,
                              "critic optimizer": critic.optimizer_offload})
        if judge_bytes:  # the generative reward model's server, up for the whole run
            resident["reward judge (vLLM server)"], offloaded["reward judge (vLLM server)"] = judge_bytes, False
        if reward_model is not None:  # forward-only: parameters only, its fullest stage
            resident["reward model params"] = max(map(reward_model.params, range(reward_model.pp))) * rm_dtype["param"]
            offloaded["reward model params"] = reward_model.param_offload
        # Asleep (free_cache_engine), vLLM holds nothing on a GPU (weights offloaded or dropped), nor on CPU, where it
        # releases its KV cache and drops its weights (sleep level 2, vllm_engine), except with LoRA adapter syncs:
        # level 1 there, the weights stay. A forward's activations are freed after it.
        keeps_weights = device != "cuda" and run.lora is not None and not run.lora.merge
        sleeps = rollout.free_cache_engine and rollout.enable_sleep_mode  # EngineConfig.from_rollout's rule
        sleeping_vllm = (vllm["components"] if not sleeps
                         else {"vLLM weights": vllm["components"]["vLLM weights"]} if keeps_weights else {})

        def phase(name: str, used: set[str], extra: dict[str, float], with_vllm: bool = False) -> Phase:
            items = {k: v for k, v in resident.items() if k in used or not offloaded[k]}
            items.update(vllm["components"] if with_vllm else sleeping_vllm)
            items.update({k: v for k, v in extra.items() if v})
            items["runtime overhead"] = overhead
            return Phase(name, items)

        lp_tokens = max(logprob_tokens, ref_tokens if use_ref else 0)
        forward = {"forward activations": policy.activation_bytes_per_token(actor_dtype) * lp_tokens,
                   "forward logits": logits_bytes(lp_tokens, train=False) if last else 0}
        if critic is not None:
            forward["forward activations"] = max(
                forward["forward activations"],
                critic.activation_bytes_per_token(critic_dtype) * values_tokens)
        out = [
            phase("rollout", set(), {}, with_vllm=True),
        ]
        if reward_model is not None:  # scores the rollout's responses before the log-prob passes
            out.append(phase("reward model", {"reward model params"}, {
                "reward model activations": reward_model.activation_bytes_per_token(rm_dtype) * rm_tokens}))
        out += [
            phase("log-prob", {"actor params", "ref params", "critic params"}, forward),
            phase("actor update", {"actor params", "actor grads"},
                  {"actor activations": policy.activations(stage, train_tokens, actor_dtype),
                   "actor logits": logits_bytes(train_tokens, train=True) if last else 0}),
            phase("actor optimizer", {"actor params", "actor grads", "actor optimizer"}, {}),
        ]
        if critic is not None:
            out += [
                phase("critic update", {"critic params", "critic grads"},
                      {"critic activations": critic.activations(c_stage, critic_tokens, critic_dtype)}),
                phase("critic optimizer", {"critic params", "critic grads", "critic optimizer"}, {}),
            ]
        return out, sum(v for k, v in resident.items() if offloaded[k])

    # megatron orders ranks TP fastest and PP slowest: rank r sits on stage r // (world / PP) of each model.
    pairs = sorted({(r // (world // policy.pp), r // (world // critic.pp) if critic else 0) for r in range(world)})
    by_pair = {pair: phases_for(*pair) for pair in pairs}
    worst = max(pairs, key=lambda pair: max(p.total for p in by_pair[pair][0]))
    phases, host_offload = by_pair[worst]

    # FLOPs of one step (upper bound: full-length sequences)
    prompts = data.train_batch_size
    samples = prompts * rollout.n
    generated = samples + (prompts if run.greedy_baseline else 0)
    tokens = samples * seq_len
    # shared prompts (actor.use_prefix_grouper, unset: where the passes are packed and the model allows it): the
    # policy's passes run each prompt once per group of rollout.n responses
    shared = (run.shared_prompts if run.shared_prompts is not None else bool(arr.model.use_remove_padding)) \
        and rollout.n > 1 and not spec.mla and policy.cp == 1
    policy_tokens = prompts * data.max_prompt_length + samples * run.response_length if shared else tokens
    n_policy = matmul_parameters(spec)
    flops = {
        "generation": 2.0 * n_policy * generated * seq_len,
        "old_log_probs": 2.0 * n_policy * policy_tokens if run.old_log_prob_pass else 0.0,
        "reference": 2.0 * n_policy * policy_tokens if use_ref else 0.0,
        # a frozen (LoRA) base computes no weight gradients: 2·N per token less
        "actor_update": ((8.0 if policy.recompute else 6.0) - (2.0 if run.lora else 0.0)) * n_policy * policy_tokens
        * actor.ppo_epochs
        # the fused output layer's backward recomputes each chunk's logits: one more vocabulary projection (on the
        # response tokens' outputs, which sharing does not change)
        + (2.0 * spec.hidden_size * spec.vocab_size * tokens * actor.ppo_epochs if chunk else 0.0),
    }
    if reward_model is not None:
        flops["reward_model"] = 2.0 * matmul_parameters(reward_model.spec, critic=True) * tokens
    if critic is not None:
        n_critic = matmul_parameters(critic.spec, critic=True)
        epochs = run.critic_update.epochs
        flops["values"] = 2.0 * n_critic * tokens
        flops["critic_update"] = (8.0 if critic.recompute else 6.0) * n_critic * tokens * epochs
    flops["total"] = sum(flops.values())
    flops["per_gpu"] = flops["total"] / world
    experts = None
    if spec.moe:
        # every MoE pass over the step's tokens: old log-probs, reference, each epoch's forward + backward (+ recompute)
        passes = int(run.old_log_prob_pass) + use_ref + actor.ppo_epochs * (3 if policy.recompute else 2)
        experts = {"routed": spec.num_experts, "topk": spec.moe_topk, "ep": policy.ep, "etp": policy.etp or policy.tp,
                   "per_rank": spec.num_experts // policy.ep,
                   "bytes_per_gpu": policy.expert_params() * actor_dtype["param"],
                   "all_to_all_bytes_per_gpu_per_step":
                       all_to_all_bytes_per_token(spec, policy.ep, actor_dtype["act"]) * tokens * passes / world}

    result = MemoryPlan(
        model={"path": arr.model.path, **spec.to_dict(), "parameters": stage_parameters(spec) + vision,
               "active_parameters": active_parameters(spec), "matmul_parameters": n_policy},
        layout={"device": device, "actor_dtype": "bfloat16" if actor_dtype is BYTES_GPU else "float32",
                "nnodes": trainer.nnodes, "gpus_per_node": trainer.n_gpus_per_node, "world": world,
                "tp": policy.tp, "pp": policy.pp, "vpp": policy.vpp, "cp": policy.cp, "dp": policy.dp,
                "distributed_optimizer": policy.distributed_optimizer, "recompute": policy.recompute,
                "sequence_parallel": policy.sequence_parallel,
                "offload": {"param": policy.param_offload, "grad": policy.grad_offload,
                            "optimizer": policy.optimizer_offload, "ref_param": ref_offload},
                "host_offload_bytes_per_node": host_offload * trainer.n_gpus_per_node,
                "train_tokens_per_micro_batch": train_tokens, "log_prob_tokens_per_micro_batch": logprob_tokens,
                "fused_output_chunk": chunk, "reference": use_ref, "experts": experts, "shared_prompts": shared,
                "lora": None if run.lora is None else {"rank": run.lora.rank, "targets": list(run.lora.targets),
                                                       "trained_parameters": lora_parameters(spec, run.lora)},
                "critic": None if critic is None else {"tp": critic.tp, "pp": critic.pp, "cp": critic.cp,
                                                       "dp": critic.dp, "tokens_per_micro_batch": critic_tokens},
                "reward_model": None if reward_model is None else {
                    "path": cfg.reward_model.model.path, "parameters": stage_parameters(reward_model.spec, critic=True),
                    "tp": reward_model.tp, "pp": reward_model.pp, "dp": reward_model.dp,
                    "tokens_per_micro_batch": rm_tokens}},
        stage={"actor": worst[0], "actor_pp": policy.pp, "critic": worst[1] if critic else None,
               "critic_pp": critic.pp if critic else None},
        phases=phases,
        rollout={k: v for k, v in vllm.items() if k != "components"},
        flops=flops,
        limit_bytes=limit,
    )
    judge(result, cfg, policy, critic, use_ref, ref_offload, vllm, device)
    return result


def judge(result: MemoryPlan, cfg, policy: RoleMemory, critic: RoleMemory | None, use_ref: bool, ref_offload: bool,
          vllm: dict, device: str) -> None:
    """Fill ``problems`` (why it does not fit) and ``advice`` (what to turn), biggest lever first."""
    limit = result.limit_bytes
    arr = "actor_rollout_ref"
    mg = f"{arr}.actor.megatron"
    if vllm["full_length_sequences"] < 1:
        result.problems.append(
            f"the vLLM budget leaves {gib(vllm['kv_cache_bytes'])} GiB of KV cache, less than one "
            f"{vllm['max_model_len']}-token sequence ({gib(vllm['kv_bytes_per_token'] * vllm['max_model_len'])} GiB)")
        if device == "cuda":
            result.advice.append(f"raise {arr}.rollout.gpu_memory_utilization (now "
                                 f"{cfg.actor_rollout_ref.rollout.gpu_memory_utilization}) or "
                                 f"{arr}.rollout.tensor_model_parallel_size (now {vllm['tp']})")
        else:
            result.advice.append(f"raise {arr}.rollout.kv_cache_memory_bytes")
    levers: dict[str, float] = {}  # advice -> the most bytes it addresses in any phase that does not fit

    def lever(size: float, text: str) -> None:
        levers[text] = max(levers.get(text, 0.0), size)

    for phase in result.phases:
        if phase.total <= limit:
            continue
        items = phase.items
        top = sorted(items.items(), key=lambda kv: -kv[1])[:3]
        result.problems.append(f"{phase.name} needs {gib(phase.total)} GiB of {gib(limit)} GiB "
                               f"(largest: {', '.join(f'{k} {gib(v)}' for k, v in top)})")
        static = items.get("actor params", 0) + items.get("actor grads", 0) + items.get("actor optimizer", 0)
        if static:
            lever(static, f"raise {mg}.tensor_model_parallel_size (now {policy.tp}) or "
                          f"{mg}.pipeline_model_parallel_size (now {policy.pp}): parameters, gradients and "
                          "optimizer state are split over TP×PP")
        if items.get("actor optimizer") and not policy.distributed_optimizer and policy.dp > 1:
            lever(items["actor optimizer"] * (1 - 1 / policy.dp),
                  f"set {mg}.use_distributed_optimizer=True (shards the optimizer state over DP={policy.dp})")
        if items.get("actor optimizer") and phase.name != "actor optimizer" and not policy.optimizer_offload:
            lever(items["actor optimizer"], f"set {mg}.optimizer_offload=True")
        acts = items.get("actor activations", 0)
        if acts and not policy.recompute:
            lever(acts * 0.8, f"set {arr}.model.enable_gradient_checkpointing=True (activation recompute)")
        if result.layout["fused_output_chunk"] is None and items.get("actor logits"):
            lever(items["actor logits"], f"set {arr}.model.use_fused_kernels=True (the fused output layer holds one "
                                         f"chunk of {arr}.model.fused_kernel_options.chunk_size tokens' logits)")
        if acts or items.get("actor logits"):
            lever(acts + items.get("actor logits", 0),
                  f"lower {arr}.actor.ppo_max_token_len_per_gpu (the token budget; now "
                  f"{result.layout['train_tokens_per_micro_batch']}); logits shrink with TP too")
        if items.get("forward activations") or items.get("forward logits"):
            lever(items.get("forward activations", 0) + items.get("forward logits", 0),
                  f"lower {arr}.rollout.log_prob_max_token_len_per_gpu / {arr}.ref.log_prob_max_token_len_per_gpu "
                  "(forward-only token budgets)")
        if phase.name == "rollout":
            trainer_bytes = sum(v for k, v in items.items() if k.startswith(("actor", "ref", "critic")))
            if trainer_bytes:
                lever(trainer_bytes, f"offload the trainer while vLLM generates: {mg}.param_offload / grad_offload"
                                     " / optimizer_offload=True (and the critic's and reference's offload flags)")
            lever(items.get("vLLM KV cache", 0), f"lower {arr}.rollout.gpu_memory_utilization (now "
                                                 f"{cfg.actor_rollout_ref.rollout.gpu_memory_utilization})")
        elif items.get("vLLM KV cache"):
            lever(items["vLLM KV cache"], f"set {arr}.rollout.free_cache_engine=True and enable_sleep_mode=True (vLLM "
                                          "sleeps while training)")
        if items.get("reward model params") and phase.name != "reward model":
            lever(items["reward model params"], "set reward_model.megatron.param_offload=True")
        if use_ref and items.get("ref params") and phase.name != "log-prob" and not ref_offload:
            lever(items["ref params"], f"set {arr}.ref.megatron.param_offload=True")
        if critic is not None:
            c_static = items.get("critic params", 0) + items.get("critic grads", 0) + items.get("critic optimizer", 0)
            if c_static:
                lever(c_static, f"raise critic.megatron.tensor_model_parallel_size (now {critic.tp}) / "
                                "pipeline_model_parallel_size, or set critic.megatron.use_distributed_optimizer / "
                                "param_offload / optimizer_offload=True")
            if items.get("critic activations"):
                if not critic.recompute:
                    lever(items["critic activations"] * 0.8,
                          "set critic.model.enable_gradient_checkpointing=True (activation recompute)")
                lever(items["critic activations"], f"lower critic.ppo_max_token_len_per_gpu (now "
                                                   f"{result.layout['critic']['tokens_per_micro_batch']})")
    result.advice.extend(text for text, _ in sorted(levers.items(), key=lambda kv: -kv[1])
                         if text not in result.advice)
