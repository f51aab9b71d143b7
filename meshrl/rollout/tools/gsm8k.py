"""verl's GSM8K answer-check tool (``verl.tools.gsm8k_tool.Gsm8kTool``, ``calc_gsm8k_reward``): the model
submits an answer and reads back whether it is right.

Arguments: ``{"answer": str}``; ``create_kwargs.ground_truth`` (from the row's
``extra_info.tools_kwargs.calc_gsm8k_reward``) is the reference. As verl's tool: the answer gets a ``#### ``
prefix unless it has one, is scored with GSM8K's flexible rule (1.0 right, 0.0 otherwise), and the output
is ``Current parsed answer='<answer>' reward=<score>``. The call's tool reward is verl's: -0.05 for a
submission that does not improve on the instance's reward so far, 0.0 for one that does; as each call stands
alone (verl's agent loop also creates and releases the tool per call), that is 0.0 for a right answer and -0.05
for a wrong one. Custom reward functions read them in ``extra_info["tool_rewards"]``.
"""

from __future__ import annotations

from typing import Any, Mapping

from meshrl.rewards import gsm8k
from meshrl.rollout.tools.base import Tool, ToolAnswer

NOT_IMPROVED = -0.05  # verl's penalty for a submission that does not beat the instance's reward so far


class Gsm8kAnswerTool(Tool):
    """``{"answer": str}`` -> ``Current parsed answer=... reward=...`` (module docstring)."""

    def call(self, arguments: dict[str, Any], create_kwargs: Mapping[str, Any]) -> ToolAnswer:
        if create_kwargs.get("ground_truth") is None:
            raise ValueError("this sample has no ground truth for the tool (extra_info.tools_kwargs."
                             f"{self.name}.create_kwargs.ground_truth)")
        answer = str(arguments.get("answer", ""))
        response = answer if answer.startswith("#### ") else "#### " + answer
        reward = gsm8k.compute_score(response, str(create_kwargs["ground_truth"]), method="flexible",
                                     format_score=0.0, score=1.0)
        # A fresh instance's reward is 0.0 (verl's create): only a right answer improves on it.
        return ToolAnswer(f"Current parsed {answer=} {reward=}", 0.0 if reward > 0.0 else NOT_IMPROVED)
