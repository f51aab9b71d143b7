"""The run's worker groups, started together.

Order: every group's processes and models at once, each group on a thread of the driver (the policy with its
reference, the critic, the reward model: their Ray actors import, join their process groups and load their weights
in parallel), then the policy's rollout engines. The engines come last as verl starts its rollout last: on a GPU,
vLLM's ``gpu_memory_utilization`` is a share of the whole device, checked against the memory free when the engine
starts, and the colocated models are then already loaded.

A group that fails to start fails the run at once with its own error (``WorkerError`` naming the group and rank);
the groups still starting are shut down as soon as they are up, so that a failed start leaves no worker behind, as
does Ctrl-C during the start.
"""

from __future__ import annotations

import time
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from typing import Any, Callable

from meshrl.trainer.startup import StartupClock


def start_workers(cfg, plan, model_dir, clock: StartupClock) -> tuple[Any, Any, Any]:
    """The policy, critic and reward-model groups (``None`` for a role the run has not), started together under
    ``clock``'s ``workers`` phase, each group's own seconds reported to ``clock.group_started``."""
    from meshrl.models.resolve import resolve_model_path
    from meshrl.workers.actor_rollout_ref import ActorRolloutRefGroup
    from meshrl.workers.critic import CriticGroup
    from meshrl.workers.reward_model import RewardModelGroup

    starts: dict[str, Callable[[], Any]] = {
        "actor_rollout_ref": lambda: ActorRolloutRefGroup(cfg, plan, model_dir, start_engine=False)}
    if plan.use_critic:
        critic_dir = resolve_model_path(cfg.critic.model.path) if cfg.critic.model.path else model_dir
        starts["critic"] = lambda: CriticGroup(cfg, plan, critic_dir)
    if plan.use_reward_model:
        starts["reward_model"] = lambda: RewardModelGroup(cfg, plan, resolve_model_path(cfg.reward_model.model.path))
    with clock.phase("workers"):
        groups, seconds = _together(starts)
        policy = groups["actor_rollout_ref"]
        try:
            started = time.monotonic()
            policy.start_engine()
            seconds["actor_rollout_ref"] += time.monotonic() - started
        except BaseException:
            for group in groups.values():
                group.shutdown()
            raise
    for name, group in groups.items():
        clock.group_started(name, seconds[name], group.startup, kept=group.kept)
    return policy, groups.get("critic"), groups.get("reward_model")


def _together(starts: dict[str, Callable[[], Any]]) -> tuple[dict[str, Any], dict[str, float]]:
    """Each of ``starts`` called on a thread of its own; their results and seconds by name. The first to raise is
    raised as soon as it does (and a ``KeyboardInterrupt`` while waiting): every group that started, or starts
    afterwards, is then shut down."""
    pool = ThreadPoolExecutor(len(starts), thread_name_prefix="meshrl-start")
    futures = {name: pool.submit(_timed, start) for name, start in starts.items()}
    pool.shutdown(wait=False)
    try:
        done, _ = wait(futures.values(), return_when=FIRST_EXCEPTION)
        failed = next((f for f in done if f.exception() is not None), None)
        if failed is not None:
            raise failed.exception()
    except BaseException:
        for future in futures.values():
            future.add_done_callback(_shut_down)
        raise
    results = {name: future.result() for name, future in futures.items()}
    return {name: group for name, (group, _) in results.items()}, {name: s for name, (_, s) in results.items()}


def _timed(start: Callable[[], Any]) -> tuple[Any, float]:
    started = time.monotonic()
    return start(), time.monotonic() - started


def _shut_down(future: Future) -> None:
    if not future.cancelled() and future.exception() is None:
        future.result()[0].shutdown()
