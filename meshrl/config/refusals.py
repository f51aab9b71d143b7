"""Every rule that refuses a configuration, in one registry.

A rule is a function written beside the feature it protects and registered there with ``@refusal(stage, *keys)``:
it takes the ``Checked`` run (config, run plan, model config, prompts, as far as its stage knows them) and returns
its problems, each ``"key: what is wrong; what to do"``; it raises nothing. A run meets the ``STAGES`` in order,
and ``enforce(stage, checked)`` runs every rule of one stage and raises one ``ConfigError`` listing all their
problems, so a user fixes a recipe in one pass and no later stage runs on a configuration an earlier one refused.
``catalogue()`` lists the rules for ``meshrl refusals [KEY]`` (which keys each concerns, where it lives, why).

Not rules, because they read input rather than decide on it: the config loader's errors (a missing recipe, an
unknown key with its did-you-mean), a tokenizer or data file that does not load or has malformed rows, a tool or
interaction file that is malformed. Those raise ``ConfigError`` where they read.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence
from typing import Any

from omegaconf import DictConfig


class ConfigError(ValueError):
    """A configuration problem, with a message that says which key and how to fix it.

    ``keys``: the config keys the problem is about (empty when it is not about given keys).
    """

    def __init__(self, message: str, keys: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.keys = tuple(keys)


# stage -> what its rules check; the order is the run's: a stage's rules may assume every earlier stage passed.
STAGES = {
    "config": "the configuration alone, before anything loads (meshrl.config.validate.validate_config)",
    "files": "the folders, devices and files the run writes and reads: run folder, GPUs, weights, converted "
             "checkpoints",
    "model": "the configuration against the model's HF config: parallel layouts, LoRA, the reward model or judge",
    "rollout": "the rollout engine's settings against the model and this machine",
    "launch": "what the driver starts: Ray, the workers' allocator, the reward function and its sandbox",
    "data": "the configuration against the loaded prompts, and the checkpoint the run resumes from",
}


class Checked:
    """What the rules of a stage read: ``cfg`` always; ``plan`` (the ``RunPlan``) and ``hf_config`` (the model's) at
    ``files``, ``model``, ``rollout`` and ``launch``; ``train_data`` / ``val_data`` (the prompts as loaded and
    filtered) at ``data``. ``once(fn)`` is ``fn(cfg)`` computed once for all the rules of a stage."""

    def __init__(self, cfg: DictConfig, plan=None, hf_config=None, train_data=None, val_data=None) -> None:
        self.cfg, self.plan, self.hf_config = cfg, plan, hf_config
        self.train_data, self.val_data = train_data, val_data
        self._once: dict[Callable, Any] = {}

    def once(self, fn: Callable[[DictConfig], Any]) -> Any:
        if fn not in self._once:
            self._once[fn] = fn(self.cfg)
        return self._once[fn]


@dataclasses.dataclass(frozen=True)
class Rule:
    stage: str
    keys: tuple[str, ...]  # the config keys (or sections) it concerns
    check: Callable[[Checked], list[str]]

    @property
    def name(self) -> str:
        return f"{self.check.__module__}.{self.check.__qualname__}"

    @property
    def why(self) -> str:
        """The rule's docstring, on one line."""
        return " ".join((self.check.__doc__ or "").split())


RULES: list[Rule] = []


def refusal(stage: str, *keys: str) -> Callable:
    """Register the decorated ``fn(checked) -> problems`` as a rule of ``stage`` about ``keys``."""
    if stage not in STAGES:
        raise ValueError(f"unknown stage {stage!r}; one of {', '.join(STAGES)}")

    def register(fn: Callable[[Checked], list[str]]) -> Callable[[Checked], list[str]]:
        RULES.append(Rule(stage, keys, fn))
        return fn
    return register


def problems(stage: str, checked: Checked) -> list[str]:
    """Every problem the rules of ``stage`` find, in their registration order."""
    return [line for rule in RULES if rule.stage == stage for line in rule.check(checked)]


def enforce(stage: str, checked: Checked, what: str = "configuration") -> None:
    """Raise one ``ConfigError`` listing every problem of ``stage`` (``what``: the thing they make invalid)."""
    refuse(problems(stage, checked), what)


def refuse(found: list[str], what: str = "configuration") -> None:
    """Raise one ``ConfigError`` of ``found`` (problems of some rules, for a caller that runs only those): the
    problem itself when there is one, else a list headed ``invalid <what>``; its keys are those each problem
    starts with (``key: ...``, ``key=value: ...``, ``key1=v, key2=v: ...``). Nothing when ``found`` is empty."""
    if not found:
        return
    keys = [key for line in found for key in _keys(line)]
    if len(found) == 1:
        raise ConfigError(found[0], keys)
    lines = "\n  - ".join(found)
    raise ConfigError(f"invalid {what} ({len(found)} problems):\n  - {lines}", keys)


def _keys(problem: str) -> list[str]:
    names = (part.split("=")[0].strip() for part in problem.split(":", 1)[0].split(", "))
    return [name for name in names if _KEY.fullmatch(name)]


_KEY = re.compile(r"[A-Za-z_]\w*[._][\w.]*")  # a key has a dot or an underscore: not a word of a sentence


def catalogue(key: str | None = None) -> list[Rule]:
    """The registered rules in stage order (those about ``key`` or a key under or above it, when given)."""
    rules = sorted(RULES, key=lambda rule: list(STAGES).index(rule.stage))
    if key is None:
        return rules
    return [rule for rule in rules if any(k == key or k.startswith(key + ".") or key.startswith(k + ".")
                                          for k in rule.keys)]


def render(rules: list[Rule]) -> str:
    """``rules`` as ``meshrl refusals`` prints them: by stage, each rule's place, keys and why."""
    lines = []
    for stage, what in STAGES.items():
        if chosen := [rule for rule in rules if rule.stage == stage]:
            lines.append(f"{stage}: {what}")
            lines += [f"  {rule.name}\n    keys: {', '.join(rule.keys)}\n    {rule.why}" for rule in chosen]
    return "\n".join(lines)
