"""verl's GSM8K answer-check tool (``verl.tools.gsm8k_tool.Gsm8kTool``, ``calc_gsm8k_reward``;
``meshrl.rollout.tools.answer_check`` for the arguments, output and tool reward): as verl's tool, the answer gets a
``#### `` prefix unless it has one and is scored with GSM8K's flexible rule (1.0 right, 0.0 otherwise).
"""

from __future__ import annotations

from meshrl.rewards import gsm8k
from meshrl.rollout.tools.answer_check import AnswerCheckTool


class Gsm8kAnswerTool(AnswerCheckTool):
    """verl's ``Gsm8kTool`` (module docstring)."""

    def score(self, answer: str, ground_truth: str) -> float:
        response = answer if answer.startswith("#### ") else "#### " + answer
        return gsm8k.compute_score(response, ground_truth, method="flexible", format_score=0.0, score=1.0)
