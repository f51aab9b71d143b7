"""Interactions of multi-turn rollouts (verl's ``interaction_config_path``): a scripted user answering the model's
turns. The contract (``base``), verl's GSM8K interaction (``gsm8k``), verl's interaction config file
(``config``) and running them with timeouts on their own event loop (``runner``)."""

from meshrl.rollout.interactions.base import Interaction, InteractionConfigError
from meshrl.rollout.interactions.config import load_interactions

__all__ = ["Interaction", "InteractionConfigError", "load_interactions"]
