"""Semantic checks of a loaded configuration: ranges, choices and cross-key rules.

The rules of the ``config`` stage (``meshrl.config.refusals``) live here and in the config modules imported
below. ``validate_config(cfg)`` runs them and raises one ``ConfigError`` listing every problem, each naming the
key and the fix, so a user fixes a recipe in one pass; a valid config gives its ``RunPlan``
(``meshrl.config.run_plan``), the decisions every later part reads. ``engine_and_routing_problems`` is a
``model``-stage rule (it needs the model's HF config).
"""

from __future__ import annotations

import dataclasses
import difflib

from omegaconf import DictConfig, OmegaConf

from meshrl.config import checkpoint_contents  # noqa: F401  (registers its config-stage rule)
from meshrl.config.async_keys import async_problems, with_async_keys
from meshrl.config.key_policy import FUSED_KERNEL_SWITCHES, MOE_EXPERT_LAYER, ROLLOUT_ROUTING, key_policy
from meshrl.config.reward_kwargs import reward_kwargs_problems
from meshrl.config.schema import ROUTER_REPLAY_MODES
from meshrl.config.loader import default_config
from meshrl.algorithms.registry import ADVANTAGE_ESTIMATORS
from meshrl.config.refusals import Checked, enforce, refusal, refuse
from meshrl.config.run_plan import RunPlan, check_run_plan, estimator_inputs
from meshrl.config.schema import (DEVICES, KL_CTRL_TYPES, LOGGERS, LOSS_AGG_MODES, LR_DECAY_STYLES, LR_SCHEDULES,
                                  MEGATRON_DTYPES, MOE_BALANCING, NONFINITE_ACTIONS, ROLLOUT_MODES, WD_INCR_STYLES,
                                  WSD_DECAY_STYLES, RESUME_MODES, ROLLOUT_ENGINES, TRUNCATION_MODES)


# loss_mode -> its options (keys under actor_rollout_ref.actor) that must be > 0
LOSS_OPTIONS_ABOVE_ZERO = {"sapo": ("tau_pos", "tau_neg"), "clip_cov": ("policy_loss.clip_cov_ratio",),
                           "kl_cov": ("policy_loss.kl_cov_ratio",), "dro": ("policy_loss.dro_beta",)}


class _Problems:
    def __init__(self) -> None:
        self.items: list[str] = []

    def require(self, ok: bool, key: str, message: str) -> None:
        if not ok:
            self.items.append(f"{key}: {message}")

    def choice(self, value: str, key: str, choices) -> None:
        self.require(value in choices, key, f"'{value}' is not one of {', '.join(map(str, choices))}")

    def positive(self, value, key: str) -> None:
        self.require(value is not None and value > 0, key, f"must be > 0, got {value}")

    def freq(self, value: int, key: str) -> None:
        self.require(value == -1 or value > 0, key, f"must be -1 (never) or a positive step count, got {value}")


# verl's names of its FSDP backend in *.strategy: accepted with a warning, like model_engine=fsdp
FSDP_STRATEGIES = ("fsdp", "fsdp2", "fsdp_turbo", "dp")
# A reference section left at the schema's defaults takes the actor's layout.
REF_LAYOUT_DEFAULTS = dict(default_config().actor_rollout_ref.ref.megatron)


def world_size(cfg: DictConfig) -> int:
    """Training processes: ``trainer.nnodes × trainer.n_gpus_per_node`` (processes per node on CPU)."""
    return cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node


def validate_config(cfg: DictConfig) -> RunPlan:
    """``cfg``'s run plan with its start-up notes; raises ``ConfigError`` listing every problem the ``config`` stage's
    rules find (``meshrl.config.refusals``; see module docstring)."""
    checked = Checked(cfg)
    enforce("config", checked)
    plan = checked.once(check_run_plan)[0]
    return dataclasses.replace(plan, warnings=plan.warnings + tuple(_config_notes(checked)))


def _config_notes(c: Checked) -> list[str]:
    """The start-up notes of keys accepted but not taken as they say (verl's FSDP keys, settings off where their
    kernels cannot run), and of what a setting means here."""
    cfg, plan = c.cfg, c.once(check_run_plan)[0]
    arr = cfg.actor_rollout_ref
    notes = c.once(key_policy)[1] + c.once(async_problems)[1]
    roles = (("actor", arr.actor), ("ref", arr.ref), ("critic", cfg.critic), ("reward_model", cfg.reward_model))
    fsdp = [f"{key}.strategy={s.strategy}" for key, s in roles if s.strategy in FSDP_STRATEGIES]
    if fsdp:
        notes.append(f"{', '.join(fsdp)}: meshrl trains with its Megatron backend (fsdp_config's param_offload / "
                     "optimizer_offload carry over to it)")
    n = arr.rollout.n
    if "uid" in estimator_inputs(plan.adv_estimator) and n < 2 and plan.adv_estimator in SOLO_GROUP_ADVANTAGE:
        notes.append(f"actor_rollout_ref.rollout.n={n}: every response is a group of one, whose "
                     f"{plan.adv_estimator} advantage is {SOLO_GROUP_ADVANTAGE[plan.adv_estimator]}")
    notes += _sequence_parallel_notes(cfg, plan.use_critic)
    notes += _fused_kernel_notes(cfg, plan.use_critic)
    return notes + _moe_expert_layer_notes(cfg, plan.use_critic)


@refusal("config", "actor_rollout_ref", "critic", "reward_model", "trainer", "async_training", "rollout")
def refused_keys(c: Checked) -> list[str]:
    """Keys meshrl does not build, each with what to use instead (``key_policy``), and every key that asks for an
    asynchronous trainer meshrl does not run, as one problem (``async_keys``)."""
    return with_async_keys(c.once(key_policy)[0], c.once(async_problems)[2])


@refusal("config", "async_training", "rollout", "trainer.v1")
def async_ranges(c: Checked) -> list[str]:
    """The asynchronous trainers' keys out of their ranges (``async_keys.async_problems``)."""
    return c.once(async_problems)[0]


@refusal("config", "reward.reward_kwargs", "reward_model.reward_kwargs")
def reward_manager_arguments(c: Checked) -> list[str]:
    """The reward manager's arguments, as verl asserts them (``reward_kwargs.reward_kwargs_problems``)."""
    return reward_kwargs_problems(c.cfg)


@refusal("config", "algorithm", "actor_rollout_ref", "critic")
def run_plan_problems(c: Checked) -> list[str]:
    """Unknown method names (estimator, losses, KL penalties) and phases whose micro-batching cannot be built
    (``run_plan.check_run_plan``)."""
    return c.once(check_run_plan)[1]


@refusal("config", "data")
def data_problems(c: Checked) -> list[str]:
    """The data section's sizes and choices."""
    p, data = _Problems(), c.cfg.data
    p.require(bool(data.train_files), "data.train_files", "is empty; give a parquet/jsonl path or a list")
    p.positive(data.train_batch_size, "data.train_batch_size")
    p.positive(data.max_prompt_length, "data.max_prompt_length")
    p.positive(data.max_response_length, "data.max_response_length")
    p.choice(data.truncation, "data.truncation", TRUNCATION_MODES)
    if data.val_batch_size is not None:
        p.positive(data.val_batch_size, "data.val_batch_size")
    return p.items


@refusal("config", "actor_rollout_ref.rollout", "data.apply_chat_template_kwargs", "data.return_raw_chat")
def rollout_problems(c: Checked) -> list[str]:
    """The rollout's sampling and engine settings, and what multi-turn rollouts and async mode need."""
    p, cfg = _Problems(), c.cfg
    rollout = cfg.actor_rollout_ref.rollout
    p.choice(rollout.name, "actor_rollout_ref.rollout.name", ROLLOUT_ENGINES)
    p.require(rollout.n >= 1, "actor_rollout_ref.rollout.n", f"must be >= 1 responses per prompt, got {rollout.n}")
    p.require(rollout.temperature > 0, "actor_rollout_ref.rollout.temperature",
              f"must be > 0: the trained log-probs are those of softmax(logits / temperature), got "
              f"{rollout.temperature} (greedy decoding belongs to rollout.val_kwargs.temperature=0)")
    p.require(0 < rollout.top_p <= 1, "actor_rollout_ref.rollout.top_p", f"must be in (0, 1], got {rollout.top_p}")
    p.require(rollout.top_k == -1 or rollout.top_k >= 1, "actor_rollout_ref.rollout.top_k",
              f"must be -1 (off) or >= 1, got {rollout.top_k}")
    p.require(0 < rollout.gpu_memory_utilization <= 1, "actor_rollout_ref.rollout.gpu_memory_utilization",
              f"must be in (0, 1], got {rollout.gpu_memory_utilization}")
    p.positive(rollout.tensor_model_parallel_size, "actor_rollout_ref.rollout.tensor_model_parallel_size")
    p.positive(rollout.update_weights_bucket_megabytes, "actor_rollout_ref.rollout.update_weights_bucket_megabytes")
    if rollout.kv_cache_memory_bytes is not None:
        p.positive(rollout.kv_cache_memory_bytes, "actor_rollout_ref.rollout.kv_cache_memory_bytes")

    p.choice(rollout.mode, "actor_rollout_ref.rollout.mode", ROLLOUT_MODES)
    # The workers render tool messages with the chat template but receive only their own config section.
    p.require(not (rollout.multi_turn.enable and cfg.data.apply_chat_template_kwargs),
              "data.apply_chat_template_kwargs",
              "with rollout.multi_turn.enable the workers render tool messages without these template arguments "
              "(passing them on is not built yet), so the turns after a tool call would be rendered unlike the "
              "prompt; remove them, or set rollout.multi_turn.enable=False")
    # Every rank of a replica runs the tools itself; one whose output depends on timing (a time limit) could
    # make the ranks of one engine feed it different tokens.
    p.require(not (rollout.multi_turn.enable and rollout.tensor_model_parallel_size > 1),
              "actor_rollout_ref.rollout.tensor_model_parallel_size",
              "multi-turn rollouts run their tools on every rank of an inference replica, and sharing one rank's "
              "tool outputs with the others is not built yet; set it to 1 with rollout.multi_turn.enable")
    # Interactions play the user of multi-turn conversations and read them as chat messages (verl's raw_prompt).
    for key, what in (("interaction_config_path", "interactions answer"),
                      ("function_tool_path", "function tools run in"),
                      ("tool_config_path", "tools run in")):
        p.require(not rollout.multi_turn[key] or rollout.multi_turn.enable,
                  f"actor_rollout_ref.rollout.multi_turn.{key}",
                  f"{what} the turns of multi-turn rollouts; set rollout.multi_turn.enable=True, or unset it")
    p.require(not (rollout.multi_turn.interaction_config_path and not cfg.data.return_raw_chat), "data.return_raw_chat",
              "interactions read each conversation as chat messages, starting with the prompt's (verl's raw_prompt); "
              "set data.return_raw_chat=True with rollout.multi_turn.interaction_config_path")
    # Async rollout steps vLLM's engine request by request (meshrl.rollout.async_engine); transformers has no such API.
    p.require(not (rollout.mode == "async" and rollout.name == "hf"), "actor_rollout_ref.rollout.mode",
              "async drives vLLM's engine request by request, and rollout.name=hf generates in batches only; set "
              "rollout.mode=sync with rollout.name=hf, or rollout.name=vllm")
    return p.items


@refusal("config", "actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic.strategy", "reward_model.strategy")
def policy_problems(c: Checked) -> list[str]:
    """The roles' backend, the actor's and the reference's batches, losses, optimizer and Megatron layout."""
    p, cfg = _Problems(), c.cfg
    data, arr = cfg.data, cfg.actor_rollout_ref
    actor, rollout, ref, critic = arr.actor, arr.rollout, arr.ref, cfg.critic
    for key, section in (("actor_rollout_ref.actor", actor), ("actor_rollout_ref.ref", ref), ("critic", critic),
                         ("reward_model", cfg.reward_model)):
        p.require(section.strategy in ("megatron", *FSDP_STRATEGIES), f"{key}.strategy",
                  f"meshrl trains with its Megatron backend; got '{section.strategy}'. Set megatron (verl's FSDP "
                  f"names {', '.join(FSDP_STRATEGIES)} load with a warning)")
    _check_reference_layout(p, actor.megatron, ref.megatron)
    _check_mini_batch(p, actor.ppo_mini_batch_size, data.train_batch_size,
                      "actor_rollout_ref.actor.ppo_mini_batch_size")
    for key in ("log_prob_max_token_len_per_gpu",):
        for section, name in ((ref, "ref"), (rollout, "rollout")):
            value = section[key]
            if value is not None:
                p.positive(value, f"actor_rollout_ref.{name}.{key}")
    p.positive(actor.ppo_epochs, "actor_rollout_ref.actor.ppo_epochs")
    p.choice(actor.loss_agg_mode, "actor_rollout_ref.actor.loss_agg_mode", LOSS_AGG_MODES)
    for key in ("clip_ratio", "clip_ratio_low", "clip_ratio_high"):
        value = actor[key]
        if value is not None:
            p.require(value > 0, f"actor_rollout_ref.actor.{key}", f"must be > 0, got {value}")
    p.require(actor.clip_ratio_c > 1, "actor_rollout_ref.actor.clip_ratio_c",
              f"the dual-clip bound must be > 1, got {actor.clip_ratio_c}")
    # the options a policy loss divides by or cannot do without (dro_beta has no default)
    for key in LOSS_OPTIONS_ABOVE_ZERO.get(actor.policy_loss.loss_mode, ()):
        p.positive(OmegaConf.select(actor, key), f"actor_rollout_ref.actor.{key}")
    p.require(actor.kl_loss_coef >= 0, "actor_rollout_ref.actor.kl_loss_coef",
              f"must be >= 0, got {actor.kl_loss_coef}")
    _check_optim(p, actor.optim, "actor_rollout_ref.actor.optim")
    _check_megatron(p, cfg, actor.megatron, "actor_rollout_ref.actor.megatron", arr.model)
    p.choice(ref.megatron.dtype, "actor_rollout_ref.ref.megatron.dtype", MEGATRON_DTYPES)
    return p.items


@refusal("config", "critic", "reward_model.megatron")
def critic_problems(c: Checked) -> list[str]:
    """The critic's switch against the estimator, and its (and the learned reward model's) batches and layout."""
    p, cfg = _Problems(), c.cfg
    plan = c.once(check_run_plan)[0]
    use_critic = plan is not None and plan.use_critic
    data, critic, algo = cfg.data, cfg.critic, cfg.algorithm
    # when the estimator takes values (PPO's gae)
    if plan is not None and critic.enable is not None and critic.enable != use_critic:
        p.items.append(_critic_switch_problem(critic.enable, algo.adv_estimator))
    if use_critic:
        if critic.ppo_mini_batch_size is not None:
            _check_mini_batch(p, critic.ppo_mini_batch_size, data.train_batch_size, "critic.ppo_mini_batch_size")
        if critic.ppo_epochs is not None:
            p.positive(critic.ppo_epochs, "critic.ppo_epochs")
        _check_optim(p, critic.optim, "critic.optim")
        _check_megatron(p, cfg, critic.megatron, "critic.megatron", critic.model)
        p.require(critic.cliprange_value > 0, "critic.cliprange_value", f"must be > 0, got {critic.cliprange_value}")
    if cfg.reward_model.enable:  # the learned reward model's own layout (meshrl.workers.reward_model)
        _check_megatron(p, cfg, cfg.reward_model.megatron, "reward_model.megatron", cfg.reward_model.model)
        p.choice(cfg.reward_model.megatron.dtype, "reward_model.megatron.dtype", MEGATRON_DTYPES)
    return p.items


@refusal("config", "algorithm", "actor_rollout_ref.rollout.n", "actor_rollout_ref.actor.calculate_sum_pi_squared")
def algorithm_problems(c: Checked) -> list[str]:
    """The algorithm's ranges, and what the chosen estimator needs (group size, Σπ², reward components)."""
    p, cfg = _Problems(), c.cfg
    plan = c.once(check_run_plan)[0]
    algo, actor, critic, rollout = cfg.algorithm, cfg.actor_rollout_ref.actor, cfg.critic, cfg.actor_rollout_ref.rollout
    p.require(0 <= algo.gamma <= 1, "algorithm.gamma", f"must be in [0, 1], got {algo.gamma}")
    p.require(0 <= algo.lam <= 1, "algorithm.lam", f"must be in [0, 1], got {algo.lam}")
    p.choice(algo.kl_ctrl.type, "algorithm.kl_ctrl.type", KL_CTRL_TYPES)
    p.require(algo.kl_ctrl.kl_coef >= 0, "algorithm.kl_ctrl.kl_coef", f"must be >= 0, got {algo.kl_ctrl.kl_coef}")
    p.positive(algo.kl_ctrl.horizon, "algorithm.kl_ctrl.horizon")
    p.positive(algo.kl_ctrl.target_kl, "algorithm.kl_ctrl.target_kl")
    p.choice(algo.gpg.alpha_mode, "algorithm.gpg.alpha_mode", ("paper", "verl"))
    for key, factor in (("actor_rollout_ref.actor", actor.loss_scale_factor), ("critic", critic.loss_scale_factor)):
        p.require(factor is None or factor > 0, f"{key}.loss_scale_factor",
                  f"seq-mean-token-sum-norm divides by it: must be > 0 or null (the response width), got {factor}")
    if (plan is not None and "uid" in estimator_inputs(plan.adv_estimator) and rollout.n < 2
            and plan.adv_estimator not in SOLO_GROUP_ADVANTAGE):  # those train on a group of one (a start-up note)
        p.items.append(f"actor_rollout_ref.rollout.n: {_group_size_problem(plan.adv_estimator, rollout.n)}")
    if plan is not None and "sum_pi_squared" in estimator_inputs(plan.adv_estimator):
        p.require(actor.calculate_sum_pi_squared, "actor_rollout_ref.actor.calculate_sum_pi_squared",
                  f"{plan.adv_estimator} weighs each token by 1 - 2π + Σπ², whose Σπ² (sum_pi_squared) the "
                  "policy's old-log-prob pass gives only with this key: set it True, as verl requires")
    p.require(algo.adv_estimator != "gdpo" or bool(algo.gdpo_reward_keys), "algorithm.gdpo_reward_keys",
              "gdpo normalises each reward component on its own: list their names, the keys of the reward "
              "function's returned dict beside 'score' (e.g. [accuracy_reward,format_reward]), as verl requires")
    if algo.gdpo_reward_keys and algo.gdpo_reward_weights is not None:
        p.require(len(algo.gdpo_reward_weights) == len(algo.gdpo_reward_keys), "algorithm.gdpo_reward_weights",
                  f"one weight per algorithm.gdpo_reward_keys entry: {len(algo.gdpo_reward_keys)} keys, "
                  f"{len(algo.gdpo_reward_weights)} weights")
    return p.items


@refusal("config", "trainer", "reward_model.on_nonfinite_score", "reward_model.max_failed_batches",
         "actor_rollout_ref.nccl_timeout")
def trainer_problems(c: Checked) -> list[str]:
    """The trainer's sizes, frequencies and choices, and the process count against the rollout's tensor parallelism."""
    p, cfg = _Problems(), c.cfg
    data, trainer, rollout = cfg.data, cfg.trainer, cfg.actor_rollout_ref.rollout
    p.choice(trainer.device, "trainer.device", DEVICES)
    p.positive(trainer.nnodes, "trainer.nnodes")
    p.positive(trainer.n_gpus_per_node, "trainer.n_gpus_per_node")
    p.positive(trainer.total_epochs, "trainer.total_epochs")
    if trainer.total_training_steps is not None:
        p.positive(trainer.total_training_steps, "trainer.total_training_steps")
    p.freq(trainer.save_freq, "trainer.save_freq")
    p.require(not trainer.val_only or bool(data.val_files), "trainer.val_only",
              "validates and stops, but there is no validation set: set data.val_files")
    p.freq(trainer.test_freq, "trainer.test_freq")
    p.require(trainer.critic_warmup >= 0, "trainer.critic_warmup", f"must be >= 0, got {trainer.critic_warmup}")
    p.choice(trainer.resume_mode, "trainer.resume_mode", RESUME_MODES)
    p.require(trainer.resume_mode != "resume_path" or bool(trainer.resume_from_path), "trainer.resume_from_path",
              "must be set when trainer.resume_mode=resume_path")
    for name in trainer.logger:
        p.choice(name, "trainer.logger", LOGGERS)
    p.positive(trainer.worker_timeout_s, "trainer.worker_timeout_s")
    p.choice(trainer.on_nonfinite_loss, "trainer.on_nonfinite_loss", NONFINITE_ACTIONS)
    p.choice(trainer.on_nonfinite_grad_norm, "trainer.on_nonfinite_grad_norm", NONFINITE_ACTIONS)
    p.choice(cfg.reward_model.on_nonfinite_score, "reward_model.on_nonfinite_score", NONFINITE_ACTIONS)
    p.require(cfg.reward_model.max_failed_batches >= 0, "reward_model.max_failed_batches",
              f"must be >= 0 (0: never stop), got {cfg.reward_model.max_failed_batches}")
    p.positive(cfg.actor_rollout_ref.nccl_timeout, "actor_rollout_ref.nccl_timeout")
    ws = world_size(cfg)
    p.require(ws % rollout.tensor_model_parallel_size == 0, "actor_rollout_ref.rollout.tensor_model_parallel_size",
              f"{rollout.tensor_model_parallel_size} must divide the {ws} training processes "
              "(trainer.nnodes × trainer.n_gpus_per_node)")
    return p.items


def _megatron_sections(cfg: DictConfig, use_critic: bool, with_reference: bool) -> dict[str, DictConfig]:
    """The ``megatron`` sections of the roles this run builds, by key: the actor's (and the reference's when
    ``with_reference``), the critic's with a critic, the reward model's when enabled."""
    sections = {"actor_rollout_ref.actor.megatron": cfg.actor_rollout_ref.actor.megatron}
    if with_reference:
        sections["actor_rollout_ref.ref.megatron"] = cfg.actor_rollout_ref.ref.megatron
    if use_critic:
        sections["critic.megatron"] = cfg.critic.megatron
    if cfg.reward_model.enable:
        sections["reward_model.megatron"] = cfg.reward_model.megatron
    return sections


def _sequence_parallel_notes(cfg: DictConfig, use_critic: bool) -> list[str]:
    """megatron.sequence_parallel=True where a role runs at TP 1: turned off there, with this note, as verl's
    Megatron engine does (it splits activations over the TP ranks; there are none to split over). The reference
    takes the actor's (_check_reference_layout refuses any other)."""
    sections = _megatron_sections(cfg, use_critic, with_reference=False)
    return [f"{key}.sequence_parallel=True at tensor_model_parallel_size=1: off, as in verl (sequence parallelism "
            "splits activations over the TP ranks)" for key, mg in sections.items()
            if mg["sequence_parallel"] and mg["tensor_model_parallel_size"] == 1]


# megatron's TransformerConfig.moe_router_dtype (null: the parameters' dtype)
MOE_ROUTER_DTYPES = ("fp32", "fp64")
# megatron's TransformerConfig.moe_token_dispatcher_type (meshrl's expert layer runs alltoall: MOE_EXPERT_LAYER)
MOE_DISPATCHERS = ("allgather", "alltoall", "flex")


def _fused_kernel_notes(cfg: DictConfig, use_critic: bool) -> list[str]:
    """One note naming the fused-kernel switches set on a run where their kernels cannot run: ``trainer.device=cpu``,
    or no transformer_engine installed (they are Transformer Engine's CUDA kernels). The model builder turns them
    off there, and megatron's unfused code computes the same (megatron itself would refuse to build)."""
    import importlib.util

    if cfg.trainer.device != "cpu" and importlib.util.find_spec("transformer_engine") is not None:
        return []
    sections = _megatron_sections(cfg, use_critic, with_reference=True)
    on = [f"{key}.override_transformer_config.{switch}=True" for key, mg in sections.items()
          for switch in FUSED_KERNEL_SWITCHES if mg.override_transformer_config.get(switch)]
    if not on:
        return []
    why = "trainer.device=cpu" if cfg.trainer.device == "cpu" else "transformer_engine is not installed"
    return [f"{', '.join(on)}: off ({why}): these switch on Transformer Engine's fused CUDA kernels; the same "
            "computation runs unfused"]


def _moe_expert_layer_notes(cfg: DictConfig, use_critic: bool) -> list[str]:
    """One note naming the expert layer's performance settings a run asks for that meshrl's expert layer does not
    take (``key_policy.MOE_EXPERT_LAYER``): they change megatron's speed, not its numbers."""
    asked = {}
    for key, mg in _megatron_sections(cfg, use_critic, with_reference=True).items():
        overrides = mg.override_transformer_config
        if entries := [f"{name}={overrides[name]}" for name, value in MOE_EXPERT_LAYER.items()
                       if overrides.get(name, value) != value]:
            asked[f"{key}.override_transformer_config"] = ", ".join(entries)
    if not asked:
        return []
    return ["; ".join(f"{key}: {entries}" for key, entries in asked.items()) + ": not taken: meshrl's expert layer "
            "computes the experts one after another (megatron's SequentialMLP) and exchanges tokens with megatron's "
            "alltoall dispatcher; grouped GEMM, DeepEP and the flex dispatcher are CUDA kernels for speed that compute "
            "the same numbers"]


# Group estimators whose advantage for a group of one still carries the reward, as verl computes it (a group of one
# has mean 0, std 1, no baseline): these train at rollout.n=1, as verl's rollout-correction examples run RLOO and GRPO,
# with a note saying what the advantage is. The other group estimators have nothing to train on there: verl's
# rloo_vectorized gives a group of one advantage 0, and grpo_passk refuses it (it credits the best of >= 2 samples).
_RAW_SCORE = "its raw score: REINFORCE without a baseline, as in verl"
_GRPO_RAW_SCORE = ("its raw score (/ (1 + epsilon) with norm_adv_by_std_in_grpo: std 1): REINFORCE without a baseline, "
                   "as in verl")
SOLO_GROUP_ADVANTAGE = {
    "rloo": _RAW_SCORE,
    "grpo": _GRPO_RAW_SCORE,
    "grpo_vectorized": _GRPO_RAW_SCORE,
    "opo": _RAW_SCORE,
    "gpg": "its raw score times GPG's alpha: REINFORCE without a baseline, as in verl",
    "reinforce_plus_plus_baseline": "its raw score whitened over the batch (REINFORCE++'s batch baseline only), as in "
                                    "verl",
    "gdpo": "the sum of its raw reward components, whitened over the batch, as in verl",
    "optimal_token_baseline": "its reward-to-go without a baseline, as in verl",
    "tir_optimal_token_baseline": "its reward-to-go without a baseline, as in verl",
}


def _group_size_problem(estimator: str, n: int) -> str:
    """A group estimator (one taking ``uid``) at ``rollout.n`` < 2 whose group of one has nothing to train on
    (``SOLO_GROUP_ADVANTAGE`` lists those that train there): its advantages would all be 0, or it refuses."""
    without_groups = [name for name in ADVANTAGE_ESTIMATORS.names()
                      if "uid" not in estimator_inputs(name) or name in SOLO_GROUP_ADVANTAGE]
    return (f"{estimator} baselines each response against the other responses to the same prompt (its group), so it "
            f"needs at least 2 responses per prompt, got {n}: a group of one has nothing to compare with. Set "
            f"actor_rollout_ref.rollout.n=2 or more, or pick an estimator that trains on groups of one: "
            f"{', '.join(without_groups)}")


def _critic_switch_problem(enable: bool, estimator: str) -> str:
    """verl's critic.enable set against the estimator: meshrl's critic is the estimator's (the run plan's)."""
    if enable:
        return (f"critic.enable: True, but {estimator} takes no values, so meshrl trains no critic for it; set "
                "algorithm.adv_estimator=gae for a critic, or drop critic.enable (null: the estimator decides)")
    return (f"critic.enable: False, but {estimator}'s advantages need the critic's values; pick an estimator without "
            "a critic (e.g. grpo, rloo, reinforce_plus_plus), or drop critic.enable (null: the estimator decides)")


def _check_reference_layout(p: _Problems, actor: DictConfig, ref: DictConfig) -> None:
    """The reference runs in the policy's processes, on the policy's parallel layout (verl's Megatron workers do
    the same); its megatron section may repeat the actor's sizes, not change them."""
    for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
                 "context_parallel_size", "expert_model_parallel_size", "expert_tensor_parallel_size",
                 "sequence_parallel", "seed"):
        p.require(ref[name] == actor[name] or ref[name] == REF_LAYOUT_DEFAULTS[name],
                  f"actor_rollout_ref.ref.megatron.{name}",
                  f"{ref[name]} differs from the actor's {actor[name]}; the reference shares the actor's layout: "
                  "set them equal or drop the ref key")
    if ref.use_dist_checkpointing:
        p.require(bool(ref.dist_checkpointing_path), "actor_rollout_ref.ref.megatron.dist_checkpointing_path",
                  "must name a megatron checkpoint when use_dist_checkpointing=True")


def _check_mini_batch(p: _Problems, size: int, batch: int, key: str) -> None:
    p.positive(size, key)
    if batch > 0 and size > 0:
        p.require(size <= batch, key, f"{size} prompts is more than data.train_batch_size={batch}; lower it to at "
                  "most the batch size")
        p.require(batch % size == 0, key, f"must divide data.train_batch_size={batch} (got {size})")


def _check_optim(p: _Problems, optim: DictConfig, key: str) -> None:
    p.require(optim.lr >= 0, f"{key}.lr", f"must be >= 0, got {optim.lr}")
    p.require(0 <= optim.lr_warmup_steps_ratio <= 1, f"{key}.lr_warmup_steps_ratio",
              f"must be in [0, 1], got {optim.lr_warmup_steps_ratio}")
    p.require(0 <= optim.min_lr_ratio <= 1, f"{key}.min_lr_ratio", f"must be in [0, 1], got {optim.min_lr_ratio}")
    fsdp_style = optim.lr_scheduler_type or optim.warmup_style
    p.choice(fsdp_style, f"{key}.lr_scheduler_type", LR_SCHEDULES)
    if optim.lr_decay_style is not None:
        p.choice(optim.lr_decay_style, f"{key}.lr_decay_style", LR_DECAY_STYLES)
        p.require(fsdp_style in ("constant", optim.lr_decay_style), f"{key}.lr_decay_style",
                  f"'{optim.lr_decay_style}' disagrees with lr_scheduler_type/warmup_style '{fsdp_style}' (verl's FSDP "
                  "name of the same setting); set one of them")
        p.require(optim.lr_decay_style != "WSD" or bool(optim.lr_wsd_decay_steps), f"{key}.lr_wsd_decay_steps",
                  "must be set (the anneal's length in RL steps) with lr_decay_style=WSD")
    # min_lr and lr_warmup_init are bounded by lr: against a negative lr, whose own line says what to fix, a bound
    # problem would be a second, misleading line (lr_warmup_init's default 0 is not in [0, -1])
    lr_ok = optim.lr >= 0
    if optim.min_lr is not None:
        p.require(not lr_ok or 0 <= optim.min_lr <= optim.lr, f"{key}.min_lr",
                  f"must be in [0, lr={optim.lr}], got {optim.min_lr}")
        p.require(optim.min_lr_ratio == 0, f"{key}.min_lr",
                  f"and min_lr_ratio={optim.min_lr_ratio} both set the floor (verl's Megatron and FSDP names); set one")
    p.require(not lr_ok or 0 <= optim.lr_warmup_init <= optim.lr, f"{key}.lr_warmup_init",
              f"must be in [0, lr={optim.lr}], got {optim.lr_warmup_init}")
    p.require(optim.num_cycles == 0.5, f"{key}.num_cycles",
              f"the cosine schedule is a half cycle (0.5); {optim.num_cycles} is not supported")
    p.require(optim.optimizer.lower() in ("adam", "adamw"), f"{key}.optimizer",
              f"'{optim.optimizer}' is not wired; meshrl trains with megatron's Adam (decoupled weight decay, AdamW)")
    p.choice(optim.weight_decay_incr_style, f"{key}.weight_decay_incr_style", WD_INCR_STYLES)
    p.choice(optim.lr_wsd_decay_style, f"{key}.lr_wsd_decay_style", WSD_DECAY_STYLES)
    if optim.lr_decay_steps is not None:
        p.positive(optim.lr_decay_steps, f"{key}.lr_decay_steps")
    p.require(optim.weight_decay >= 0, f"{key}.weight_decay", f"must be >= 0, got {optim.weight_decay}")
    p.require(len(optim.betas) == 2 and all(0 <= b < 1 for b in optim.betas), f"{key}.betas",
              f"must be two numbers in [0, 1), got {list(optim.betas)}")
    p.require(optim.clip_grad > 0, f"{key}.clip_grad", f"must be > 0, got {optim.clip_grad}")
    if optim.override_optimizer_config:
        # megatron is imported only for this check: most configs have no overrides, and loading stays fast.
        from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig

        _check_fields(p, optim.override_optimizer_config, MegatronOptimizerConfig, f"{key}.override_optimizer_config")


def _check_fields(p: _Problems, overrides, dataclass_type, key: str) -> None:
    """Every name in ``overrides`` must be a field of megatron's ``dataclass_type`` (did-you-mean otherwise)."""
    known = set(dataclass_type.__dataclass_fields__)
    for name in overrides:
        close = difflib.get_close_matches(name, known, n=2)
        p.require(name in known, f"{key}.{name}", f"megatron's {dataclass_type.__name__} has no such field"
                  + (f"; did you mean {' or '.join(close)}?" if close else ""))


def _check_megatron(p: _Problems, cfg: DictConfig, mg: DictConfig, key: str, model: DictConfig) -> None:
    """The role's megatron section ``mg`` (at ``key``) against the process count; ``model``: the role's model
    section."""
    for size in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
                 "expert_model_parallel_size"):
        p.positive(mg[size], f"{key}.{size}")
    model_key = key.replace("actor.megatron", "model").replace("megatron", "model")
    # Refused here rather than when the workers build their models, after Ray and a rollout started.
    p.require(mg.context_parallel_size <= 1 or model.use_remove_padding, f"{model_key}.use_remove_padding",
              f"False, but {key}.context_parallel_size={mg.context_parallel_size} splits packed sequences over its "
              "ranks: set use_remove_padding=True (verl's Megatron default) or context_parallel_size=1")
    model_parallel = mg.tensor_model_parallel_size * mg.pipeline_model_parallel_size * mg.context_parallel_size
    ws = world_size(cfg)
    if model_parallel > 0:
        p.require(ws % model_parallel == 0, key,
                  f"TP×PP×CP = {model_parallel} must divide the {ws} training processes "
                  "(trainer.nnodes × trainer.n_gpus_per_node); change the parallel sizes or the process count")
    experts = ((mg.expert_tensor_parallel_size or mg.tensor_model_parallel_size) * mg.expert_model_parallel_size
               * mg.pipeline_model_parallel_size)
    if experts > 0:
        p.require(ws % experts == 0, f"{key}.expert_model_parallel_size",
                  f"expert TP×EP×PP = {experts} must divide the {ws} training processes "
                  "(trainer.nnodes × trainer.n_gpus_per_node); change the expert parallel sizes or the process count")
    if mg.virtual_pipeline_model_parallel_size is not None:
        p.require(mg.pipeline_model_parallel_size > 1, f"{key}.virtual_pipeline_model_parallel_size",
                  "needs pipeline_model_parallel_size > 1")
    p.require("sequence_parallel" not in mg.override_transformer_config,
              f"{key}.override_transformer_config.sequence_parallel",
              f"is verl's {key}.sequence_parallel; set it there (it is turned off at TP 1)")
    if mg.use_dist_checkpointing:
        p.require(bool(mg.dist_checkpointing_path), f"{key}.dist_checkpointing_path",
                  "must name a megatron checkpoint (from `meshrl convert hf-to-mcore --hf MODEL --out DIR`) when "
                  "use_dist_checkpointing=True")
    if mg.override_transformer_config:
        # megatron is imported only for this check: most configs override nothing, and loading stays fast.
        from megatron.core.transformer import TransformerConfig
        from megatron.core.transformer.enums import AttnBackend

        overrides = mg.override_transformer_config
        _check_fields(p, overrides, TransformerConfig, f"{key}.override_transformer_config")
        if "attention_backend" in overrides:
            p.choice(overrides.attention_backend, f"{key}.override_transformer_config.attention_backend",
                     [b.name for b in AttnBackend])
        if overrides.get("moe_router_dtype") is not None:
            p.choice(overrides.moe_router_dtype, f"{key}.override_transformer_config.moe_router_dtype",
                     MOE_ROUTER_DTYPES)
        if "moe_token_dispatcher_type" in overrides:
            p.choice(overrides.moe_token_dispatcher_type,
                     f"{key}.override_transformer_config.moe_token_dispatcher_type", MOE_DISPATCHERS)
        if "moe_router_load_balancing_type" in overrides:
            p.require(overrides.moe_router_load_balancing_type in MOE_BALANCING,
                      f"{key}.override_transformer_config.moe_router_load_balancing_type",
                      f"'{overrides.moe_router_load_balancing_type}' is not one of {', '.join(MOE_BALANCING)}: meshrl "
                      "applies megatron's per-micro-batch switch loss or none (seq_aux_loss would count a packed "
                      "micro-batch as one sequence, global_aux_loss keeps statistics across steps, sinkhorn changes "
                      "the model's routing)")
    mode = mg.router_replay.mode
    p.choice(mode, f"{key}.router_replay.mode", ROUTER_REPLAY_MODES)
    p.require(mode != "R3", f"{key}.router_replay.mode", ROLLOUT_ROUTING)
    p.require(not (mode == "R2" and cfg.actor_rollout_ref.rollout.enable_rollout_routing_replay),
              "actor_rollout_ref.rollout.enable_rollout_routing_replay",
              "R2 records the routing in the old-log-prob pass; the rollout's is R3's (verl refuses both at once)")
    p.require(mg.dtype in MEGATRON_DTYPES, f"{key}.dtype",
              f"'{mg.dtype}' is not one of {', '.join(MEGATRON_DTYPES)}"
              + ("; float16 needs loss scaling, which meshrl does not wire: use bfloat16"
                 if mg.dtype == "float16" else ""))


def validate_against_model(cfg: DictConfig, plan: RunPlan, hf_config) -> None:
    """Raise ``ConfigError`` listing ``engine_and_routing_problems`` (for ``meshrl plan``, which checks each role's
    layout itself with ``model_builder.layout_problem_lines``)."""
    refuse(engine_and_routing_problems(Checked(cfg, plan, hf_config)), "configuration for this model")


@refusal("model", "actor_rollout_ref.rollout.tensor_model_parallel_size",
         "actor_rollout_ref.actor.megatron.router_replay.mode")
def engine_and_routing_problems(c: Checked) -> list[str]:
    """The rollout's tensor parallelism must divide the model's attention heads; router replay needs a mixture of
    experts. (The trained roles' layouts: ``model_builder.layouts_shard_the_model``.)"""
    p, cfg, hf_config = _Problems(), c.cfg, c.hf_config
    text = hf_config.get_text_config()  # a vision-language model's language model (a text model: the config)
    heads = text.num_attention_heads
    moe = any(getattr(text, name, None) for name in ("num_experts", "num_local_experts", "n_routed_experts"))
    rtp = cfg.actor_rollout_ref.rollout.tensor_model_parallel_size
    p.require(heads % rtp == 0, "actor_rollout_ref.rollout.tensor_model_parallel_size",
              f"{rtp} does not divide the model's {heads} attention heads")
    replay = cfg.actor_rollout_ref.actor.megatron.router_replay.mode
    p.require(replay == "disabled" or bool(moe), "actor_rollout_ref.actor.megatron.router_replay.mode",
              f"{replay} replays expert routing, but {hf_config.model_type} is dense: set disabled")
    return p.items
