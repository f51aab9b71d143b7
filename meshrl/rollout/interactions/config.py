"""verl's interaction config file (``rollout.multi_turn.interaction_config_path``) read as verl writes it::

    interaction:
      - name: "gsm8k"                                                    # optional (derived as below)
        class_name: "verl.interactions.gsm8k_interaction.Gsm8kInteraction"  # or module.Class of an Interaction
        config: {}                                                        # the interaction's own keys

verl's interaction classes are mapped explicitly onto meshrl's (``VERL_INTERACTIONS``: verl's GSM8K
interaction and its base class); any other ``class_name`` must import as a subclass of
``meshrl.rollout.interactions.base.Interaction``. Without ``name``, the name is the class's name lower-cased
without its ``Interaction`` suffix (verl's rule: ``Gsm8kInteraction`` -> ``gsm8k``); the registry injects it
into the config. A sample picks its interaction by ``extra_info.interaction_kwargs.name``
(``interaction_for``). Refused, each naming the entry and what to do: a missing or malformed file, a class
that is neither (a module that fails to import reports its own error), two interactions of one name, and
config keys the interaction does not read.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any, Iterable, Mapping

import yaml

from meshrl.config.refusals import Checked, refusal
from meshrl.rollout.interactions.base import Interaction, InteractionConfigError
from meshrl.rollout.interactions.gsm8k import Gsm8kInteraction

KEY = "actor_rollout_ref.rollout.multi_turn.interaction_config_path"
VERL_INTERACTIONS: dict[str, type[Interaction]] = {
    "verl.interactions.gsm8k_interaction.Gsm8kInteraction": Gsm8kInteraction,
    "verl.interactions.base.BaseInteraction": Interaction,
}
MESHRL_INTERACTIONS = (Interaction, Gsm8kInteraction)


def interaction_class(class_name: str) -> type[Interaction]:
    """The meshrl interaction for a config entry's ``class_name`` (module docstring)."""
    if class_name in VERL_INTERACTIONS:
        return VERL_INTERACTIONS[class_name]
    module, _, name = class_name.rpartition(".")
    known = ", ".join(sorted(VERL_INTERACTIONS) + [f"{c.__module__}.{c.__name__}" for c in MESHRL_INTERACTIONS])
    if not module:
        raise InteractionConfigError(f"class_name {class_name!r} is not a dotted module.Class path; known: {known}")
    try:
        cls = getattr(importlib.import_module(module), name, None)
    except Exception as error:  # noqa: BLE001 - any failure of the user's module is reported with its cause
        hint = ("; subclass meshrl's Interaction instead of verl's BaseInteraction (`from "
                "meshrl.rollout.interactions.base import Interaction`: the same four coroutines)"
                if isinstance(error, ModuleNotFoundError) and (error.name or "").split(".")[0] == "verl" else "")
        raise InteractionConfigError(f"class_name {class_name!r}: importing {module} failed: "
                                     f"{type(error).__name__}: {error}{hint}") from None
    if isinstance(cls, type) and issubclass(cls, Interaction):
        return cls
    why = f"{module} has no {name}" if cls is None else \
        f"{name} is not a subclass of {Interaction.__module__}.Interaction"
    raise InteractionConfigError(f"class_name {class_name!r}: {why}; an interaction is one of verl's meshrl maps "
                                 f"or an importable Interaction subclass (known: {known})")


def default_name(class_name: str) -> str:
    """verl's name for an entry without one: the class name lower-cased, without an ``Interaction`` suffix."""
    simple = class_name.rsplit(".", 1)[-1]
    return (simple[:-len("Interaction")] if simple.endswith("Interaction") else simple).lower()


def load_interactions(path: str | Path) -> dict[str, Interaction]:
    """The interactions of a verl interaction config file by name, built (module docstring)."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise InteractionConfigError(f"{KEY}={path}: no such file")
    try:
        document = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as error:
        raise InteractionConfigError(f"{KEY}={path}: not YAML ({error})") from None
    entries = document.get("interaction") if isinstance(document, dict) else None
    if not isinstance(entries, list) or not entries:
        raise InteractionConfigError(f"{KEY}={path}: expected a non-empty 'interaction:' list of "
                                     "{name, class_name, config}")
    interactions: dict[str, Interaction] = {}
    for index, entry in enumerate(entries):
        where = f"{KEY}={path}: interaction[{index}]"
        if not isinstance(entry, dict) or not isinstance(entry.get("class_name"), str):
            raise InteractionConfigError(f"{where} needs a class_name")
        config = entry.get("config") or {}
        if not isinstance(config, dict):
            raise InteractionConfigError(f"{where}.config must be a mapping, got {type(config).__name__}")
        name = str(entry.get("name") or default_name(entry["class_name"]))
        if name in interactions:
            raise InteractionConfigError(f"{where}: the name {name!r} is taken by an earlier entry; give each "
                                         "interaction its own name")
        try:
            cls = interaction_class(entry["class_name"])
            interactions[name] = cls({**config, "name": name})
            if not all(hasattr(interactions[name], key) for key in ("name", "timeout_s")):
                raise InteractionConfigError(f"{cls.__name__}.__init__ must call super().__init__(config), which sets "
                                             "the interaction's name and timeout_s")
        except InteractionConfigError as error:
            raise InteractionConfigError(f"{where}: {error}") from None
        except Exception as error:  # noqa: BLE001 - a user's constructor failing is reported with the entry
            raise InteractionConfigError(f"{where}: building {entry['class_name']} with config {config} failed: "
                                         f"{type(error).__name__}: {error}") from None
    return interactions


def interaction_kwargs_of(extra_info: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    """A row's ``extra_info.interaction_kwargs`` (verl's per-sample interaction arguments), None without one."""
    return (extra_info or {}).get("interaction_kwargs")


def interaction_for(interactions: Mapping[str, Interaction], kwargs: Mapping[str, Any] | None) -> Interaction:
    """The interaction a sample's ``interaction_kwargs`` names (``name``); ``ValueError`` saying what is missing."""
    if not isinstance(kwargs, Mapping) or "name" not in kwargs:
        raise ValueError(f"with {KEY} set every row needs extra_info.interaction_kwargs.name, the interaction that "
                         f"answers it (one of {sorted(interactions)})")
    if kwargs["name"] not in interactions:
        raise ValueError(f"extra_info.interaction_kwargs.name={kwargs['name']!r} is not an interaction of {KEY}; "
                         f"it has {sorted(interactions)}")
    return interactions[kwargs["name"]]


def row_problems(interactions: Mapping[str, Interaction], rows: Iterable[tuple[str, Mapping[str, Any] | None]],
                 shown: int = 5) -> list[str]:
    """``where: why`` for each of ``rows`` (``(where, extra_info)``: a data file's row) whose interaction_kwargs
    pick no interaction; the first ``shown``, then how many more."""
    problems = []
    for where, info in rows:
        try:
            interaction_for(interactions, interaction_kwargs_of(info))
        except ValueError as error:
            problems.append(f"{where}: {error}")
    return problems[:shown] + ([f"... and {len(problems) - shown} more rows"] if len(problems) > shown else [])


@refusal("data", "data.train_files", "data.val_files", "actor_rollout_ref.rollout.multi_turn.interaction_config_path")
def rows_name_their_interaction(c: Checked) -> list[str]:
    """With interactions, each training and validation row's ``interaction_kwargs`` must pick one of those the
    interaction file defines (``row_problems``)."""
    multi_turn = c.cfg.actor_rollout_ref.rollout.multi_turn
    if not (multi_turn.enable and multi_turn.interaction_config_path):
        return []
    samples = [data[i] for data in (c.train_data, c.val_data) if data is not None for i in range(len(data))]
    rows = [(f"{s.source_file} row {s.row}", s.extra_info) for s in samples]
    return [f"a row without its interaction: {line}"
            for line in row_problems(load_interactions(multi_turn.interaction_config_path), rows)]
