"""The worker groups' start (``meshrl.trainer.worker_start``): together, the policy's engines last, and a failed or
interrupted start leaves no group running. The groups here are stand-ins recording what happened; the real groups
start together in every end-to-end run (PPO with a reward model: ``tests/e2e/test_verl_scripts.py``'s rm_ppo)."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from meshrl.trainer import worker_start
from meshrl.trainer.startup import StartupClock


class Events:
    def __init__(self, parties: int) -> None:
        self.log: list[str] = []
        # every group's start waits here for the others: a sequential start would time out
        self.barrier = threading.Barrier(parties, timeout=10)


def fake_group(events: Events, name: str, fail: bool = False, seconds: float = 0.0):
    class Group:
        def __init__(self, cfg, plan, model_dir, start_engine: bool = True) -> None:
            assert start_engine is False or name != "actor_rollout_ref"
            events.log.append(f"{name} starting")
            events.barrier.wait()
            time.sleep(seconds)
            if fail:
                events.log.append(f"{name} failed")
                raise RuntimeError(f"{name} rank 0 failed in setup")
            self.startup = {"models": 0.01}
            self.kept = name == "critic"  # as if an earlier run's (meshrl.workers.pool)
            events.log.append(f"{name} up")

        def start_engine(self) -> None:
            events.log.append("engine")
            self.startup["engine"] = 0.02

        def shutdown(self) -> None:
            events.log.append(f"{name} shut down")

    return Group


@pytest.fixture
def plan():
    return SimpleNamespace(use_critic=True, use_reward_model=True)


@pytest.fixture
def cfg():
    return SimpleNamespace(critic=SimpleNamespace(model=SimpleNamespace(path=None)),
                           reward_model=SimpleNamespace(model=SimpleNamespace(path="/rm")))


def patch_groups(monkeypatch, events: Events, **kwargs) -> None:
    import meshrl.models.resolve
    import meshrl.workers.actor_rollout_ref
    import meshrl.workers.critic
    import meshrl.workers.reward_model

    for module, attr, name in ((meshrl.workers.actor_rollout_ref, "ActorRolloutRefGroup", "actor_rollout_ref"),
                               (meshrl.workers.critic, "CriticGroup", "critic"),
                               (meshrl.workers.reward_model, "RewardModelGroup", "reward_model")):
        monkeypatch.setattr(module, attr, fake_group(events, name, **kwargs.get(name, {})))
    monkeypatch.setattr(meshrl.models.resolve, "resolve_model_path", lambda path: path)


def test_the_groups_start_together_and_the_engines_after_every_model(monkeypatch, cfg, plan):
    events = Events(3)
    patch_groups(monkeypatch, events)
    clock = StartupClock()
    policy, critic, reward_model = worker_start.start_workers(cfg, plan, "/model", clock)
    assert events.log[-1] == "engine" and sorted(events.log[:3]) == sorted(f"{n} starting" for n in clock.groups)
    assert {"critic up", "reward_model up"} <= set(events.log[:-1])  # the engine waited for their models
    assert list(clock.groups) == ["actor_rollout_ref", "critic", "reward_model"] and "workers" in clock.phases
    assert clock.inside["actor_rollout_ref"]["engine"] == 0.02 and critic is not None and reward_model is not None
    assert "critic (kept workers) " in clock.line() and "reward_model (kept" not in clock.line()


def test_a_failed_group_fails_the_start_at_once_and_every_other_group_is_shut_down(monkeypatch, cfg, plan):
    events = Events(3)
    patch_groups(monkeypatch, events, critic={"fail": True}, reward_model={"seconds": 1.0})
    with pytest.raises(RuntimeError, match="critic rank 0 failed in setup"):
        worker_start.start_workers(cfg, plan, "/model", StartupClock())
    assert "reward_model up" not in events.log  # raised before the slowest group was up
    deadline = time.monotonic() + 10
    while "reward_model shut down" not in events.log and time.monotonic() < deadline:
        time.sleep(0.05)  # shut down as soon as it is up
    assert {"actor_rollout_ref shut down", "reward_model shut down"} <= set(events.log)
    assert "engine" not in events.log and "critic shut down" not in events.log


def test_a_failed_engine_start_shuts_every_group_down(monkeypatch, cfg, plan):
    events = Events(3)
    patch_groups(monkeypatch, events)
    import meshrl.workers.actor_rollout_ref as arr

    def broken_engine(self) -> None:
        raise RuntimeError("engine failed")

    monkeypatch.setattr(arr.ActorRolloutRefGroup, "start_engine", broken_engine)
    with pytest.raises(RuntimeError, match="engine failed"):
        worker_start.start_workers(cfg, plan, "/model", StartupClock())
    assert {f"{n} shut down" for n in ("actor_rollout_ref", "critic", "reward_model")} <= set(events.log)
