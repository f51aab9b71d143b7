"""Which learned reward model a run has (``reward_model.enable``), decided from the config and the checkpoint.

- **discriminative**: an HF ``*ForSequenceClassification`` checkpoint (one label). It runs as the Megatron
  reward-model role (``meshrl.workers.reward_model``) and scores every response; with
  ``custom_reward_function.path`` the function scores and reads the model's score as ``extra_info["rm_score"]``.
- **generative** (a judge): a causal language model with ``custom_reward_function.path`` set, verl's GenRM
  contract: a vLLM server serves the model and the function asks it (``meshrl.rewards.judge``). A causal LM
  without a function is refused at preflight, as verl requires ("genrm must set custom_reward_function").

The checkpoint's kind is read from its ``config.json`` (``architectures``); meshrl's named models are known by
name (``tiny-rm:<family>`` are sequence classifiers, ``tiny:`` / ``embedded:`` models causal LMs). A path that
is not there counts as discriminative here; the reward model's preflight says it is missing.
"""

from __future__ import annotations

import json
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

DISCRIMINATIVE, GENERATIVE = "discriminative", "generative"
JUDGE_SECTIONS = ("reward_model.rollout", "reward.reward_model.rollout")


def is_sequence_classifier(path: str) -> bool:
    """Whether the checkpoint at ``path`` is an HF ``*ForSequenceClassification`` model (``tiny-rm:`` names are)."""
    if path.startswith("tiny-rm:"):
        return True
    if path.startswith(("tiny:", "embedded:")):
        return False
    config = Path(path).expanduser() / "config.json"
    if not config.is_file():
        return True
    try:
        architectures = json.loads(config.read_text()).get("architectures") or []
    except (OSError, ValueError):
        return True  # unreadable: the reward model's preflight reports it
    return any(a.endswith("ForSequenceClassification") for a in architectures)


def reward_model_kind(cfg: DictConfig) -> str | None:
    """``"discriminative"``, ``"generative"``, or None without ``reward_model.enable`` (module docstring)."""
    rm = cfg.reward_model
    if not rm.enable:
        return None
    if cfg.custom_reward_function.path and rm.model.path and not is_sequence_classifier(str(rm.model.path)):
        return GENERATIVE
    return DISCRIMINATIVE


def unused_judge_keys(cfg: DictConfig, kind: str | None) -> list[str]:
    """``reward_model.rollout.*`` keys (either home) set away from their defaults in a run without a judge, where
    nothing reads them: a start-up note names them."""
    if kind == GENERATIVE:
        return []
    from meshrl.config.key_policy import leaf_keys
    from meshrl.config.loader import default_config

    defaults, found = default_config(), []
    for section in JUDGE_SECTIONS:
        for key in leaf_keys(OmegaConf.select(cfg, section), f"{section}."):
            value = OmegaConf.select(cfg, key)
            plain = OmegaConf.to_container(value) if OmegaConf.is_config(value) else value
            default = OmegaConf.select(defaults, key)
            if plain != (OmegaConf.to_container(default) if OmegaConf.is_config(default) else default):
                found.append(f"{key}={plain}")
    return found
