"""verl's GSM8K answer-check tool (``verl.tools.gsm8k_tool.Gsm8kTool``, ``calc_gsm8k_reward``): the model
submits an answer and reads back whether it is right.

Arguments: ``{"answer": str}``; ``create_kwargs.ground_truth`` (from the row's
``extra_info.tools_kwargs.calc_gsm8k_reward``) is the reference. As verl's tool: the answer gets a ``#### ``
prefix unless it has one, is scored with GSM8K's flexible rule (1.0 right, 0.0 otherwise), and the output
is ``Current parsed answer='<answer>' reward=<score>``. verl's tool also returns a per-call tool reward
(-0.05 for a non-improving submission) that only custom reward functions read; meshrl's rollout keeps no
tool rewards, and each call stands alone (verl's agent loop also creates and releases the tool per call).
"""

from __future__ import annotations

from typing import Any, Mapping

from meshrl.rewards import gsm8k
from meshrl.rollout.tools.base import Tool


class Gsm8kAnswerTool(Tool):
    """``{"answer": str}`` -> ``Current parsed answer=... reward=...`` (module docstring)."""

    def call(self, arguments: dict[str, Any], create_kwargs: Mapping[str, Any]) -> str:
        if create_kwargs.get("ground_truth") is None:
            raise ValueError("this sample has no ground truth for the tool (extra_info.tools_kwargs."
                             f"{self.name}.create_kwargs.ground_truth)")
        answer = str(arguments.get("answer", ""))
        response = answer if answer.startswith("#### ") else "#### " + answer
        reward = gsm8k.compute_score(response, str(create_kwargs["ground_truth"]), method="flexible",
                                     format_score=0.0, score=1.0)
        return f"Current parsed {answer=} {reward=}"
