"""Entry point: ``python -m meshrl.trainer.main [--config-name RECIPE] key=value ...`` (verl's syntax).

``meshrl train RECIPE.yaml key=value ...`` (``meshrl.cli``) lands in ``run`` too. ``run`` builds every
part from the config — model, data, reward, Ray worker groups, tracker, checkpoints — hands them to
``RLTrainer.fit`` and shuts the workers down whatever happens (and Ray, unless the caller had started it).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence

from meshrl.runtime import configure_environment


def parse_args(argv: Sequence[str]) -> tuple[str | None, list[str]]:
    """``[--config-name NAME] [--config-path DIR] key=value ...`` → (recipe, overrides).

    Hydra's forms as verl's scripts write them: ``--config-name=NAME`` or ``--config-name NAME`` (also
    ``-cn``; ``--config-path`` / ``-cp`` likewise), anywhere among the overrides. verl's own configs
    (``--config-path=config --config-name=ppo_megatron_trainer``) name the schema defaults
    (``meshrl.config.loader.VERL_BASE_CONFIGS``).
    """
    parser = argparse.ArgumentParser(prog="python -m meshrl.trainer.main",
                                     description="Train a policy with RL; every verl key=value override works.")
    parser.add_argument("--config-name", "--config", "-cn", dest="config_name", default=None,
                        help="recipe name in recipes/ or a YAML path (verl's ppo_trainer / ppo_megatron_trainer: "
                             "the defaults)")
    parser.add_argument("--config-path", "-cp", dest="config_path", default=None,
                        help="folder to find --config-name in")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. algorithm.adv_estimator=grpo")
    args = parser.parse_intermixed_args(list(argv))
    recipe = args.config_name
    if recipe is not None and args.config_path is not None:
        recipe = str(Path(args.config_path) / recipe)
    return recipe, args.overrides


def run(cfg, plan) -> dict[str, float]:
    """Train with a loaded config and its run plan (``validate_config(cfg)``); returns the final step's metrics."""
    import ray
    from transformers import AutoConfig, AutoTokenizer

    from meshrl.config.validate import validate_against_model
    from meshrl.data.dataset import load_datasets
    from meshrl.models.resolve import resolve_model_path
    from meshrl.rewards.dispatch import RewardSpec
    from meshrl.rewards.pool import RewardPool
    from meshrl.trainer.checkpoint import CheckpointManager, parts_to_keep
    from meshrl.trainer.plot import plot_finished_run
    from meshrl.trainer.rl_trainer import RLTrainer, total_training_steps
    from meshrl.trainer.tracking import Tracker
    from meshrl.workers.actor_rollout_ref import ActorRolloutRefGroup
    from meshrl.workers.cluster import start_ray
    from meshrl.workers.critic import CriticGroup
    from omegaconf import OmegaConf

    for warning in plan.warnings:
        print(f"meshrl: note: {warning}", file=sys.stderr)
    model_dir = resolve_model_path(cfg.actor_rollout_ref.model.path)
    validate_against_model(cfg, AutoConfig.from_pretrained(
        model_dir, trust_remote_code=cfg.actor_rollout_ref.model.trust_remote_code))
    # The driver's tokenizer builds the prompts: verl trusts its remote code by data.trust_remote_code.
    tokenizer = AutoTokenizer.from_pretrained(cfg.actor_rollout_ref.model.tokenizer_path or model_dir,
                                              trust_remote_code=cfg.data.trust_remote_code)
    train_data, val_data = load_datasets(cfg.data, tokenizer)
    total_steps = total_training_steps(cfg, len(train_data))
    OmegaConf.update(cfg, "actor_rollout_ref.actor.optim.total_training_steps", total_steps)
    OmegaConf.update(cfg, "critic.optim.total_training_steps", total_steps)

    run_dir = Path(cfg.trainer.default_local_dir)
    # A caller that already runs Ray (a notebook, a test running several trainings) keeps its session:
    # only a session this call started is shut down at the end.
    owns_ray = not ray.is_initialized()
    start_ray(cfg)
    policy = critic = None
    reward = RewardPool(RewardSpec(cfg.custom_reward_function.path, cfg.custom_reward_function.name,
                                   dict(cfg.custom_reward_function.reward_kwargs)),
                        num_workers=cfg.reward_model.num_workers, timeout_s=cfg.reward_model.timeout_s)
    try:
        policy = ActorRolloutRefGroup(cfg, plan, model_dir)
        if plan.use_critic:
            critic = CriticGroup(cfg, plan,
                                 resolve_model_path(cfg.critic.model.path) if cfg.critic.model.path else model_dir)
        with Tracker(list(cfg.trainer.logger), run_dir, cfg.trainer.project_name, cfg.trainer.experiment_name,
                     OmegaConf.to_container(cfg), total_steps) as tracker:
            trainer = RLTrainer(cfg, plan, policy=policy, critic=critic, tokenizer=tokenizer, train_data=train_data,
                                val_data=val_data, reward=reward, tracker=tracker,
                                checkpoints=CheckpointManager(run_dir, parts_to_keep(cfg.trainer)))
            final = trainer.fit()
        if cfg.ray_kwargs.timeline_json_file:
            ray.timeline(filename=cfg.ray_kwargs.timeline_json_file)
        print(plot_finished_run(run_dir))
        return final
    finally:
        reward.close()
        for group in (policy, critic):
            if group is not None:
                group.shutdown()
        if owns_ray:
            ray.shutdown()


def preflight(cfg):
    """Every check that needs no model or worker, in one pass: the config (``validate_config``: its run plan),
    the rollout engine's settings and the Ray start; raises ``ConfigError`` listing the problems."""
    from meshrl.config import ConfigError
    from meshrl.config.validate import validate_config
    from meshrl.rollout.engines import unsupported_rollout_features
    from meshrl.trainer.checkpoint import hf_export_roles
    from meshrl.workers.cluster import ray_init_kwargs

    plan = validate_config(cfg)
    hf_export_roles(cfg, with_critic=plan.use_critic)  # checkpoint contents meshrl cannot save or resume
    problems = unsupported_rollout_features(cfg.actor_rollout_ref.rollout)
    if problems:
        raise ConfigError("invalid rollout configuration ({} problem(s)):\n  - {}".format(
            len(problems), "\n  - ".join(problems)), [line.split(":")[0] for line in problems])
    ray_init_kwargs(cfg)  # ray_kwargs that cannot map are refused before any model loads
    return plan


def main(argv: Sequence[str] | None = None) -> int:
    configure_environment()
    from meshrl.config import ConfigError, load_config

    recipe, overrides = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        cfg = load_config(overrides, recipe=recipe)
        plan = preflight(cfg)
    except ConfigError as exc:
        print(f"meshrl: {exc}", file=sys.stderr)
        return 2
    run(cfg, plan)
    return 0


if __name__ == "__main__":
    sys.exit(main())
