"""The sample queue between rollouter and trainer (``meshrl.trainer.sample_queue``): verl's admission bound at
several thresholds, staleness 0 never letting the producer ahead, the version gap bound over random interleavings
(partial rollouts resumed across syncs), the parameter-sync trigger, per-token versions, and verl's metrics on a
scripted interleaving with a scripted clock."""

import math
import random

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from meshrl.config.loader import default_config
from meshrl.trainer.sample_queue import (CLOSED, EXHAUSTED, QUEUE_FULL, STALENESS, SampleQueue, StalenessBudget,
                                         trajectory_span)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def budget(required=2, trigger=2, staleness=0.5, total=None) -> StalenessBudget:
    return StalenessBudget(required_samples=required, trigger_parameter_sync_step=trigger,
                           staleness_threshold=staleness, total_rollout_steps=total)


@pytest.mark.parametrize("required, trigger, staleness, max_required, gap", [
    (4, 4, 0.0, 16, 0),
    (4, 4, 0.1, 17, 1),  # verl's int() floors 17.6
    (4, 4, 0.5, 24, 1),
    (4, 4, 1.0, 32, 1),  # verl: staleness 1 is about one-step-off
    (2, 3, 2.0, 18, 2),
    (1, 2, 2.5, 7, 3),
])
def test_the_bound_is_verls_formula(required, trigger, staleness, max_required, gap):
    b = budget(required, trigger, staleness)
    assert b.max_required_samples == max_required == int(required * (staleness + 1) * trigger)
    assert b.max_queue_size == max_required
    assert b.samples_per_sync == required * trigger
    assert b.max_version_gap == gap <= math.ceil(staleness)


@pytest.mark.parametrize("staleness", [0.0, 0.1, 0.5, 1.0, 2.0])
def test_admission_stops_at_the_bound_and_resumes_by_what_the_sync_left_over(staleness):
    """A fast rollouter starts exactly max_required_samples, then (1 + s)·R·T − leftover after each sync."""
    b = budget(required=4, trigger=4, staleness=staleness)
    q = SampleQueue(b, clock=Clock())
    started = 0
    while q.try_admit():
        started += 1
    assert started == b.max_required_samples and q.pause_reason() == STALENESS
    for _ in range(started):
        q.put("s")
    assert q.pause_reason() == QUEUE_FULL and not q.try_admit()
    for step in range(4):  # the trainer's R·T samples of version 0
        q.take_batch()
        assert q.finish_train_step() is (step == 3)
    q.reset_staleness()
    leftover = b.max_required_samples - b.samples_per_sync
    assert q.staleness_samples == leftover == len(q)
    more = 0
    while q.try_admit():
        more += 1
    assert more == b.max_required_samples - leftover == b.samples_per_sync


def simulate(b: StalenessBudget, seed: int, ticks: int = 600):
    """Random interleavings of a rollouter (start, finish any sample in flight, with each token tagged by the
    version generating it: a partial rollout resumed across syncs) and a trainer (take, step, sync). Checks the
    invariants at every tick; returns the consumed trajectories' (trainer version - first, - last)."""
    rng = random.Random(seed)
    q = SampleQueue(b, clock=Clock())
    flying: list[int] = []  # the version each sample in flight started at
    consumed_at_sync, lags = 0, []
    for _ in range(ticks):
        q.clock.now += rng.random()
        roll = rng.random()
        if roll < 0.4:
            if q.try_admit():
                flying.append(q.rollout_version)
        elif roll < 0.75 and flying:
            start = flying.pop(rng.randrange(len(flying)))
            tokens = [[v] * rng.randint(1, 3) for v in range(start, q.rollout_version + 1)]
            q.put(None, versions=[sum(tokens, []), q.rollout_version])  # a resumed trajectory and a fresh one
        else:
            q.request_batch()
            if q.batch_ready():
                batch = q.take_batch()
                lags += [(batch.param_version - first, batch.param_version - last)
                         for sample in batch.samples for first, last in sample.versions]
                if q.finish_train_step():
                    consumed_at_sync = q.consumed
                    q.reset_staleness()
        assert len(q) <= b.max_queue_size
        assert q.in_flight + len(q) <= q.staleness_samples <= b.max_required_samples
        assert q.admitted - consumed_at_sync <= b.max_required_samples
        if b.staleness_threshold == 0:  # never a sample the current version's steps will not consume
            assert q.admitted <= (q.rollout_version + 1) * b.samples_per_sync
    assert q.consumed >= 10 * b.required_samples  # the run made progress
    return lags


@pytest.mark.parametrize("seed", range(6))
def test_staleness_zero_never_lets_the_producer_ahead(seed):
    lags = simulate(budget(required=2, trigger=3, staleness=0.0), seed)
    assert {lag for pair in lags for lag in pair} == {0}  # every token of every consumed sample is on-policy


@pytest.mark.parametrize("staleness", [0.25, 1.0, 1.5, 3.0])
@pytest.mark.parametrize("seed", range(3))
def test_the_version_gap_stays_within_the_bound(staleness, seed):
    b = budget(required=2, trigger=2, staleness=staleness)
    lags = simulate(b, seed)
    assert max(last for _, last in lags) <= b.max_version_gap


@pytest.mark.parametrize("staleness", [0.5, 1.0, 2.5])
def test_a_fast_rollouter_reaches_the_bound(staleness):
    """The bound is tight: a rollouter that always starts and finishes at once leaves samples that old."""
    b = budget(required=1, trigger=2, staleness=staleness)
    q, worst = SampleQueue(b, clock=Clock()), 0
    for _ in range(40):
        while q.try_admit():
            q.put(None)
        batch = q.take_batch()
        worst = max(worst, batch.metrics["training/off_policy/trajectory_staleness/max"])
        if q.finish_train_step():
            q.reset_staleness()
    assert worst == b.max_version_gap


def test_parameters_sync_every_trigger_parameter_sync_step_local_steps():
    q = SampleQueue(budget(required=1, trigger=3, staleness=0.0), clock=Clock())
    syncs = []
    with pytest.raises(RuntimeError, match="without a batch"):
        q.finish_train_step()
    with pytest.raises(RuntimeError, match="without a sync due"):
        q.reset_staleness()
    for step in range(1, 10):
        while q.try_admit():
            q.put(step)
        q.take_batch()
        with pytest.raises(RuntimeError, match="one batch per local step"):
            q.take_batch()
        if q.finish_train_step():
            syncs.append(step)
            assert q.sync_due and q.param_version == len(syncs) == q.rollout_version + 1
            with pytest.raises(RuntimeError, match="sync is due"):
                q.take_batch()
            q.reset_staleness()
        assert q.local_trigger_step == step % 3 + 1
    assert syncs == [3, 6, 9] and q.param_version == q.rollout_version == 3


@pytest.mark.parametrize("versions, span", [
    (3, (3, 3)),
    (np.int64(2), (2, 2)),
    ([1, 1, 2, 2, 3], (1, 3)),
    ((0, 2), (0, 2)),
    (np.array([2, 2, 3]), (2, 3)),
    (torch.tensor([0, 1, 1]), (0, 1)),
    (torch.tensor(4), (4, 4)),
    (torch.tensor([1, 1, 2, -1, -1]), (1, 2)),  # a padded row of the rollout_policy_version batch field
    ([-1, 3, 3, -1], (3, 3)),  # a multi-turn response's tool tokens carry none
])
def test_per_token_versions_give_each_trajectorys_first_and_last(versions, span):
    assert trajectory_span(versions) == span


def test_put_checks_its_versions_and_its_admission():
    q = SampleQueue(budget(), clock=Clock())
    with pytest.raises(RuntimeError, match="not admitted"):
        q.put("x")
    q.try_admit()
    for bad, match in (([[]], "without token versions"), ([torch.tensor([], dtype=torch.long)], "without"),
                       ([np.array([-1, -1])], "without"), ([1], "outside 0..0"), ([[0, 2]], "outside"),
                       ([], "at least one")):
        with pytest.raises(ValueError, match=match):
            q.put("x", versions=bad)
    with pytest.raises(TypeError, match="one entry per trajectory"):
        q.put("x", versions=0)
    assert q.in_flight == 1 and len(q) == 0  # a refused put changes nothing
    sample = q.put("x", n_trajectories=3)
    assert sample.versions == ((0, 0),) * 3


def test_an_abandoned_sample_frees_its_slot_and_close_ends_the_run():
    q = SampleQueue(budget(required=2, trigger=1, staleness=0.0, total=5), clock=Clock())
    assert q.budget.total_train_steps == 2
    assert [q.try_admit() for _ in range(3)] == [True, True, False]
    q.abandon()  # a failed generation: another prompt may take its place
    assert q.staleness_samples == 1 and q.try_admit()
    q.put("a"), q.put("b")
    assert q.statistics()["fully_async/count/abandoned_samples"] == 1
    q.take_batch(), q.finish_train_step(), q.reset_staleness()
    assert q.try_admit() and q.try_admit() and q.pause_reason() == EXHAUSTED  # 5 prompts started in all
    assert not q.finished
    q.put("c"), q.abandon()
    assert q.finished  # one sample queued, two required, nothing more to come
    q.close()
    assert q.pause_reason() == CLOSED


def test_versions_and_metrics_of_a_scripted_interleaving():
    """R=2, T=2, s=0.5: M=6. Samples of two trajectories; E finishes with version 0's weights after the trainer
    moved to version 1, F is a partial rollout resumed across that sync."""
    clock = Clock()
    q = SampleQueue(budget(required=2, trigger=2, staleness=0.5), clock=clock)
    assert [q.try_admit() for _ in range(7)] == [True] * 6 + [False]  # A..F
    clock.now = 1
    q.put("A", n_trajectories=2), q.put("B", n_trajectories=2)
    q.request_batch()
    first = q.take_batch()
    assert first.payloads == ["A", "B"] and first.metrics["fully_async/total_wait_time"] == 0
    assert not q.finish_train_step()
    q.request_batch()  # waits from t=1 ...
    clock.now = 3
    q.put("C", n_trajectories=2), q.put("D", n_trajectories=2)
    second = q.take_batch()  # ... to t=3
    assert second.metrics["fully_async/total_wait_time"] == 2
    assert q.finish_train_step() and q.param_version == 1 and q.rollout_version == 0
    clock.now = 4
    q.put("E", versions=[0, 0])  # generated before the weights arrive
    clock.now = 5
    ended = q.reset_staleness()
    assert ended == {"fully_async/rollouter/active_time": 5, "fully_async/rollouter/version_time": 5,
                     "fully_async/rollouter/idle_ratio": 0, "fully_async/rollouter/step_generated_samples": 5,
                     "fully_async/trainer/idle_ratio": 2 / 5}
    assert q.staleness_samples == 2  # F in flight, E queued
    assert [q.try_admit() for _ in range(5)] == [True] * 4 + [False]  # G..J: 6 − 2
    clock.now = 6
    q.put("F", versions=[[0, 0, 1, 1], np.array([0, 1])])
    q.put("G", n_trajectories=2), q.put("H", n_trajectories=2)
    q.request_batch()
    third = q.take_batch()
    assert third.payloads == ["E", "F"] and third.param_version == 1
    m = third.metrics
    assert m["fully_async/count/current_param_version"] == 1
    assert m["fully_async/count/stale_samples_processed"] == 1  # E
    assert m["fully_async/count/stale_trajectory_processed"] == 2  # E's two
    assert (m["fully_async/partial/total_partial_num"], m["fully_async/partial/partial_ratio"],
            m["fully_async/partial/max_partial_span"]) == (2, 0.5, 1)  # F's two
    for name, (mean, high, low) in {"trajectory_spans": (1.5, 2, 1), "trajectory_staleness": (0.5, 1, 0),
                                    "trajectory_staleness_worst": (1, 1, 1)}.items():
        assert [m[f"training/off_policy/{name}/{s}"] for s in ("mean", "max", "min")] == [mean, high, low]
    assert m["fully_async/monitor/queue/mq_queue_size"] == 2 and m["fully_async/monitor/active_tasks_size"] == 2
    assert not q.finish_train_step()
    clock.now = 7
    q.put("I", n_trajectories=2), q.put("J", n_trajectories=2)  # nothing in flight, the bound reached: idle
    clock.now = 8
    fourth = q.take_batch()
    assert fourth.metrics["fully_async/count/stale_samples_processed"] == 1  # G, H are version 1's
    assert q.finish_train_step()
    clock.now = 9
    ended = q.reset_staleness()
    assert ended == {"fully_async/rollouter/active_time": 2, "fully_async/rollouter/version_time": 4,
                     "fully_async/rollouter/idle_ratio": 0.5, "fully_async/rollouter/step_generated_samples": 5,
                     "fully_async/trainer/idle_ratio": 0}
    stats = q.statistics()
    assert stats["fully_async/count/total_generated_samples"] == 10
    assert stats["fully_async/count/staleness_samples"] == 2  # I, J
    assert [stats[f"fully_async/static/{name}"] for name in
            ("max_required_samples", "required_samples", "max_queue_size", "staleness_threshold")] == [6, 2, 6, 0.5]


def test_the_budget_from_verls_keys_and_its_range_checks():
    cfg = default_config()
    for key, value in (("actor_rollout_ref.actor.ppo_mini_batch_size", 8), ("async_training.require_batches", 2),
                       ("async_training.trigger_parameter_sync_step", 3), ("async_training.staleness_threshold", 0.5),
                       ("trainer.total_epochs", 2)):
        OmegaConf.update(cfg, key, value)
    b = StalenessBudget.from_config(cfg, num_prompts=40)  # min(40 prompts × 2 epochs, total_rollout_steps=100)
    assert (b.required_samples, b.trigger_parameter_sync_step, b.staleness_threshold, b.total_rollout_steps) == \
        (16, 3, 0.5, 80)
    assert b.max_required_samples == 72 and b.total_train_steps == 1
    assert StalenessBudget.from_config(cfg).total_rollout_steps == 100
    with pytest.raises(ValueError) as info:
        StalenessBudget(0, 0, -0.1, 0)
    for key in ("require_batches", "async_training.trigger_parameter_sync_step", "async_training.staleness_threshold",
                "rollout.total_rollout_steps"):
        assert key in str(info.value)
