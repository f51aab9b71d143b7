"""The transformers classes a family names (``Family.config_class`` / ``policy_class`` / ``critic_class``),
including the one transformers lacks: ``Gemma3TextForTokenClassification``.

transformers 5.x has token-classification heads for Gemma and Gemma 2 but none for Gemma 3 text
(``gemma3_text``). meshrl's critic of that family is built from transformers' own pieces — the generic
token-classification head (``score``: hidden -> num_labels, with bias) on ``Gemma3TextModel`` — so an
exported critic loads with ``AutoModelForTokenClassification`` once this module is imported (it registers
the class for ``Gemma3TextConfig``).
"""

from __future__ import annotations

import transformers
from transformers.modeling_layers import GenericForTokenClassification
from transformers.models.gemma3.modeling_gemma3 import Gemma3PreTrainedModel


class Gemma3TextForTokenClassification(GenericForTokenClassification, Gemma3PreTrainedModel):
    """Gemma 3 text critic: ``model`` (``Gemma3TextModel``) and ``score``, the layout of Gemma2's class."""

    config_class = transformers.Gemma3TextConfig


transformers.AutoModelForTokenClassification.register(transformers.Gemma3TextConfig, Gemma3TextForTokenClassification,
                                                      exist_ok=True)

_MESHRL_CLASSES = {"Gemma3TextForTokenClassification": Gemma3TextForTokenClassification}


def hf_class(name: str) -> type:
    """transformers' class ``name``, or meshrl's of that name; ``AttributeError`` when neither exists."""
    if name in _MESHRL_CLASSES:
        return _MESHRL_CLASSES[name]
    return getattr(transformers, name)
