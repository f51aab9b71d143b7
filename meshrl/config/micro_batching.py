"""How each forward / backward phase cuts a rank's batch into micro-batches, from verl's keys.

Either by a token budget per micro-batch (``use_dynamic_bsz=True``: ``*_max_token_len_per_gpu``,
Karmarkar–Karp balanced, ``meshrl.data.dynamic_batching.plan_micro_batches``) or by a number of
sequences per micro-batch (``use_dynamic_bsz=False``: ``*_micro_batch_size_per_gpu``, or verl's
deprecated global ``*_micro_batch_size`` divided by the data-parallel size, as verl's Megatron workers
do; ``plan_fixed_micro_batches``). Setting both forms of a size is refused, as verl refuses it. Loss
normalisation does not depend on the split (every micro-batch's loss is divided by its mini-batch's
global normaliser), so the choice changes speed and memory, never the gradient beyond rounding.

Keys per phase (dynamic? / token budget / sequences per micro-batch; ``a ?? b``: ``a``, or ``b`` when
``a`` is unset; "the actor's" is the same key of ``actor_rollout_ref.actor``):

- ``actor_update``: ``actor.use_dynamic_bsz`` / ``actor.ppo_max_token_len_per_gpu`` /
  ``actor.ppo_micro_batch_size[_per_gpu]``.
- ``actor_log_prob`` (old log-probs): ``rollout.log_prob_use_dynamic_bsz ?? the actor's`` /
  ``rollout.log_prob_max_token_len_per_gpu ?? the actor's`` /
  ``rollout.log_prob_micro_batch_size[_per_gpu] ?? actor.ppo_micro_batch_size[_per_gpu]``.
- ``ref_log_prob``: the same with ``ref.log_prob_*``.
- ``critic_update``: ``critic.use_dynamic_bsz ?? the actor's`` / ``critic.ppo_max_token_len_per_gpu`` /
  ``critic.ppo_micro_batch_size[_per_gpu] ?? actor.ppo_micro_batch_size[_per_gpu]``.
- ``critic_values``: dynamic as ``critic_update`` / ``critic.forward_max_token_len_per_gpu ??
  critic.ppo_max_token_len_per_gpu`` / ``critic.forward_micro_batch_size_per_gpu ?? critic_update's``.
- ``reward_model`` (the learned reward model's scores): ``reward_model.use_dynamic_bsz ?? critic_values'`` /
  ``reward_model.forward_max_token_len_per_gpu ?? critic_values'`` / ``reward_model.micro_batch_size[_per_gpu] ??
  critic_values'`` (verl interpolates the critic's keys the same way).

A forward-only pass falls back on the training pass's micro-batch size: it needs less memory per sequence.

Under context parallelism (the role's ``megatron.context_parallel_size`` = CP) a token budget is per CP group, as
verl's: ``*_max_token_len_per_gpu × CP`` tokens per micro-batch, each of the CP ranks holding 1/CP of them.
"""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import DictConfig, OmegaConf

PHASES = ("actor_update", "actor_log_prob", "ref_log_prob", "critic_update", "critic_values", "reward_model")
# The role whose layout runs each phase.
PHASE_ROLES = {"actor_update": "actor", "actor_log_prob": "actor", "ref_log_prob": "actor", "critic_update": "critic",
               "critic_values": "critic", "reward_model": "reward_model"}
# The config section holding each role's megatron layout.
ROLE_SECTIONS = {"actor": "actor_rollout_ref.actor", "critic": "critic", "reward_model": "reward_model"}


@dataclass(frozen=True)
class MicroBatching:
    """One phase's rule: ``max_token_len`` tokens per micro-batch (dynamic) or ``micro_batch_size`` sequences."""

    max_token_len: int | None = None
    micro_batch_size: int | None = None

    @property
    def dynamic(self) -> bool:
        return self.max_token_len is not None


def data_parallel_size(cfg: DictConfig, role: str = "actor") -> int:
    """Data-parallel ranks of ``role``'s layout (a key of ``ROLE_SECTIONS``): processes / (TP·PP·CP)."""
    mg = OmegaConf.select(cfg, ROLE_SECTIONS[role]).megatron
    model_parallel = mg.tensor_model_parallel_size * mg.pipeline_model_parallel_size * mg.context_parallel_size
    return max(1, cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node // max(1, model_parallel))


def _per_gpu(section: DictConfig, key: str, name: str, dp_size: int) -> int | None:
    """``section.<key>_per_gpu``, or the global ``section.<key>`` divided over ``dp_size`` ranks; None if unset."""
    per_gpu, total = section.get(f"{key}_per_gpu"), section.get(key)
    if per_gpu is not None and total is not None:
        raise ValueError(f"{name}.{key} and {name}.{key}_per_gpu are both set; keep {key}_per_gpu "
                         f"(sequences per micro-batch on one rank)")
    if total is None:
        return per_gpu
    if total < dp_size:
        raise ValueError(f"{name}.{key}={total} is less than one sequence per data-parallel rank ({dp_size} ranks); "
                         f"set {name}.{key}_per_gpu instead")
    return total // dp_size


def micro_batching(cfg: DictConfig, phase: str, dp_size: int) -> MicroBatching:
    """The rule of ``phase`` (one of ``PHASES``) for a layout with ``dp_size`` data-parallel ranks.

    Raises ``ValueError`` naming the keys to set when a phase without dynamic batching has no size.
    """
    arr = cfg.actor_rollout_ref
    actor, critic = arr.actor, cfg.critic
    actor_key = "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"
    actor_size = _per_gpu(actor, "ppo_micro_batch_size", "actor_rollout_ref.actor", dp_size)
    if phase == "actor_update":
        dynamic, budget, size = actor.use_dynamic_bsz, actor.ppo_max_token_len_per_gpu, actor_size
        sources = [actor_key]
        budget_key = "actor_rollout_ref.actor.ppo_max_token_len_per_gpu"
    elif phase in ("actor_log_prob", "ref_log_prob"):
        name = "actor_rollout_ref." + ("rollout" if phase == "actor_log_prob" else "ref")
        section = arr.rollout if phase == "actor_log_prob" else arr.ref
        own = _per_gpu(section, "log_prob_micro_batch_size", name, dp_size)
        dynamic = (actor.use_dynamic_bsz if section.log_prob_use_dynamic_bsz is None
                   else section.log_prob_use_dynamic_bsz)
        budget = section.log_prob_max_token_len_per_gpu or actor.ppo_max_token_len_per_gpu
        budget_key = f"{name}.log_prob_max_token_len_per_gpu"
        size = own if own is not None else actor_size
        sources = [f"{name}.log_prob_micro_batch_size_per_gpu", actor_key]
    elif phase in ("critic_update", "critic_values"):
        dynamic = actor.use_dynamic_bsz if critic.use_dynamic_bsz is None else critic.use_dynamic_bsz
        own = _per_gpu(critic, "ppo_micro_batch_size", "critic", dp_size)
        size = own if own is not None else actor_size
        budget, budget_key = critic.ppo_max_token_len_per_gpu, "critic.ppo_max_token_len_per_gpu"
        sources = ["critic.ppo_micro_batch_size_per_gpu", actor_key]
        if phase == "critic_values":
            budget = critic.forward_max_token_len_per_gpu or budget
            budget_key = "critic.forward_max_token_len_per_gpu"
            size = critic.forward_micro_batch_size_per_gpu or size
            sources.insert(0, "critic.forward_micro_batch_size_per_gpu")
    elif phase == "reward_model":
        rm = cfg.reward_model
        critic_dynamic = actor.use_dynamic_bsz if critic.use_dynamic_bsz is None else critic.use_dynamic_bsz
        dynamic = critic_dynamic if rm.use_dynamic_bsz is None else rm.use_dynamic_bsz
        budget = rm.forward_max_token_len_per_gpu or critic.forward_max_token_len_per_gpu \
            or critic.ppo_max_token_len_per_gpu
        budget_key = "reward_model.forward_max_token_len_per_gpu"
        candidates = (_per_gpu(rm, "micro_batch_size", "reward_model", dp_size),
                      critic.forward_micro_batch_size_per_gpu,
                      _per_gpu(critic, "ppo_micro_batch_size", "critic", dp_size), actor_size)
        size = next((c for c in candidates if c is not None), None)
        sources = ["reward_model.micro_batch_size_per_gpu", "critic.forward_micro_batch_size_per_gpu",
                   "critic.ppo_micro_batch_size_per_gpu", actor_key]
    else:
        raise ValueError(f"unknown phase {phase!r}; one of {', '.join(PHASES)}")
    if dynamic:
        if not budget or budget <= 0:
            raise ValueError(f"{phase}: use_dynamic_bsz=True needs a token budget > 0 ({budget_key}), got {budget}")
        context = OmegaConf.select(cfg, ROLE_SECTIONS[PHASE_ROLES[phase]]).megatron.context_parallel_size
        return MicroBatching(max_token_len=int(budget) * max(1, context))
    if size is None or size <= 0:
        raise ValueError(f"{phase}: use_dynamic_bsz=False needs sequences per micro-batch > 0 (got {size}) from "
                         f"the first set of {', '.join(sources)}; or set use_dynamic_bsz=True with a token budget")
    return MicroBatching(micro_batch_size=int(size))
