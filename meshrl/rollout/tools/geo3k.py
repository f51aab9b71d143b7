"""verl's Geometry3K answer-check tool (``verl.tools.geo3k_tool.Geo3kTool``, ``calc_geo3k_reward``;
``meshrl.rollout.tools.answer_check`` for the arguments, output and tool reward): as verl's tool, the answer as given
(no ``\\boxed{}`` needed: ``use_boxed=False``) is scored with the Geometry3K rule without its format part
(``meshrl.rewards.geo3k``, ``format_score=0``: 1.0 right, 0.0 otherwise). ``meshrl.data.preprocess
geo3k_multiturn_w_tool`` writes the rows' ground truths where it reads them.
"""

from __future__ import annotations

from meshrl.rewards import geo3k
from meshrl.rollout.tools.answer_check import AnswerCheckTool


class Geo3kAnswerTool(AnswerCheckTool):
    """verl's ``Geo3kTool`` (module docstring)."""

    def score(self, answer: str, ground_truth: str) -> float:
        return geo3k.compute_score(answer, ground_truth, use_boxed=False, format_score=0.0)
