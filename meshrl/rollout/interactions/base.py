"""The interaction contract: a scripted user that answers the model's assistant turns (verl's ``BaseInteraction``).

An interaction is built from one entry of verl's interaction config (``meshrl.rollout.interactions.config``)
with its ``config`` mapping, into which the entry's ``name`` is injected (verl's registry does the same). Its
four methods are coroutines with verl's signatures, so a verl interaction's body ports unchanged:

- ``start_interaction(instance_id, **interaction_kwargs) -> instance_id``: one conversation starts; the
  keyword arguments are the sample's ``extra_info.interaction_kwargs`` (``name`` included);
- ``generate_response(instance_id, messages, **interaction_kwargs) -> (should_terminate, text, score, extra)``:
  the conversation so far as chat messages (the prompt's, then the assistant turns decoded without special
  tokens, tool messages and earlier user turns), answered by the user message ``text``; ``score`` (a float, or
  None for none) is this turn's score, which reaches the reward function in ``extra_info["turn_scores"]``;
  ``should_terminate`` ends the conversation after this user turn;
- ``calculate_score(instance_id, **kwargs) -> float``: the conversation's score so far (verl's interactions
  call it from ``generate_response``; the agent loop does not call it itself, as verl's does not);
- ``finalize_interaction(instance_id, **kwargs)``: the conversation ended; release its state.

Calls run on one event loop that outlives the rollouts (``meshrl.rollout.interactions.runner``), so an
interaction may hold loop-bound resources (an HTTP session) across steps. Config keys: ``name`` (set by the
registry), ``timeout_s`` (meshrl's: seconds a call may take before that sample's conversation ends with an
error, default 30), and the keys a subclass lists in ``CONFIG_KEYS``; any other key is refused.

The base class itself answers every turn as verl's ``BaseInteraction`` does: ``"Your current result seems
acceptable."`` with score 0.8, never terminating.
"""

from __future__ import annotations

import uuid
from typing import Any, ClassVar, Mapping

DEFAULT_TIMEOUT_S = 30.0


class InteractionConfigError(ValueError):
    """An interaction config entry meshrl cannot honour (the message names the entry and what to change)."""


class Interaction:
    """A scripted user (module docstring). Subclasses override the coroutines and list their ``CONFIG_KEYS``."""

    CONFIG_KEYS: ClassVar[frozenset[str]] = frozenset()

    def __init__(self, config: Mapping[str, Any]) -> None:
        self.config = dict(config)
        self.name = str(self.config.get("name", "interaction_agent"))
        unknown = sorted(set(self.config) - {"name", "timeout_s"} - self.CONFIG_KEYS)
        if unknown:
            raise InteractionConfigError(
                f"interaction {self.name!r} ({type(self).__name__}): config key(s) {unknown} are not read by this "
                f"interaction; it reads {sorted(self.CONFIG_KEYS | {'name', 'timeout_s'})}")
        self.timeout_s = float(self.config.get("timeout_s", DEFAULT_TIMEOUT_S))
        if self.timeout_s <= 0:
            raise InteractionConfigError(f"interaction {self.name!r}: timeout_s must be > 0, got {self.timeout_s}")

    async def start_interaction(self, instance_id: str | None = None, **kwargs: Any) -> str:
        return instance_id if instance_id is not None else uuid.uuid4().hex

    async def generate_response(self, instance_id: str, messages: list[dict[str, Any]], **kwargs: Any
                                ) -> tuple[bool, str, float | None, dict[str, Any]]:
        return False, "Your current result seems acceptable.", 0.8, {}

    async def calculate_score(self, instance_id: str, **kwargs: Any) -> float:
        return 0.0

    async def finalize_interaction(self, instance_id: str, **kwargs: Any) -> None:
        return None
