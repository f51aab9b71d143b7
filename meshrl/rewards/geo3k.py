r"""Geometry3K's rule reward (verl's ``geo3k`` score, ``data_source`` ``hiyouga/geometry3k``):

    score = (1 - format_score) * accuracy + format_score * format

``accuracy`` is 1 when the last ``\boxed{...}`` of the response (the whole response with ``use_boxed=False``) is
equivalent to the ground truth, ``format`` is 1 when the response is ``<think>...</think>`` followed by a boxed
answer; ``format_score`` is 0.1 by default, verl's. verl grades the answer with ``mathruler``'s ``grade_answer``,
which is not on the registry here; meshrl decides equivalence with math-verify, as its MATH reward does
(``meshrl.rewards.math``).
"""

from __future__ import annotations

import re

from meshrl.rewards import math as math_reward

GEO3K_SOURCES = frozenset({"hiyouga/geometry3k"})
_FORMAT = re.compile(r"<think>.*</think>.*\\boxed\{.*\}.*", re.DOTALL)


def compute_score(solution_str: str, ground_truth: str, use_boxed: bool = True, format_score: float = 0.1) -> float:
    """verl's geo3k score of ``solution_str`` against ``ground_truth`` (module docstring)."""
    formatted = 1.0 if _FORMAT.fullmatch(solution_str) else 0.0
    answer = math_reward.last_boxed_content(solution_str) if use_boxed else solution_str
    correct = answer is not None and math_reward.compute_score(f"\\boxed{{{answer}}}", ground_truth) == 1.0
    return (1.0 - format_score) * float(correct) + format_score * formatted
