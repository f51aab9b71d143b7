"""The start-up clock (``meshrl.trainer.startup``): phases, a group's inner phases, what a run logs and prints."""

import time

from meshrl.trainer.plot import collect_series
from meshrl.trainer.startup import StartupClock


def test_phases_add_up_to_the_elapsed_time_and_a_group_splits_its_own():
    clock = StartupClock(origin_age_s=1.5)  # the process started 1.5 s before the clock
    with clock.phase("checks"):
        time.sleep(0.05)
    time.sleep(0.05)  # between phases: counted in the total, not in a phase
    with clock.phase("actor_rollout_ref"):
        time.sleep(0.1)
    clock.group_started("actor_rollout_ref", {"imports": 0.03, "engine": 0.02})
    phases, inner = clock.phases, clock.inside["actor_rollout_ref"]
    # lower bounds only: a loaded machine oversleeps
    assert phases["python"] == 1.5 and phases["checks"] >= 0.05 and phases["actor_rollout_ref"] >= 0.1
    assert inner["start"] == phases["actor_rollout_ref"] - 0.05 and list(inner) == ["start", "imports", "engine"]
    assert clock.elapsed_s() >= 1.5 + phases["checks"] + 0.05 + phases["actor_rollout_ref"]
    metrics = clock.metrics()
    assert metrics["startup/checks_s"] == phases["checks"] and metrics["startup/actor_rollout_ref/engine_s"] == 0.02
    line = clock.line()
    assert line.startswith(f"ready in {clock.elapsed_s():.1f}"[:-1])  # the total, then each phase in order
    assert f"(python 1.5; checks {phases['checks']:.1f}; actor_rollout_ref {phases['actor_rollout_ref']:.1f}: " \
           f"start {inner['start']:.1f}, imports 0.0, engine 0.0)" in line


def test_a_group_that_reports_nothing_has_no_inner_phases():
    clock = StartupClock()
    with clock.phase("critic"):
        pass
    clock.group_started("critic", {})
    assert clock.inside == {} and "python" not in clock.phases


def test_the_plot_leaves_the_startup_numbers_out():
    series = collect_series([{"step": 1, "timing/step_s": 2.0, "startup/first_step_s": 30.0,
                              "startup/actor_rollout_ref/imports_s": 7.0}])
    assert list(series) == ["timing/step_s"]
