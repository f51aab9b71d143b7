"""verl's asynchronous trainers' keys: which trainer reads them, which ask for what meshrl lacks, and their ranges.

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

meshrl runs the first two (``meshrl.trainer.async_trainer``), selected by ``trainer.async_mode``, which verl's config
names set (``meshrl/config/verl_async/``). A key of ``async_training`` asks for the fully async trainer, one of the
top-level ``rollout`` for either: in a run of another trainer it is refused at load time, whatever its value
(``meshrl.config.loader``), all such keys in one message. Of the V1 modes, ``colocate_async`` runs
(``meshrl.trainer.colocate_async_trainer``; ``trainer.v1.colocate_async.*`` and the sampler's
``max_off_policy_*`` are read by it alone and refused elsewhere: ``COLOCATE_ONLY``); ``separate_async`` is not built:
it and the keys that tune it are refused (``V1_ASYNC``; here and ``meshrl.config.key_policy``).
"""

from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

from meshrl.config.refusals import Checked, refusal

ASYNC_TRAINING = (
    "the asynchronous trainers' sections are read by those trainers only: async_training.* by the fully async "
    "trainer (--config-name=fully_async_ppo_trainer or fully_async_ppo_megatron_trainer, as verl's fully async "
    "scripts start; or trainer.async_mode=fully_async), the top-level rollout.* by it and the one-step-off trainer "
    "(--config-name=one_step_off_ppo_trainer / one_step_off_ppo_megatron_trainer; trainer.async_mode=one_step_off). "
    "Start the run with one of those config names, or drop these settings")
V1_ASYNC = (
    "verl's V1 trainer's asynchronous modes on standalone rollout nodes (trainer.v1.trainer_mode=separate_async, "
    "actor_rollout_ref.rollout.nnodes) are not built yet; meshrl's asynchronous trainers are verl's V1 "
    "colocate_async (trainer.v1.trainer_mode=colocate_async) and its one-step-off and fully async ones "
    "(--config-name=one_step_off_ppo_trainer / fully_async_ppo_trainer, or trainer.async_mode=one_step_off / "
    "fully_async): drop these settings or use one of those")
# verl V1's colocate_async keys (with their defaults): read by that trainer only
COLOCATE_ONLY = {"trainer.v1.colocate_async.num_warmup_batches": 1, "trainer.v1.sampler.max_off_policy_threshold": 8,
                 "trainer.v1.sampler.max_off_policy_strategy": "drop"}
ASYNC_MODES = ("one_step_off", "fully_async")

# verl's --config-name values of its asynchronous trainers (meshrl.config.loader refuses them)
ASYNC_CONFIG_NAMES = ("fully_async_ppo_trainer", "fully_async_ppo_megatron_trainer", "one_step_off_ppo_trainer",
                      "one_step_off_ppo_megatron_trainer")
# Sections only verl's asynchronous configs have: any key of them asks for asynchronous training.
ASYNC_SECTIONS = ("async_training", "rollout")
V1_TRAINER_MODES = ("sync", "colocate_async", "separate_async")
OFF_POLICY_STRATEGIES = ("drop", "wait")


def colocate_async(cfg: DictConfig) -> bool:
    """Whether ``cfg`` asks for verl V1's ``colocate_async`` trainer (``meshrl.trainer.colocate_async_trainer``)."""
    return bool(cfg.trainer.use_v1) and cfg.trainer.v1.trainer_mode == "colocate_async"


@refusal("config", "data.train_batch_size", "trainer.v1.trainer_mode")
def colocate_batch_split(c: Checked) -> list[str]:
    """verl V1's colocate_async trainer has each inference replica (training processes ÷ rollout TP) generate its
    share of every batch: the prompt groups must split evenly over them."""
    cfg = c.cfg
    processes = cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node
    tp = cfg.actor_rollout_ref.rollout.tensor_model_parallel_size
    if not colocate_async(cfg) or tp < 1 or processes % tp:  # a bad TP is the trainer rules' problem
        return []
    replicas, batch = processes // tp, cfg.data.train_batch_size
    return [] if batch % replicas == 0 else [
        f"data.train_batch_size: {batch} prompt groups must split evenly over the {replicas} inference replicas, "
        "which each generate their share, with trainer.v1.trainer_mode=colocate_async"]


def asks_for_async(key: str) -> bool:
    """True for a key of ``ASYNC_SECTIONS`` (the top-level ``rollout``, not ``actor_rollout_ref.rollout``)."""
    return key.split(".", 1)[0] in ASYNC_SECTIONS


def versions_span_steps(cfg: DictConfig) -> bool:
    """The fully async trainer trains several local steps per parameter version (``trigger_parameter_sync_step`` >
    1): the weights the engine generated with are not the step's after a version's first step."""
    return cfg.trainer.async_mode == "fully_async" and cfg.async_training.trigger_parameter_sync_step > 1


def fill_fully_async_batch(cfg: DictConfig) -> None:
    """The fully async trainer's batch is ``required_samples = actor.ppo_mini_batch_size × require_batches`` prompts
    (verl's trainer reads no other; its scripts set ``data.train_batch_size=0``): a 0 there, or the schema's default
    (which verl's config leaves), becomes that number, so every check and plan of the train batch sees the batch the
    trainer takes. Another value is checked to be it (``async_problems``)."""
    from meshrl.config.schema import DataConfig

    if cfg.trainer.async_mode == "fully_async" and cfg.data.train_batch_size in (0, DataConfig.train_batch_size):
        cfg.data.train_batch_size = cfg.actor_rollout_ref.actor.ppo_mini_batch_size * cfg.async_training.require_batches


def section_read(cfg: DictConfig, key: str) -> bool:
    """True when ``cfg``'s trainer reads ``key`` (``key`` or ``key=value``) of ``ASYNC_SECTIONS``: ``async_training``
    the fully async trainer, the top-level ``rollout`` both asynchronous trainers."""
    section = key.partition("=")[0].split(".", 1)[0]
    mode = cfg.trainer.async_mode
    return mode == "fully_async" if section == "async_training" else mode in ASYNC_MODES


def async_problems(cfg: DictConfig) -> tuple[list[str], list[str], list[str]]:
    """(problems, notes, async_keys) of ``cfg``'s asynchronous-training keys: values out of range (each naming its
    key), the ``trainer_mode`` that asks for asynchronous training (``async_keys``, to be refused with
    ``V1_ASYNC``), and the note that ``trainer.v1`` is not read with ``use_v1=False``."""
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

    mode = trainer.async_mode
    check(mode is None or mode in ASYNC_MODES, "trainer.async_mode", f"null or one of {', '.join(ASYNC_MODES)}",
          f"'{mode}'")
    # verl's asynchronous trainers require a rollouter apart from the trainer (hybrid_engine=False); meshrl's
    # rollouter is the training ranks' engines either way (its start-up note says so), a synchronous run's too
    check(cfg.actor_rollout_ref.hybrid_engine or mode is not None, "actor_rollout_ref.hybrid_engine",
          "True outside the asynchronous trainers (a rollout engine apart from the trainer is not built: meshrl "
          "colocates it, verl's hybrid engine); the one-step-off and fully async trainers accept False, as verl's "
          "scripts set it, and run their rollouter on the training ranks' engines", False)
    gen_batch = cfg.data.gen_batch_size
    if mode == "fully_async":  # verl's rollouter generates prompt by prompt ("currently only support 1")
        check(gen_batch in (None, 1), "data.gen_batch_size", "1 (or null) with the fully async trainer, whose "
              "rollouter starts one prompt at a time", gen_batch)
        required = cfg.actor_rollout_ref.actor.ppo_mini_batch_size * at.require_batches
        check(cfg.data.train_batch_size == required, "data.train_batch_size",
              f"0 (as verl's fully async scripts set it) or the trainer's batch, actor.ppo_mini_batch_size x "
              f"async_training.require_batches = {required} prompts, with the fully async trainer",
              cfg.data.train_batch_size)
    else:
        check(gen_batch in (None, cfg.data.train_batch_size), "data.gen_batch_size",
              f"null or data.train_batch_size ({cfg.data.train_batch_size}): generating more prompts than a train "
              "batch is DAPO's dynamic sampling (algorithm.filter_groups), not built", gen_batch)
    if colocate_async(cfg):
        problems.extend(_colocate_async_problems(cfg))
    else:
        set_keys = [f"{key}={OmegaConf.select(cfg, key)}" for key, default in COLOCATE_ONLY.items()
                    if OmegaConf.select(cfg, key) != default]
        if set_keys:
            problems.append(f"{', '.join(set_keys)}: read by verl V1's colocate_async trainer only; set "
                            "trainer.v1.trainer_mode=colocate_async (with trainer.use_v1=True), or drop these settings")
    notes, async_keys = [], []
    if v1.trainer_mode in V1_TRAINER_MODES and v1.trainer_mode != "sync":
        if not trainer.use_v1:
            notes.append(f"trainer.v1.trainer_mode={v1.trainer_mode} has no effect with trainer.use_v1=False: verl's "
                         "V0 trainer is synchronous and reads nothing of trainer.v1 (nor does meshrl)")
        elif v1.trainer_mode == "separate_async":
            async_keys.append(f"trainer.v1.trainer_mode={v1.trainer_mode}")
    return problems, notes, async_keys


def _colocate_async_problems(cfg: DictConfig) -> list[str]:
    """What verl V1's colocate_async trainer cannot run with: its partial rollout drives one in-process vLLM engine
    per rank request by request (``meshrl.rollout.rollout_stream``), single-turn. (ReMax's greedy pass runs inside
    the step, between two of the stream's runs, when no request is in the engine.)"""
    rollout, problems = cfg.actor_rollout_ref.rollout, []
    mode = "trainer.v1.trainer_mode=colocate_async"
    if cfg.trainer.async_mode is not None:
        problems.append(f"trainer.async_mode={cfg.trainer.async_mode}: one asynchronous trainer at a time; {mode} "
                        "asks for verl V1's colocate_async: set trainer.async_mode=null or "
                        "trainer.v1.trainer_mode=sync")
    if rollout.name != "vllm":
        problems.append(f"actor_rollout_ref.rollout.name={rollout.name}: {mode} drives the vLLM engine request by "
                        "request (partial rollout); set rollout.name=vllm")
    if rollout.tensor_model_parallel_size != 1:
        problems.append(f"actor_rollout_ref.rollout.tensor_model_parallel_size={rollout.tensor_model_parallel_size}: "
                        f"{mode}'s partial rollout runs at inference TP 1 (the ranks of a TP replica would have to "
                        "abort at the same engine step); set it to 1")
    if rollout.multi_turn.enable:
        problems.append(f"actor_rollout_ref.rollout.multi_turn.enable=True: {mode}'s partial rollout is single-turn; "
                        "use the synchronous trainer (trainer.v1.trainer_mode=sync) for multi-turn rollouts")
    return problems


def with_async_keys(problems: list[str], keys: list[str]) -> list[str]:
    """``problems`` with ``keys`` added to the one ``V1_ASYNC`` problem (or that problem added): one message
    for every way a config asks for asynchronous training."""
    if not keys:
        return problems
    for i, line in enumerate(problems):
        if line.endswith(f": {V1_ASYNC}"):
            return [*problems[:i], f"{', '.join(keys)}, {line}", *problems[i + 1:]]
    return [*problems, f"{', '.join(keys)}: {V1_ASYNC}"]


# The older verl's fully async keys of the top-level rollout section (early-2026 verl-project/verl's fully async
# trainer reads trainer.test_freq and trainer.total_epochs instead): set away from their defaults, they are honoured.
def _older_key_set(cfg: DictConfig, name: str) -> bool:
    from meshrl.config.schema import StandaloneRolloutConfig

    return cfg.trainer.async_mode == "fully_async" and cfg.rollout[name] != getattr(StandaloneRolloutConfig, name)


def fully_async_test_freq(cfg: DictConfig) -> int:
    """The fully async trainer's validation frequency, in parameter versions (verl validates right after the sync
    whose version is a multiple of it): ``trainer.test_freq``, or the older verl's ``rollout.test_freq`` (its
    rollouter validated "every test_freq parameter updates") where that is set."""
    return cfg.rollout.test_freq if _older_key_set(cfg, "test_freq") else cfg.trainer.test_freq


def fully_async_epochs(cfg: DictConfig) -> int:
    """The fully async run's passes over the training set: ``trainer.total_epochs``, or with the older verl's
    ``rollout.total_epochs`` set, the fewer of the two (its rollouter counted its samples from ``trainer.total_epochs``
    and looped ``rollout.total_epochs`` epochs, stopping at whichever ended first)."""
    epochs = cfg.trainer.total_epochs
    return min(epochs, cfg.rollout.total_epochs) if _older_key_set(cfg, "total_epochs") else epochs


@refusal("config", "trainer.test_freq", "rollout.test_freq")
def one_validation_frequency(c: Checked) -> list[str]:
    """The older verl's ``rollout.test_freq`` and ``trainer.test_freq`` are one setting in meshrl's fully async
    trainer (``fully_async_test_freq``): both set, to different values, is refused."""
    from meshrl.config.schema import TrainerConfig

    cfg = c.cfg
    agreeing = (TrainerConfig.test_freq, cfg.rollout.test_freq)
    if not _older_key_set(cfg, "test_freq") or cfg.trainer.test_freq in agreeing:
        return []
    return [f"rollout.test_freq={cfg.rollout.test_freq}: the older verl's name of the fully async trainer's validation "
            f"frequency, which trainer.test_freq={cfg.trainer.test_freq} also sets; set one of them (or both to the "
            "same value)"]
