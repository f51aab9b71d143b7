"""Geometry3K's reward is verl's geo3k score: (1 - format_score) * accuracy + format_score * format."""

import pytest

from meshrl.rewards.dispatch import default_compute_score


@pytest.mark.parametrize("response,score", [
    ("<think>the angles sum</think> so x = \\boxed{3}", 1.0),  # right, formatted
    ("x = \\boxed{3}", 0.9),  # right, no <think>
    ("<think>guess</think> \\boxed{4}", 0.1),  # wrong, formatted
    ("<think>guess</think> the answer is 3", 0.0),  # no boxed answer: neither
    ("x = \\boxed{\\frac{6}{2}}", 0.9),  # equivalent, not equal
])
def test_geo3k_scores_the_boxed_answer_and_the_think_format(response, score):
    assert default_compute_score("hiyouga/geometry3k", response, "3") == pytest.approx(score)
    assert default_compute_score("hiyouga/geometry3k", response, "3", format_score=0.0) == pytest.approx(
        1.0 if score >= 0.9 else 0.0)
