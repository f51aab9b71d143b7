"""The run plan: every decision a run makes from its config, derived once and checked at load time.

The trainer, the workers, ``meshrl plan`` and validation read a ``RunPlan`` instead of re-deriving
decisions from raw strings. ``build_run_plan(cfg)`` resolves the method names against the algorithm
registries (a typo fails here with a did-you-mean, before Ray, models or a rollout start) and decides:

- **roles**: the policy always; the reference when a KL term is used (``algorithm.use_kl_in_reward`` or
  ``actor.use_kl_loss``); the critic when the advantage estimator takes ``values`` (GAE); the greedy
  baseline rollout when it takes ``greedy_scores`` (ReMax). Read from the estimator's signature, so a
  user's ``module:function`` estimator gets the roles it asks for. The learned reward model with
  ``reward_model.enable`` (its own layout from ``reward_model.megatron``).
- **where KL goes**: the reward (``kl_in_reward``: its penalty type) and/or the loss (``kl_loss``: its type).
- **response width** ``response_length``: the rollout's (``rollout.response_length``, else
  ``data.max_response_length``), the one width of every ``(B, R)`` tensor — actor, critic and the loss
  normalisers alike (verl's width is its rollout's, too).
- **parallel layout per role**, the **mini-batch schedule** of each trained role (the critic's own
  ``ppo_mini_batch_size`` / ``ppo_epochs`` / ``shuffle``, each defaulting to the actor's as in verl),
  the **micro-batching** of every phase the run has, and the sampling ``temperature`` the trained
  log-probs are evaluated at.
- **the train/rollout log-prob alarm** (``mismatch_tolerance``, ``meshrl.trainer.alarms``): whether the
  engine's log-probs are comparable with the trainer's at all, and the tolerance its precision allows.
- **LoRA** (``lora``: ``meshrl.config.lora_keys``): the policy's adapters from verl's FSDP or Megatron LoRA keys,
  None when every weight trains.
- **rollout correction** (``rollout_correction``: ``algorithm.rollout_correction``, checked and parsed): IS weights
  and rejection against the engine's log-probs (they need the old-log-prob pass before the update), or bypass mode
  (the engine's log-probs are the old ones: no pass, the ``bypass_mode`` loss, no train/rollout alarm).
- **Σπ²** (``sum_pi_squared``, ``actor.calculate_sum_pi_squared``, verl's key): the old-log-prob pass also gives
  each response token's Σ_v π_v² under the policy (``forward.OutputRequest.sum_pi_squared``), which the optimal
  token baselines read; off, it costs nothing.
- **the fused output layer** (``fused_chunk_size``): with ``model.use_fused_kernels`` the policy's and the
  reference's log-probs and entropy come from ``meshrl.parallel.fused_output`` in chunks of
  ``model.fused_kernel_options.chunk_size`` tokens; None: from the output layer's logits.
- **compiled models** (``torch_compile``): the models whose norms, SwiGLU and rotary run under ``torch.compile``
  (``meshrl.parallel.compiled``): the policy with ``actor.use_torch_compile``, the reference with
  ``ref.use_torch_compile`` (unset: the actor's, as verl's ``oc.select``); none, with a start-up warning, when
  ``TORCHDYNAMO_DISABLE=1`` switches ``torch.compile`` off in the run's processes.
- **shared prompts** (``shared_prompts``, verl's ``actor.use_prefix_grouper``): the policy's and reference's passes
  run each group's prompt once for its responses (``meshrl.parallel.shared_prefix``, the same numbers); unset, on
  wherever the model runs that layout (verl's default is off: its FSDP-only PrefixGrouper changes the attention
  kernels and refuses packing).
- **what every worker process needs of the run** (``workers``: ``WorkerSettings``): the device, the collective
  timeout, the non-finite number policy, where logs go. A worker gets this plan and its own role's config
  section (``actor_rollout_ref`` or ``critic``), never the whole config.
"""

from __future__ import annotations

import inspect
import os
from dataclasses import dataclass, field
from typing import Any, Callable

from omegaconf import DictConfig, OmegaConf

from meshrl.algorithms.registry import ADVANTAGE_ESTIMATORS, KL_PENALTIES, POLICY_LOSSES, Registry
from meshrl.algorithms.rollout_correction import RolloutCorrectionSettings
from meshrl.config.async_keys import versions_span_steps
from meshrl.config.refusals import refuse
from meshrl.config.lora_keys import LoraPlan, lora_plan
from meshrl.config.micro_batching import ROLE_SECTIONS, MicroBatching, data_parallel_size, micro_batching
from meshrl.config.reward_model_kind import DISCRIMINATIVE, GENERATIVE, reward_model_kind, unused_judge_keys
from meshrl.config.schema import MISMATCH_ACTIONS

# Batch fields the trainer can hand an estimator, and what produces them (meshrl.trainer.advantage).
ESTIMATOR_BATCH_INPUTS = {"uid": None, "values": "critic", "greedy_scores": "greedy_baseline",
                          "old_log_probs": "the old-log-prob pass (never skipped for an estimator taking them)",
                          "sum_pi_squared": "actor_rollout_ref.actor.calculate_sum_pi_squared",
                          "rollout_is_weights": "algorithm.rollout_correction"}
# Config values the trainer hands every estimator that names them: the keyword, and how it reads the value from the
# ``algorithm`` section (meshrl.trainer.advantage).
ESTIMATOR_SETTINGS: dict[str, Callable[[DictConfig], Any]] = {
    "gamma": lambda algo: algo.gamma,
    "lam": lambda algo: algo.lam,
    "norm_adv_by_std_in_grpo": lambda algo: algo.norm_adv_by_std_in_grpo,
    "norm_by_std": lambda algo: algo.gpg.norm_by_std,
    "gpg_alpha_mode": lambda algo: algo.gpg.alpha_mode,
    "gdpo_reward_keys": lambda algo: None if algo.gdpo_reward_keys is None else [str(k) for k in algo.gdpo_reward_keys],
    "gdpo_reward_weights": lambda algo: (None if algo.gdpo_reward_weights is None
                                         else [float(w) for w in algo.gdpo_reward_weights]),
}
# ... and the reward function's extra outputs by name (reward_extras: the entries of its returned dict other than
# "score").
ESTIMATOR_CONFIG_INPUTS = (*ESTIMATOR_SETTINGS, "reward_extras")
# trainer.mismatch_tolerance=None: the token-mean |old_log_probs - rollout_log_probs| a healthy run stays under,
# by the lower precision of trainer and engine. float32, measured on CPU: tiny Llama with the HF engine 5e-7
# (max 2e-6), SmolLM2-135M with vLLM at most 7e-5 over the main job's 16 steps (the maximum; the mean is
# smaller). 16-bit: bf16 weights and activations on one side move the tiny model's log-probs by 0.008 on
# average (0.027 at most, tests/workers/test_worker_inprocess.py); bf16 on both sides of a GPU run is not
# measured yet (no vLLM on this project's GPU machines): 0.2 leaves 25x that. One corrupted tensor in a sync
# moved the tiny model's by 1.06 (tests/e2e/test_mismatch_alarm_e2e.py).
MISMATCH_TOLERANCES = {"float32": 1e-3, "16-bit": 0.2}


@dataclass(frozen=True)
class ParallelLayout:
    """One role's model-parallel layout over the run's training processes: what its workers initialise megatron's
    groups with (``meshrl.workers.rank``). ``expert_tensor``: the experts' TP, None: the dense layers' TP."""

    tensor: int
    pipeline: int
    virtual_pipeline: int | None
    context: int
    expert: int
    data: int
    expert_tensor: int | None = None


@dataclass(frozen=True)
class UpdateSchedule:
    """How a trained role's update cuts the RL batch: ``epochs`` passes over mini-batches of
    ``mini_batch_responses`` responses (``ppo_mini_batch_size`` prompts × ``rollout.n``), reshuffled
    every pass when ``shuffle``. One optimizer step per mini-batch; the LR schedule advances once per RL step."""

    mini_batch_responses: int
    epochs: int
    shuffle: bool
    # seq-mean-token-sum-norm's divisor L_max (verl's loss_scale_factor; None there: the response width)
    loss_scale: int


@dataclass(frozen=True)
class WorkerSettings:
    """The run-wide settings a worker process reads (its role's own keys come in its config section)."""

    device: str  # trainer.device: cpu | cuda | auto
    collective_timeout_s: int  # actor_rollout_ref.nccl_timeout (verl's), for the critic's ranks too
    nonfinite_loss: str  # trainer.on_nonfinite_loss
    nonfinite_grad_norm: str  # trainer.on_nonfinite_grad_norm
    verbose: bool  # trainer.verbose: library output stays on the console
    run_dir: str  # trainer.default_local_dir: the logs folder is under it

    @classmethod
    def from_config(cls, cfg: DictConfig) -> WorkerSettings:
        trainer = cfg.trainer
        return cls(device=trainer.device, collective_timeout_s=int(cfg.actor_rollout_ref.nccl_timeout),
                   nonfinite_loss=trainer.on_nonfinite_loss, nonfinite_grad_norm=trainer.on_nonfinite_grad_norm,
                   verbose=bool(trainer.verbose), run_dir=str(trainer.default_local_dir))


@dataclass(frozen=True)
class RunPlan:
    adv_estimator: str
    policy_loss: str
    loss_agg_mode: str
    kl_in_reward: str | None  # the reward's KL penalty type, None: no KL in the reward
    kl_loss: str | None  # the loss's KL type, None: no KL loss
    use_critic: bool
    greedy_baseline: bool
    response_length: int
    prompt_length: int
    temperature: float  # the sampling temperature: trained log-probs are those of softmax(logits / T)
    actor_layout: ParallelLayout
    critic_layout: ParallelLayout | None
    rollout_tensor_parallel: int
    on_policy: bool  # no old-log-prob pass: the update's forward gives logπ_θ = logπ_old (on_policy_update)
    actor_update: UpdateSchedule
    critic_update: UpdateSchedule | None
    micro_batching: dict[str, MicroBatching] = field(default_factory=dict)
    # The learned reward model's layout (reward_model.enable), None: rewards come from functions only.
    reward_model_layout: ParallelLayout | None = None
    # A generative reward model served by vLLM to the reward function (meshrl.rewards.judge), not a Megatron role.
    reward_judge: bool = False
    warnings: tuple[str, ...] = ()  # said once at start-up (meshrl.trainer.main)
    # The train/rollout log-prob alarm's tolerance on the token-mean |old - rollout| (meshrl.trainer.alarms);
    # None: no alarm (trainer.on_mismatch=ignore, or the engine's log-probs are not the trainer's by config).
    mismatch_tolerance: float | None = None
    workers: WorkerSettings | None = None
    fused_chunk_size: int | None = None  # tokens per chunk of the fused output layer; None: unfused
    torch_compile: tuple[str, ...] = ()  # "policy" / "reference": compiled elementwise regions (torch_compile_roles)
    lora: LoraPlan | None = None  # the policy's LoRA adapters; None: every weight trains
    # actor.calculate_sum_pi_squared: the old-log-prob pass also gives each token's Σ_v π_v² (sum_pi_squared)
    sum_pi_squared: bool = False
    # algorithm.rollout_correction, parsed (rollout_correction_check)
    rollout_correction: RolloutCorrectionSettings = field(default_factory=RolloutCorrectionSettings)
    # actor.use_prefix_grouper: the policy's and reference's passes in the shared-prompt layout; None (unset): wherever
    # the model runs it, True: asked for (a note says why where it cannot run), False: off
    shared_prompts: bool | None = None

    @property
    def old_log_prob_pass(self) -> bool:
        """The trainer recomputes old_log_probs: not on-policy (the update's forward gives them), nor in bypass mode
        (the engine's are taken)."""
        return not self.on_policy and not self.rollout_correction.bypass

    @property
    def use_reference(self) -> bool:
        return self.kl_in_reward is not None or self.kl_loss is not None

    @property
    def use_reward_model(self) -> bool:
        return self.reward_model_layout is not None

    @property
    def roles(self) -> tuple[str, ...]:
        return ("policy", "rollout") + (("reference",) if self.use_reference else ()) \
            + (("critic",) if self.use_critic else ()) + (("greedy_baseline",) if self.greedy_baseline else ()) \
            + (("reward_model",) if self.use_reward_model else ()) + (("reward_judge",) if self.reward_judge else ())


def _resolve(registry: Registry, name: str, key: str, problems: list[str]) -> bool:
    try:
        registry.get(name)
    except ValueError as exc:
        problems.append(f"{key}: {exc}")
        return False
    return True


def estimator_inputs(name: str) -> tuple[str, ...]:
    """The keyword inputs estimator ``name`` requires (no default), e.g. ``('values',)`` for GAE."""
    parameters = list(inspect.signature(ADVANTAGE_ESTIMATORS.get(name)).parameters.values())[2:]
    return tuple(p.name for p in parameters
                 if p.default is inspect.Parameter.empty and p.kind is not inspect.Parameter.VAR_KEYWORD)


def method_problems(cfg: DictConfig) -> list[str]:
    """Every method name of ``cfg`` that no registry knows, and estimator inputs meshrl cannot provide."""
    algo, actor = cfg.algorithm, cfg.actor_rollout_ref.actor
    problems: list[str] = []
    if _resolve(ADVANTAGE_ESTIMATORS, algo.adv_estimator, "algorithm.adv_estimator", problems):
        known = set(ESTIMATOR_BATCH_INPUTS) | set(ESTIMATOR_CONFIG_INPUTS)
        missing = [name for name in estimator_inputs(algo.adv_estimator) if name not in known]
        if missing:
            problems.append(f"algorithm.adv_estimator: '{algo.adv_estimator}' needs {', '.join(missing)}, which meshrl "
                            f"does not provide; an estimator may take {', '.join(sorted(known))}")
    _resolve(POLICY_LOSSES, actor.policy_loss.loss_mode, "actor_rollout_ref.actor.policy_loss.loss_mode", problems)
    _resolve(KL_PENALTIES, algo.kl_penalty, "algorithm.kl_penalty", problems)
    _resolve(KL_PENALTIES, actor.kl_loss_type, "actor_rollout_ref.actor.kl_loss_type", problems)
    return problems


def _layout(cfg: DictConfig, role: str) -> ParallelLayout:
    mg = OmegaConf.select(cfg, ROLE_SECTIONS[role]).megatron
    return ParallelLayout(tensor=mg.tensor_model_parallel_size, pipeline=mg.pipeline_model_parallel_size,
                          virtual_pipeline=mg.virtual_pipeline_model_parallel_size, context=mg.context_parallel_size,
                          expert=mg.expert_model_parallel_size, data=data_parallel_size(cfg, role),
                          expert_tensor=mg.expert_tensor_parallel_size)


def build_run_plan(cfg: DictConfig) -> RunPlan:
    """The ``RunPlan`` of ``cfg``; raises ``ConfigError`` listing unknown method names and unbuildable phases."""
    plan, problems = check_run_plan(cfg)
    refuse(problems)
    return plan


def check_run_plan(cfg: DictConfig) -> tuple[RunPlan | None, list[str]]:
    """(the plan, []) or (None, every problem found: method names, then micro-batching of each phase)."""
    problems = method_problems(cfg)
    if problems:
        return None, problems
    algo, data, arr = cfg.algorithm, cfg.data, cfg.actor_rollout_ref
    actor, rollout, critic = arr.actor, arr.rollout, cfg.critic
    needs = estimator_inputs(algo.adv_estimator)
    use_critic = "values" in needs
    width = rollout.response_length or data.max_response_length
    warnings = []
    if rollout.response_length is not None and rollout.response_length != data.max_response_length:
        warnings.append(f"actor_rollout_ref.rollout.response_length={rollout.response_length} sets the response "
                        f"width of every role (data.max_response_length={data.max_response_length} is not used), "
                        "as in verl")
    n = rollout.n
    actor_scale = actor.loss_scale_factor or width
    actor_update = UpdateSchedule(actor.ppo_mini_batch_size * n, actor.ppo_epochs, bool(actor.shuffle), actor_scale)
    critic_update = None
    if use_critic:
        critic_update = UpdateSchedule(
            (critic.ppo_mini_batch_size if critic.ppo_mini_batch_size is not None else actor.ppo_mini_batch_size) * n,
            critic.ppo_epochs if critic.ppo_epochs is not None else actor.ppo_epochs,
            bool(critic.shuffle if critic.shuffle is not None else actor.shuffle),
            critic.loss_scale_factor or actor_scale)  # verl's critic follows the actor's unless set
    kl_in_reward = algo.kl_penalty if algo.use_kl_in_reward else None
    kl_loss = actor.kl_loss_type if actor.use_kl_loss else None
    rm_kind = reward_model_kind(cfg)
    use_reward_model = rm_kind == DISCRIMINATIVE
    if unused := unused_judge_keys(cfg, rm_kind):
        warnings.append(f"{', '.join(unused)}: no effect on this run (reward_model.rollout.* configures the vLLM "
                        "server of a generative reward model, which this run does not have: a discriminative one "
                        "runs as a Megatron role, reward_model.megatron.*)")
    phases = ["actor_update", "actor_log_prob"] + (["ref_log_prob"] if kl_in_reward or kl_loss else []) \
        + (["critic_update", "critic_values"] if use_critic else []) + (["reward_model"] if use_reward_model else [])
    batching, phase_problems = {}, []
    for phase in phases:
        role = next((r for r in ("critic", "reward_model") if phase.startswith(r)), "actor")
        try:
            batching[phase] = micro_batching(cfg, phase, data_parallel_size(cfg, role))
        except ValueError as exc:
            phase_problems.append(str(exc))
    mismatch_tolerance, note, mismatch_problems = rollout_mismatch_check(cfg)
    phase_problems += mismatch_problems
    fused_chunk_size = fused_output_chunk(arr.model, phase_problems)
    torch_compile = torch_compile_roles(arr, warnings)
    lora, lora_problems, lora_notes = lora_plan(cfg)
    phase_problems += lora_problems
    warnings += lora_notes
    correction, correction_problems, correction_notes = rollout_correction_check(cfg)
    phase_problems += correction_problems
    warnings += correction_notes
    if phase_problems:
        return None, phase_problems
    if note:
        warnings.append(note)
    return RunPlan(
        adv_estimator=algo.adv_estimator, loss_agg_mode=actor.loss_agg_mode,
        policy_loss="bypass_mode" if correction.bypass else actor.policy_loss.loss_mode,
        kl_in_reward=kl_in_reward, kl_loss=kl_loss, use_critic=use_critic,
        greedy_baseline="greedy_scores" in needs, response_length=int(width),
        prompt_length=int(rollout.prompt_length or data.max_prompt_length), temperature=float(rollout.temperature),
        actor_layout=_layout(cfg, "actor"), critic_layout=_layout(cfg, "critic") if use_critic else None,
        reward_model_layout=_layout(cfg, "reward_model") if use_reward_model else None,
        reward_judge=rm_kind == GENERATIVE,
        rollout_tensor_parallel=rollout.tensor_model_parallel_size, on_policy=on_policy_update(cfg),
        actor_update=actor_update,
        critic_update=critic_update, micro_batching=batching, warnings=tuple(warnings),
        fused_chunk_size=fused_chunk_size, torch_compile=torch_compile,
        sum_pi_squared=bool(actor.calculate_sum_pi_squared),
        mismatch_tolerance=mismatch_tolerance, workers=WorkerSettings.from_config(cfg), lora=lora,
        rollout_correction=correction, shared_prompts=actor.use_prefix_grouper,
    ), []


def _precision(dtype: str, device: str) -> str:
    """``float32`` or ``16-bit``: what a dtype key computes in. ``auto`` is float32 only with
    ``trainer.device=cpu``: under ``auto`` the workers may land on GPUs the driver cannot see, and a
    float32 tolerance there would stop a healthy bf16 run."""
    if dtype == "auto":
        return "float32" if device == "cpu" else "16-bit"
    return "float32" if dtype in ("float32", "float", "fp32") else "16-bit"


def rollout_mismatch_check(cfg: DictConfig) -> tuple[float | None, str | None, list[str]]:
    """(tolerance of the train/rollout log-prob alarm or None: no alarm, a start-up note, problems).

    The engine's ``rollout_log_probs`` equal the trainer's recomputed ``log softmax(logits / T)`` (up to
    numerics) only when both describe the same distribution (``meshrl.rollout.base``): with
    ``logprobs_mode=processed_logprobs``, no top-k / top-p truncation (the engine renormalises over the kept
    tokens); with ``raw_logprobs`` (temperature 1 in the engine), ``temperature=1``; a greedy training
    rollout (``do_sample=False``) reports ``log softmax(logits)``, so ``temperature=1`` too. Otherwise the alarm
    is off with a note (the metrics are still logged)."""
    trainer, rollout = cfg.trainer, cfg.actor_rollout_ref.rollout
    problems = []
    if trainer.on_mismatch not in MISMATCH_ACTIONS:
        # YAML reads a bare off / no as False: say so, the value shown would puzzle
        hint = " (YAML reads off as False; write ignore)" if trainer.on_mismatch == "False" else ""
        problems.append(f"trainer.on_mismatch: must be one of {', '.join(MISMATCH_ACTIONS)}, got "
                        f"{trainer.on_mismatch!r}{hint}")
    if trainer.mismatch_tolerance is not None and not trainer.mismatch_tolerance > 0:
        problems.append(f"trainer.mismatch_tolerance: must be > 0 (or null: by precision), got "
                        f"{trainer.mismatch_tolerance}")
    if problems or trainer.on_mismatch == "ignore":
        return None, None, problems
    if cfg.algorithm.rollout_correction.bypass_mode:
        return None, ("the train/rollout log-prob alarm (trainer.on_mismatch) is off: algorithm.rollout_correction."
                      "bypass_mode=True takes the engine's log-probs as old_log_probs, the trainer computes none to "
                      "compare them with (the actor logs rollout_corr/kl, k3_kl, chi2_token of the policy it "
                      "trains)"), []
    temperature_one = rollout.temperature == 1
    if not rollout.do_sample:
        why = None if temperature_one else (f"a greedy rollout (rollout.do_sample=False) reports log softmax(logits), "
                                            f"the trainer log softmax(logits / {rollout.temperature})")
    elif rollout.logprobs_mode == "raw_logprobs":
        why = None if temperature_one else (f"rollout.logprobs_mode=raw_logprobs reports log softmax(logits), the "
                                            f"trainer log softmax(logits / {rollout.temperature})")
    else:
        truncated = [f"rollout.{key}={rollout[key]}" for key, off in (("top_k", -1), ("top_p", 1.0))
                     if rollout[key] != off]
        why = None if not truncated else (f"{' and '.join(truncated)}: the engine renormalises its log-probs over the "
                                          "tokens it keeps, the trainer's span the whole vocabulary")
    if why is not None:
        return None, (f"the train/rollout log-prob alarm (trainer.on_mismatch) is off: {why}; "
                      "rollout/log_prob_*_abs_diff are still logged"), []
    if trainer.mismatch_tolerance is not None:
        return float(trainer.mismatch_tolerance), None, []
    device = trainer.device
    precisions = {_precision(cfg.actor_rollout_ref.actor.megatron.dtype, device), _precision(rollout.dtype, device)}
    return MISMATCH_TOLERANCES["16-bit" if "16-bit" in precisions else "float32"], None, []


def fused_output_chunk(model: DictConfig, problems: list[str]) -> int | None:
    """Tokens per chunk of the policy's fused output layer (``actor_rollout_ref.model``'s ``use_fused_kernels``
    and ``fused_kernel_options.chunk_size``), None: unfused. A chunk below one token is added to ``problems``."""
    if not model.use_fused_kernels:
        return None
    chunk = model.fused_kernel_options.chunk_size
    if chunk < 1:
        problems.append(f"actor_rollout_ref.model.fused_kernel_options.chunk_size: must be >= 1 token, got {chunk} "
                        "(the fused output layer holds [chunk_size, vocab / TP] logits at a time; e.g. 512)")
        return None
    return int(chunk)


def torch_compile_roles(arr: DictConfig, warnings: list[str]) -> tuple[str, ...]:
    """The models whose elementwise regions run compiled: "policy" (``actor.use_torch_compile``) and "reference"
    (``ref.use_torch_compile``, unset: the actor's). None under ``TORCHDYNAMO_DISABLE=1`` (the workers inherit the
    driver's ``TORCHDYNAMO_*``, and torch.compile is a no-op there), said in ``warnings``."""
    ref = arr.actor.use_torch_compile if arr.ref.use_torch_compile is None else arr.ref.use_torch_compile
    keys = {"policy": ("actor_rollout_ref.actor.use_torch_compile", arr.actor.use_torch_compile),
            "reference": ("actor_rollout_ref.ref.use_torch_compile", ref)}
    asked = {role: key for role, (key, on) in keys.items() if on}
    if asked and os.environ.get("TORCHDYNAMO_DISABLE", "") == "1":
        warnings.append(f"{', '.join(asked.values())}=True, but TORCHDYNAMO_DISABLE=1 switches torch.compile off in "
                        "the run's processes: the models run eager; unset TORCHDYNAMO_DISABLE to compile them")
        return ()
    return tuple(asked)


def on_policy_update(cfg: DictConfig) -> bool:
    """Whether the actor update is exactly on-policy, so the old-log-prob forward pass is skipped.

    On-policy ⇔ ``ppo_epochs = 1`` and one mini-batch holds every response
    (``ppo_mini_batch_size·n = train_batch_size·n``): the RL step's one optimizer step differentiates the
    very policy that the old log-probs would be recomputed from, so logπ_old = logπ_θ.detach() exactly
    (ratio ρ = 1; every policy loss then has the gradient it has with the recompute, up to rounding).
    Not when KL is in the reward (``algorithm.use_kl_in_reward`` reads the old log-probs before the
    advantages, hence before the update), nor when the estimator takes ``old_log_probs`` or the pass gives
    ``sum_pi_squared`` (``actor.calculate_sum_pi_squared``: the optimal token baselines read both before the
    update), nor when ``algorithm.rollout_correction`` weighs or rejects tokens before the update (its
    ``rollout_is`` / ``rollout_rs`` read the old log-probs; ``bypass_mode`` takes the engine's instead), nor in the
    fully async trainer with several local steps per version (its pi_old is the version's first weights, not the
    step's: ``meshrl.trainer.async_trainer``), nor with ``actor.skip_on_policy_old_log_prob=False``.

    The skipped log-probs still exist: the update returns those of its forward pass (the policy before
    the step) as ``old_log_probs``, so the diagnostics that read them are computed as with the recompute;
    a step without an actor update (``trainer.critic_warmup``) has none and logs none.
    """
    actor = cfg.actor_rollout_ref.actor
    return bool(actor.skip_on_policy_old_log_prob and actor.ppo_epochs == 1
                and actor.ppo_mini_batch_size == cfg.data.train_batch_size
                and not cfg.algorithm.use_kl_in_reward and not actor.calculate_sum_pi_squared
                and "old_log_probs" not in estimator_inputs(cfg.algorithm.adv_estimator)
                and not rollout_correction_reads_old_log_probs(cfg.algorithm.rollout_correction)
                and not versions_span_steps(cfg))


def rollout_correction_reads_old_log_probs(section: DictConfig) -> bool:
    """``algorithm.rollout_correction`` needs the old log-probs before the update (IS weights, rejection) or replaces
    them (bypass mode): either way the update cannot be the on-policy one."""
    return section.rollout_is is not None or section.rollout_rs is not None or bool(section.bypass_mode)


def rollout_correction_check(cfg: DictConfig) -> tuple[RolloutCorrectionSettings, list[str], list[str]]:
    """(``algorithm.rollout_correction`` parsed, problems, start-up warnings): invalid values (verl's checks, at load
    time), ``policy_loss.loss_mode=bypass_mode`` without bypass mode, and keys set to no effect."""
    section, loss_mode = cfg.algorithm.rollout_correction, cfg.actor_rollout_ref.actor.policy_loss.loss_mode
    try:
        settings = RolloutCorrectionSettings.from_config(section)
    except ValueError as exc:
        return RolloutCorrectionSettings(), [f"algorithm.rollout_correction: {exc}"], []
    problems, warnings = [], []
    if loss_mode == "bypass_mode" and not settings.bypass:
        problems.append("actor_rollout_ref.actor.policy_loss.loss_mode=bypass_mode expects old_log_probs to be the "
                        "engine's: set algorithm.rollout_correction.bypass_mode=True instead (verl's trainer then "
                        "picks this loss itself)")
    if settings.bypass and cfg.actor_rollout_ref.actor.calculate_sum_pi_squared:
        problems.append("algorithm.rollout_correction.bypass_mode=True skips the old-log-prob pass, which computes "
                        "actor_rollout_ref.actor.calculate_sum_pi_squared's Σπ² (as in verl): set one of them False")
    if settings.bypass and loss_mode not in ("vanilla", "bypass_mode"):
        warnings.append(f"algorithm.rollout_correction.bypass_mode=True trains with the bypass_mode loss (loss_type="
                        f"{settings.loss_type}): actor_rollout_ref.actor.policy_loss.loss_mode={loss_mode} is not "
                        "used, as in verl")
    if settings.bypass and settings.loss_type == "ppo_clip" and settings.rollout_is is not None:
        warnings.append("algorithm.rollout_correction: bypass_mode with loss_type=ppo_clip logs the IS weights "
                        "(rollout_corr/rollout_is_*) but does not apply them, as in verl: PPO's ratio is already "
                        "π_θ/π_rollout; loss_type=reinforce applies them")
    unused = [f"{key} ({why})" for key, why, idle in (
        ("rollout_rs_threshold", "rollout_rs is null", section.rollout_rs is None and section.rollout_rs_threshold
         is not None),
        ("rollout_is_batch_normalize", "rollout_is is null", settings.rollout_is is None and settings.batch_normalize),
        ("loss_type", "bypass_mode is False", not settings.bypass and settings.loss_type != "ppo_clip")) if idle]
    if unused:
        warnings.append(f"algorithm.rollout_correction: {', '.join(unused)}: no effect on this run")
    return settings, problems, warnings


def lr_decay_style(optim: DictConfig) -> str:
    """The LR decay style verl's keys name: ``lr_decay_style`` (its Megatron key), else ``lr_scheduler_type``
    / ``warmup_style`` (its FSDP ones); ``meshrl.config.validate`` refuses the two disagreeing."""
    return optim.lr_decay_style or optim.lr_scheduler_type or optim.warmup_style
