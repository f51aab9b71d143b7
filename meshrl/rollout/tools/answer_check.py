"""verl's answer-check tools (``Gsm8kTool``, ``Geo3kTool``): the model submits an answer and reads back whether it
is right.

Arguments: ``{"answer": str}`` (a number is taken as its text); ``create_kwargs.ground_truth`` (from the row's
``extra_info.tools_kwargs.<tool name>``) is the reference; a subclass's ``score`` grades the answer against it. As
verl's tools: the output is ``Current parsed answer='<answer>' reward=<score>``, and the call's tool reward is -0.05
for a submission that does not improve on the instance's reward so far, 0.0 for one that does; as each call stands
alone (verl's agent loop creates and releases the tool per call) and a fresh instance's reward is 0.0, that is 0.0
for a right answer and -0.05 for a wrong one. Custom reward functions read them in ``extra_info["tool_rewards"]``.
"""

from __future__ import annotations

from typing import Any, Mapping

from meshrl.rollout.tools.base import Tool, ToolAnswer

NOT_IMPROVED = -0.05  # verl's penalty for a submission that does not beat the instance's reward so far


class AnswerCheckTool(Tool):
    """``{"answer": str}`` -> ``Current parsed answer=... reward=...`` (module docstring); subclasses grade."""

    def score(self, answer: str, ground_truth: str) -> float:
        """The answer's reward against the row's ground truth."""
        raise NotImplementedError

    def call(self, arguments: dict[str, Any], create_kwargs: Mapping[str, Any]) -> ToolAnswer:
        if create_kwargs.get("ground_truth") is None:
            raise ValueError("this sample has no ground truth for the tool (extra_info.tools_kwargs."
                             f"{self.name}.create_kwargs.ground_truth)")
        answer = str(arguments.get("answer", ""))
        reward = self.score(answer, str(create_kwargs["ground_truth"]))
        return ToolAnswer(f"Current parsed {answer=} {reward=}", 0.0 if reward > 0.0 else NOT_IMPROVED)
