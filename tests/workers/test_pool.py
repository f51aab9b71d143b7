"""``meshrl.workers.pool``: which kept group serves which run, and which are killed (stand-in groups, no Ray; the
real workers' release and reuse: tests/e2e/test_algorithms_e2e.py::test_a_kept_worker_trains_as_a_fresh_one...)."""

from __future__ import annotations

import pytest

from meshrl.workers.pool import PoolKey, WorkerPool, active_pool, keep_workers


class Group:
    def __init__(self, name: str) -> None:
        self.name = name
        self.killed = False

    def shutdown(self) -> None:
        self.killed = True


def key(cls: str = "Policy", world: int = 1, env: str = "1") -> PoolKey:
    return PoolKey(cls, world, 1, 0, (("OMP_NUM_THREADS", env),), None, True)


def test_a_group_serves_a_run_of_its_shape_only_and_other_shapes_of_its_class_go():
    pool = WorkerPool(max_idle=4)
    policy, critic, policy_wide = Group("policy"), Group("critic"), Group("policy tp2")
    pool.give(key(), policy)
    pool.give(key("Critic"), critic)
    assert pool.take(key(env="2")) is None  # another environment: no match, and the policy of that class goes
    assert policy.killed and not critic.killed
    pool.give(key(world=2), policy_wide)
    assert pool.take(key("Critic", world=2)) is None and critic.killed  # the critic's other shape
    assert pool.take(key(world=2)) is policy_wide and not policy_wide.killed
    assert pool.taken == 1 and pool.idle_processes() == 0


def test_the_oldest_groups_go_beyond_max_idle_processes_and_close_kills_the_rest():
    pool = WorkerPool(max_idle=3)
    first, second, third = Group("a"), Group("b"), Group("c")
    pool.give(key("A", world=2), first)
    pool.give(key("B", world=1), second)
    assert pool.idle_processes() == 3 and not first.killed
    pool.give(key("C", world=2), third)  # 5 processes: the oldest go until 3 or fewer wait
    assert first.killed and not second.killed and pool.idle_processes() == 3
    too_wide = Group("d")
    pool.give(key("D", world=4), too_wide)  # wider than the pool on its own: every group goes, itself too
    assert too_wide.killed and second.killed and third.killed and pool.idle_processes() == 0
    kept = Group("e")
    pool.give(key("E"), kept)
    pool.close()
    assert kept.killed and pool.idle_processes() == 0


def test_keep_workers_nests_and_kills_its_idle_groups_on_leaving():
    assert active_pool() is None
    with keep_workers(max_idle=2) as outer:
        outer_group = Group("outer")
        outer.give(key(), outer_group)
        with keep_workers(max_idle=1) as inner:
            assert active_pool() is inner
            inner_group = Group("inner")
            inner.give(key(), inner_group)
        assert inner_group.killed and not outer_group.killed and active_pool() is outer
    assert outer_group.killed and active_pool() is None
    with pytest.raises(ValueError, match="at least one"):
        with keep_workers(max_idle=0):
            pass
