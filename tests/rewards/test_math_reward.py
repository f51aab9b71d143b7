r"""MATH reward: \boxed{} extraction, math-verify equivalence on real solutions, the counted fallback."""

from __future__ import annotations

import random
import re
import threading

import pytest

from meshrl.data.sources import read_raw_split
from meshrl.rewards import math as math_reward
from meshrl.rewards.math import compute_score, judge, last_boxed_content, normalize_answer


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (r"so $\boxed{5}$.", "5"),
        (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),
        (r"\boxed{1} then \boxed{\{1, 2\}}", r"\{1, 2\}"),
        (r"\boxed{a^{2}+{b}}", "a^{2}+{b}"),
        (r"answer \fbox{7}", "7"),
        (r"\boxed{1} and later \fbox{8}", "8"),
        (r"$\boxed 5$", "5"),
        (r"\boxed 12.", "12."),
        (r"\boxed{1} then \boxed{unterminated", None),
        ("no box here", None),
        (r"\boxed", None),
        (r"\boxed{}", ""),
    ],
)
def test_last_boxed_content(text: str, expected: str | None) -> None:
    assert last_boxed_content(text) == expected


def test_sample_of_real_solutions_scores_one_against_own_answer() -> None:
    rows = read_raw_split("math", "test")
    sample = random.Random(0).sample(rows, 120)
    for row in sample:
        truth = last_boxed_content(row["solution"])
        verdict = judge(row["solution"], truth)
        assert verdict.score == 1.0 and not verdict.math_verify_fallback, (truth, row["solution"][-80:])


def test_math500_solutions_score_one_against_answer_column() -> None:
    for row in read_raw_split("math500", "test")[:100]:
        assert compute_score(row["solution"], row["answer"]) == 1.0, row["answer"]


def test_known_wrong_answers_score_zero() -> None:
    integer = re.compile(r"-?\d+")
    rows = [r for r in read_raw_split("math", "test") if integer.fullmatch(last_boxed_content(r["solution"]) or "")]
    for row in random.Random(1).sample(rows, 60):
        truth = last_boxed_content(row["solution"])
        wrong = row["solution"][: row["solution"].rfind("\\boxed")] + f"\\boxed{{{int(truth) + 1}}}"
        assert compute_score(wrong, truth) == 0.0, truth
    assert compute_score("I am not sure.", "3") == 0.0  # no boxed answer


@pytest.mark.parametrize(
    ("prediction", "truth", "score"),
    [
        (r"\frac{1}{2}", "0.5", 1.0),
        (r"\dfrac12", r"\frac{1}{2}", 1.0),
        (r"(3, \pi/2)", r"\left( 3, \frac{\pi}{2} \right)", 1.0),
        ("1+x^2", "x^2+1", 1.0),
        (r"\sqrt{8}", r"2\sqrt{2}", 1.0),
        (r"\frac{1}{3}", "0.5", 0.0),
        ("x^2-1", "x^2+1", 0.0),
    ],
)
def test_equivalence_by_math_verify(prediction: str, truth: str, score: float) -> None:
    verdict = judge(f"The answer is $\\boxed{{{prediction}}}$.", truth)
    assert verdict.score == score and not verdict.math_verify_fallback


def test_fallback_when_math_verify_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("parser exploded")

    monkeypatch.setattr(math_reward, "_math_verify_equal", broken)
    verdict = judge(r"\boxed{\dfrac{1}{2}}", r"\frac{1}{2}")
    assert verdict == math_reward.MathJudgement(1.0, r"\dfrac{1}{2}", True)
    assert judge(r"\boxed{3}", "4").math_verify_fallback and judge(r"\boxed{3}", "4").score == 0.0


def test_normalize_answer() -> None:
    assert normalize_answer(r"\left( 1, \dfrac{2}{3} \right).") == r"(1,\frac{2}{3})"
    assert normalize_answer(r"90^\circ") == "90" and normalize_answer(r"\text{ Tuesday }") == "Tuesday"


def test_works_outside_the_main_thread() -> None:
    # math-verify's signal-based timeout refuses non-main threads; judge() disables it there.
    results: list[object] = []
    thread = threading.Thread(target=lambda: results.append(judge(r"\boxed{\frac{2}{4}}", "0.5")))
    thread.start()
    thread.join()
    assert results == [math_reward.MathJudgement(1.0, r"\frac{2}{4}", False)]
