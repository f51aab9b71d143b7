"""RewardPool: inline and worker-process scoring agree; errors, crashes and hangs score 0 and are counted, in
batches of every size; non-finite scores follow reward_model.on_nonfinite_score; a reward that always fails stops."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from meshrl.data.preprocess import build_rows
from meshrl.rewards.dispatch import RewardSpec
from meshrl.rewards.pool import NonFiniteScore, RewardError, RewardPool, normalize_reward_output

# "SPIN" hangs inside the C regex engine (catastrophic backtracking): no Python signal handler can
# interrupt it, only killing the process can.
FAULTY_REWARD = """
import os, re, time
from meshrl.rewards.dispatch import default_compute_score

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str == "HANG":
        time.sleep(600)
    if solution_str == "SPIN":
        re.match(r"(a+)+$", "a" * 64 + "b")
    if solution_str == "CRASH":
        os._exit(3)
    if solution_str == "RAISE":
        raise RuntimeError("boom")
    if solution_str == "NAN":
        return float("nan")
    if solution_str == "HUGE":
        return 1e39  # finite in float64, inf in float32
    if solution_str == "TEXT":
        return "a string"
    return default_compute_score(data_source, solution_str, ground_truth, extra_info)
"""


@pytest.fixture(scope="module")
def faulty_spec(tmp_path_factory: pytest.TempPathFactory) -> RewardSpec:
    path = tmp_path_factory.mktemp("reward") / "faulty.py"
    path.write_text(FAULTY_REWARD)
    return RewardSpec(custom_path=str(path))


def _real_batch(n_gsm8k: int, n_math: int) -> tuple[list[str], list[str], list[str]]:
    gsm = build_rows("gsm8k", "test")[:n_gsm8k]
    math = build_rows("math500", "test")[:n_math]
    rows = gsm + math
    return (
        [r["data_source"] for r in rows],
        [r["extra_info"]["answer"] for r in rows],
        [r["reward_model"]["ground_truth"] for r in rows],
    )


def test_normalize_reward_output() -> None:
    assert normalize_reward_output(1) == (1.0, {})
    assert normalize_reward_output({"score": 0.5, "acc": True}) == (0.5, {"acc": True})
    with pytest.raises(TypeError, match="without a 'score'"):
        normalize_reward_output({"acc": 1})
    with pytest.raises(TypeError, match="returned str"):
        normalize_reward_output("1")
    with pytest.raises(NonFiniteScore, match="non-finite"):
        normalize_reward_output(float("inf"))
    with pytest.raises(NonFiniteScore, match="beyond float32"):
        normalize_reward_output({"score": -1e39})
    assert normalize_reward_output(3e38) == (3e38, {})


def test_inline_scores_and_counts_failures(faulty_spec: RewardSpec) -> None:
    sources, solutions, truths = _real_batch(3, 3)
    sources += ["gsm8k"] * 3
    solutions += ["RAISE", "NAN", "TEXT"]
    truths += ["1"] * 3
    with RewardPool(faulty_spec, num_workers=0) as pool:
        batch = pool.score(sources, solutions, truths)
    assert batch.scores == [1.0] * 6 + [0.0] * 3
    assert batch.metrics["reward/num_errors"] == 2 and batch.metrics["reward/num_nonfinite"] == 1
    assert batch.metrics["reward/pooled"] == 0.0
    assert batch.metrics["reward/num_math_verify_fallback"] == 0
    assert batch.extras["math_verify_fallback"] == [None] * 3 + [False] * 3 + [None] * 3


def test_inline_late_call_counts_as_timeout(tmp_path: Path) -> None:
    path = tmp_path / "slow.py"
    path.write_text("import time\ndef compute_score(d, s, g, e=None):\n    time.sleep(0.3)\n    return 1.0\n")
    with RewardPool(RewardSpec(custom_path=str(path)), num_workers=0, timeout_s=0.1) as pool:
        batch = pool.score(["x"], ["y"], ["z"])
    assert batch.scores == [0.0] and batch.metrics["reward/num_timeouts"] == 1


def test_length_mismatch_and_bad_settings(faulty_spec: RewardSpec) -> None:
    with pytest.raises(ValueError, match="differ in length"):
        RewardPool(faulty_spec, num_workers=0).score(["a"], ["b", "c"], ["d"])
    with pytest.raises(ValueError, match="timeout_s"):
        RewardPool(faulty_spec, num_workers=0, timeout_s=0)
    with pytest.raises(FileNotFoundError):
        RewardPool(RewardSpec(custom_path="missing.py"), num_workers=0)


@pytest.mark.slow
def test_pool_matches_inline_and_survives_hangs_and_crashes(faulty_spec: RewardSpec) -> None:
    sources, solutions, truths = _real_batch(40, 24)
    faults = {5: "HANG", 17: "SPIN", 30: "CRASH", 45: "RAISE"}
    for i, marker in faults.items():
        solutions[i] = marker
    expected = [0.0 if i in faults else 1.0 for i in range(len(solutions))]
    with RewardPool(faulty_spec, num_workers=2, timeout_s=3.0, chunk_size=8) as pool:
        start = time.perf_counter()
        batch = pool.score(sources, solutions, truths)
        elapsed = time.perf_counter() - start
        assert batch.scores == expected
        assert batch.metrics["reward/pooled"] == 1.0
        assert batch.metrics["reward/num_timeouts"] == 2 and batch.metrics["reward/num_errors"] == 2
        assert batch.metrics["reward/num_math_verify_fallback"] == 0  # math-verify's own timers work in workers
        assert pool.totals["num_worker_restarts"] == 3
        assert elapsed < 60
        # The replacement workers serve the next batch normally.
        again = pool.score(sources[:8], [s if s not in faults.values() else "x" for s in solutions[:8]], truths[:8])
        assert again.scores == [1.0] * 5 + [0.0] + [1.0] * 2
        inline = RewardPool(faulty_spec, num_workers=0).score(sources[40:], solutions[40:], truths[40:])
        assert inline.scores == batch.scores[40:]
        processes = [w.process for w in pool._workers]
    assert not any(p.is_alive() for p in processes)


def test_pool_scores_in_a_worker_process() -> None:
    sources, solutions, truths = _real_batch(6, 2)
    solutions[0] = "#### 0"
    with RewardPool(num_workers=1) as pool:
        batch = pool.score(sources, solutions, truths)
        assert pool._workers[0].process.is_alive()
    assert batch.scores == [0.0] + [1.0] * 7
    assert batch.metrics["reward/pooled"] == 1.0 and batch.metrics["reward/num_errors"] == 0
    assert batch.extras["math_verify_fallback"] == [None] * 6 + [False] * 2


@pytest.mark.timeout(60)
def test_the_timeout_holds_for_a_small_batch(faulty_spec: RewardSpec) -> None:
    """Two responses, one hanging: the worker is killed at the deadline (small batches used to run in the
    trainer process, where the hang stalled the run for good)."""
    with RewardPool(faulty_spec, num_workers=1, timeout_s=1.0) as pool:
        pool.score(["gsm8k"], ["#### 1"], ["1"])  # the worker is up: the timing below is the timeout's
        start = time.perf_counter()
        batch = pool.score(["gsm8k", "gsm8k"], ["HANG", "#### 1"], ["1", "1"])
        elapsed = time.perf_counter() - start
    assert batch.scores == [0.0, 1.0] and batch.metrics["reward/num_timeouts"] == 1
    assert batch.metrics["reward/pooled"] == 1.0 and elapsed < 10


def test_nonfinite_scores_are_skipped_and_named(faulty_spec: RewardSpec, caplog: pytest.LogCaptureFixture) -> None:
    with RewardPool(faulty_spec, num_workers=0) as pool:
        batch = pool.score(["gsm8k"] * 3, ["HUGE", "#### 1", "NAN"], ["1"] * 3)
    assert batch.scores == [0.0, 1.0, 0.0] and batch.metrics["reward/num_nonfinite"] == 2
    assert batch.metrics["reward/num_errors"] == 0
    warning = next(r.getMessage() for r in caplog.records if "non-finite" in r.getMessage() or "NaN" in r.getMessage())
    assert "compute_score" in warning and faulty_spec.custom_path in warning and "1e+39" in warning
    assert "on_nonfinite_score=skip" in warning


def test_a_nonfinite_score_stops_when_asked(faulty_spec: RewardSpec) -> None:
    with RewardPool(faulty_spec, num_workers=0, on_nonfinite_score="stop") as pool:
        with pytest.raises(RewardError) as info:
            pool.score(["gsm8k", "gsm8k"], ["#### 1", "HUGE"], ["1", "1"])
    message = str(info.value)
    assert "compute_score" in message and faulty_spec.custom_path in message
    assert "1e+39" in message and "response 1" in message and "on_nonfinite_score=stop" in message
    with pytest.raises(ValueError, match="on_nonfinite_score"):
        RewardPool(faulty_spec, num_workers=0, on_nonfinite_score="ignore")


def test_a_reward_that_always_fails_stops_the_run(faulty_spec: RewardSpec) -> None:
    """Three batches in a row with no successful call stop; one success resets the count."""
    failing = (["gsm8k"] * 2, ["RAISE", "NAN"], ["1"] * 2)
    with RewardPool(faulty_spec, num_workers=0, max_failed_batches=3) as pool:
        pool.score(*failing)
        pool.score(*failing)
        assert pool.score(["gsm8k"] * 2, ["RAISE", "#### 1"], ["1"] * 2).scores == [0.0, 1.0]
        pool.score(*failing)
        pool.score(*failing)
        with pytest.raises(RewardError) as info:
            pool.score(*failing)
    message = str(info.value)
    assert "compute_score" in message and "3 batches in a row" in message and "RuntimeError: boom" in message
    assert "max_failed_batches=3" in message
    with RewardPool(faulty_spec, num_workers=0, max_failed_batches=0) as pool:
        for _ in range(5):
            assert pool.score(*failing).scores == [0.0, 0.0]
