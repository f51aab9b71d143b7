"""verl's GSM8K interaction (``verl.interactions.gsm8k_interaction.Gsm8kInteraction``): a user who checks the
last assistant turn's answer and asks the model to try again until it is right.

``start_interaction(instance_id, ground_truth=...)`` keeps the sample's ground truth (verl's GSM8K rows pass it
in ``extra_info.interaction_kwargs``). Each ``generate_response`` scores the last assistant message with
GSM8K's strict ``####`` rule (``meshrl.rewards.gsm8k``: 1.0 right, 0.0 otherwise) and answers, as verl's:
``Your response is correct!`` and ends the conversation, or ``Your response is incorrect! You need to reflect
on your answer and try again.`` and goes on; the score is the turn's score. One difference: meshrl's rule
compares numbers (``18.00`` equals ``18``) where verl compares strings (``meshrl.rewards.gsm8k``).
"""

from __future__ import annotations

from typing import Any

from meshrl.rewards import gsm8k
from meshrl.rollout.interactions.base import Interaction

CORRECT = "Your response is correct!"
INCORRECT = "Your response is incorrect! You need to reflect on your answer and try again."


class Gsm8kInteraction(Interaction):
    """Checks the last assistant message against the ground truth (module docstring)."""

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__(config)
        self._instances: dict[str, dict[str, Any]] = {}

    async def start_interaction(self, instance_id: str | None = None, ground_truth: str | None = None,
                                **kwargs: Any) -> str:
        instance_id = await super().start_interaction(instance_id)
        if ground_truth is None:
            raise ValueError("this sample has no ground truth for the interaction "
                             "(extra_info.interaction_kwargs.ground_truth)")
        self._instances[instance_id] = {"response": "", "ground_truth": str(ground_truth)}
        return instance_id

    async def generate_response(self, instance_id: str, messages: list[dict[str, Any]], **kwargs: Any
                                ) -> tuple[bool, str, float, dict[str, Any]]:
        last = next((m.get("content") or "" for m in reversed(messages) if m.get("role") == "assistant"), "")
        self._instances[instance_id]["response"] = last
        score = await self.calculate_score(instance_id)
        return (True, CORRECT, score, {}) if score == 1.0 else (False, INCORRECT, score, {})

    async def calculate_score(self, instance_id: str, **kwargs: Any) -> float:
        state = self._instances[instance_id]
        return gsm8k.compute_score(state["response"], state["ground_truth"], method="strict", format_score=0.0,
                                   score=1.0)

    async def finalize_interaction(self, instance_id: str, **kwargs: Any) -> None:
        self._instances.pop(instance_id, None)
