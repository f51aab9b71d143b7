"""verl's asynchronous trainers' keys: which ask for asynchronous training (refused until its drivers exist), and
their ranges.

verl trains asynchronously in three ways, each chosen by how it is started rather than by one switch:

- the fully async trainer (``python -m verl.experimental.fully_async_policy.fully_async_main
  --config-name=fully_async_ppo[_megatron]_trainer``): the ``async_training`` section (``staleness_threshold``,
  ``trigger_parameter_sync_step``, ``require_batches``, ``partial_rollout``, ...) and a top-level ``rollout``
  section (the rollouter's own ``nnodes`` / ``n_gpus_per_node``, ``total_rollout_steps``), which only its config
  has;
- the one-step-off trainer (``verl.experimental.one_step_off_policy.main_ppo
  --config-name=one_step_off_ppo[_megatron]_trainer``): the same top-level ``rollout.nnodes`` / ``n_gpus_per_node``;
- the V1 trainer's asynchronous modes: ``trainer.use_v1=True`` (verl's default) with ``trainer.v1.trainer_mode``
  ``colocate_async`` or ``separate_async`` (the latter on ``actor_rollout_ref.rollout.nnodes`` standalone nodes),
  tuned under ``trainer.v1.colocate_async`` / ``separate_async``. ``trainer_mode=sync`` (the default) is verl's
  synchronous colocated trainer, which meshrl's is; with ``use_v1=False`` verl runs its V0 trainer, also
  synchronous, and reads nothing of ``trainer.v1``.

meshrl has the sample queue with verl's staleness accounting (``meshrl.trainer.sample_queue``) but not the drivers
that run generation and training side by side. Until it does, every way of asking for them stops at config time
with ``ASYNC_TRAINING``: verl's asynchronous config names and any key of the two sections that only those configs
have (``meshrl.config.loader``, whatever the value: verl's defaults there still ask for asynchronous training), the
other keys away from their defaults (``meshrl.config.key_policy``), and an asynchronous ``trainer_mode`` (here).
"""

from __future__ import annotations

from omegaconf import DictConfig

ASYNC_TRAINING = (
    "asynchronous training (verl's fully async and one-step-off trainers, the V1 trainer's colocate_async / "
    "separate_async modes, a standalone rollout pool) is not built yet: meshrl has the sample queue with verl's "
    "staleness accounting (meshrl.trainer.sample_queue), not the drivers that generate while training. It trains "
    "synchronously and colocated (verl's trainer.v1.trainer_mode=sync; staleness_threshold=0 with "
    "trigger_parameter_sync_step=1 is that loop with data.train_batch_size = ppo_mini_batch_size × require_batches): "
    "drop these settings")

# verl's --config-name values of its asynchronous trainers (meshrl.config.loader refuses them)
ASYNC_CONFIG_NAMES = ("fully_async_ppo_trainer", "fully_async_ppo_megatron_trainer", "one_step_off_ppo_trainer",
                      "one_step_off_ppo_megatron_trainer")
# Sections only verl's asynchronous configs have: any key of them asks for asynchronous training.
ASYNC_SECTIONS = ("async_training", "rollout")
V1_TRAINER_MODES = ("sync", "colocate_async", "separate_async")
OFF_POLICY_STRATEGIES = ("drop", "wait")


def asks_for_async(key: str) -> bool:
    """True for a key of ``ASYNC_SECTIONS`` (the top-level ``rollout``, not ``actor_rollout_ref.rollout``)."""
    return key.split(".", 1)[0] in ASYNC_SECTIONS


def async_problems(cfg: DictConfig) -> tuple[list[str], list[str], list[str]]:
    """(problems, notes, async_keys) of ``cfg``'s asynchronous-training keys: values out of range (each naming its
    key), the ``trainer_mode`` that asks for asynchronous training (``async_keys``, to be refused with
    ``ASYNC_TRAINING``), and the note that ``trainer.v1`` is not read with ``use_v1=False``."""
    problems: list[str] = []

    def check(ok: bool, key: str, what: str, value) -> None:
        if not ok:
            problems.append(f"{key}: must be {what}, got {value}")

    at, top, trainer = cfg.async_training, cfg.rollout, cfg.trainer
    v1 = trainer.v1
    check(at.staleness_threshold >= 0, "async_training.staleness_threshold", ">= 0", at.staleness_threshold)
    for key in ("trigger_parameter_sync_step", "require_batches", "concurrent_samples_per_replica"):
        check(at[key] >= 1, f"async_training.{key}", ">= 1", at[key])
    check(0 < at.dynamic_schedule_deactivate_ratio <= 1, "async_training.dynamic_schedule_deactivate_ratio",
          "in (0, 1]", at.dynamic_schedule_deactivate_ratio)
    check(top.total_rollout_steps is None or top.total_rollout_steps >= 1, "rollout.total_rollout_steps",
          ">= 1 samples, or null (the training set x trainer.total_epochs)", top.total_rollout_steps)
    for key, value in (("rollout.nnodes", top.nnodes), ("actor_rollout_ref.rollout.nnodes",
                                                         cfg.actor_rollout_ref.rollout.nnodes)):
        check(value >= 0, key, ">= 0", value)
    for key, value in (("rollout.n_gpus_per_node", top.n_gpus_per_node),
                       ("actor_rollout_ref.rollout.n_gpus_per_node", cfg.actor_rollout_ref.rollout.n_gpus_per_node)):
        check(value >= 1, key, ">= 1", value)
    check(v1.trainer_mode in V1_TRAINER_MODES, "trainer.v1.trainer_mode", f"one of {', '.join(V1_TRAINER_MODES)}",
          f"'{v1.trainer_mode}'")
    check(v1.separate_async.parameter_sync_step >= 1, "trainer.v1.separate_async.parameter_sync_step", ">= 1",
          v1.separate_async.parameter_sync_step)
    for mode in ("colocate_async", "separate_async"):
        warmup = v1[mode].num_warmup_batches
        check(warmup >= 0, f"trainer.v1.{mode}.num_warmup_batches", ">= 0", warmup)
    ratio = v1.separate_async.hybrid_rollout.switch_threshold_ratio
    check(0 < ratio <= 1, "trainer.v1.separate_async.hybrid_rollout.switch_threshold_ratio", "in (0, 1]", ratio)
    # verl's V1 sampler asserts these at start-up in every mode
    check(v1.sampler.max_off_policy_threshold > 0, "trainer.v1.sampler.max_off_policy_threshold", "> 0",
          v1.sampler.max_off_policy_threshold)
    check(v1.sampler.max_off_policy_strategy in OFF_POLICY_STRATEGIES, "trainer.v1.sampler.max_off_policy_strategy",
          f"one of {', '.join(OFF_POLICY_STRATEGIES)}", f"'{v1.sampler.max_off_policy_strategy}'")

    notes, async_keys = [], []
    if v1.trainer_mode in V1_TRAINER_MODES and v1.trainer_mode != "sync":
        if trainer.use_v1:
            async_keys.append(f"trainer.v1.trainer_mode={v1.trainer_mode}")
        else:
            notes.append(f"trainer.v1.trainer_mode={v1.trainer_mode} has no effect with trainer.use_v1=False: verl's "
                         "V0 trainer is synchronous and reads nothing of trainer.v1 (nor does meshrl)")
    return problems, notes, async_keys


def with_async_keys(problems: list[str], keys: list[str]) -> list[str]:
    """``problems`` with ``keys`` added to the one ``ASYNC_TRAINING`` problem (or that problem added): one message
    for every way a config asks for asynchronous training."""
    if not keys:
        return problems
    for i, line in enumerate(problems):
        if line.endswith(f": {ASYNC_TRAINING}"):
            return [*problems[:i], f"{', '.join(keys)}, {line}", *problems[i + 1:]]
    return [*problems, f"{', '.join(keys)}: {ASYNC_TRAINING}"]
