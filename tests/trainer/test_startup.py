"""The start-up clock (``meshrl.trainer.startup``): phases, a group's inner phases, what a run logs and prints."""

import time

from meshrl.trainer.plot import collect_series
from meshrl.trainer.startup import StartupClock


def test_phases_add_up_to_the_elapsed_time_and_the_groups_split_the_workers_phase():
    clock = StartupClock(origin_age_s=1.5)  # the process started 1.5 s before the clock
    with clock.phase("checks"):
        time.sleep(0.05)
    time.sleep(0.05)  # between phases: counted in the total, not in a phase
    with clock.phase("workers"):  # the groups start together (meshrl.trainer.worker_start)
        time.sleep(0.1)
    clock.group_started("actor_rollout_ref", 0.1, {"imports": 0.03, "engine": 0.02})
    clock.group_started("critic", 0.06, {})  # a group that reports nothing has no inner phases
    phases, inner = clock.phases, clock.inside["actor_rollout_ref"]
    # lower bounds only: a loaded machine oversleeps
    assert phases["python"] == 1.5 and phases["checks"] >= 0.05 and phases["workers"] >= 0.1
    assert (inner["start"] == 0.1 - 0.05 and list(inner) == ["start", "imports", "engine"]
            and "critic" not in clock.inside)
    assert clock.elapsed_s() >= 1.5 + phases["checks"] + 0.05 + phases["workers"]
    metrics = clock.metrics()
    assert metrics["startup/checks_s"] == phases["checks"] and metrics["startup/actor_rollout_ref/engine_s"] == 0.02
    assert metrics["startup/workers_s"] == phases["workers"] and metrics["startup/critic_s"] == 0.06
    line = clock.line()
    assert line.startswith(f"ready in {clock.elapsed_s():.1f}"[:-1])  # the total, then each phase in order
    assert line.endswith(f"(python 1.5; checks {phases['checks']:.1f}; workers {phases['workers']:.1f} "
                         f"[actor_rollout_ref 0.1: start {inner['start']:.1f}, imports 0.0, engine 0.0; critic 0.1])")


def test_the_plot_leaves_the_startup_numbers_out():
    series = collect_series([{"step": 1, "timing/step_s": 2.0, "startup/first_step_s": 30.0,
                              "startup/actor_rollout_ref/imports_s": 7.0}])
    assert list(series) == ["timing/step_s"]
