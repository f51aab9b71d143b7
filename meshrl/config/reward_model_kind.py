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

The judge's server settings, verl's ``reward_model.rollout.*``, have two homes (``reward.reward_model.rollout.*``,
verl's newer one): ``judge_rollout`` resolves them, and ``unused_judge_keys`` names those set in a run without a judge.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from meshrl.config.schema import RewardModelRolloutConfig

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


@functools.lru_cache(maxsize=1)
def _rollout_defaults() -> dict[str, Any]:
    return OmegaConf.to_container(OmegaConf.structured(RewardModelRolloutConfig), resolve=True)


def _changed(section: DictConfig) -> dict[str, Any]:
    """The fields of a ``reward_model.rollout``-shaped section set away from the schema's defaults, as plain values
    (a list or dict key may be None on one side: cudagraph_capture_sizes)."""
    values = OmegaConf.to_container(section, resolve=True)
    return {name: value for name, value in values.items() if value != _rollout_defaults()[name]}


def judge_rollout(cfg: DictConfig) -> tuple[dict[str, Any], list[str]]:
    """``reward_model.rollout``'s values, each following ``reward.reward_model.rollout``'s unless set itself
    (verl's two homes of the section); and the keys set in both to different values."""
    own, newer = _changed(cfg.reward_model.rollout), _changed(cfg.reward.reward_model.rollout)
    problems = [f"reward_model.rollout.{name}={value}, reward.reward_model.rollout.{name}={newer[name]}: verl's two "
                "names of one setting disagree; set one of them"
                for name, value in own.items() if name in newer and newer[name] != value]
    return {**OmegaConf.to_container(cfg.reward_model.rollout), **newer, **own}, problems


def unused_judge_keys(cfg: DictConfig, kind: str | None) -> list[str]:
    """``reward_model.rollout.*`` keys (either home) set away from their defaults in a run without a judge, where
    nothing reads them: a start-up note names them."""
    if kind == GENERATIVE:
        return []
    return [f"{section}.{name}={value}" for section in JUDGE_SECTIONS
            for name, value in _changed(OmegaConf.select(cfg, section)).items()]
