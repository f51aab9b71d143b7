"""Build a run's configuration: schema defaults ← recipe YAML (with its ``defaults``) ← ``key=value`` overrides.

Contract:
- Every key must exist in the schema (``meshrl.config.schema``); an unknown key is a problem naming
  the key, where it came from, and the closest valid keys ("did you mean ...?").
- A value of the wrong type is a problem naming the key and the expected type.
- Every problem of a recipe and its overrides is collected, then one ``ConfigError`` lists them all
  (its ``keys`` name the keys), so a verl script is fixed in one pass.
- Overrides use verl's / Hydra's syntax: ``a.b=1``, ``a.b=[x,y]`` and ``a.b="['x','y']"`` (YAML
  values), ``+a.b=1`` and ``++a.b=1`` (accepted, same as ``a.b=1``: every valid key already exists),
  ``~a.b`` is refused.
- Hydra's config-group selections (``actor@actor_rollout_ref.actor=mlite_actor``) and search path
  (``hydra.searchpath=[...]``) load configs from outside verl's tree, such as another training engine's:
  they are refused in one message, without the unknown keys of the configs they would have loaded.
- A list-of-strings key given one string holds a one-element list (verl's ``trainer.logger=console``).
- verl's base configs as recipe names, ``ppo_trainer`` and ``ppo_megatron_trainer`` (``.yaml`` or not,
  in any folder that has no such file), are the schema defaults: verl's tree is the schema's.
- verl's asynchronous trainers' config names (``fully_async_ppo_trainer``, ``one_step_off_ppo_megatron_trainer``,
  ...) are meshrl's copies of them (``meshrl/config/verl_async/``, which set ``trainer.async_mode``), wherever the
  script's ``--config-path`` points. A key of the sections only those configs have (``async_training.*`` for the
  fully async trainer, the top-level ``rollout.*`` for both), whatever its value, is refused in a run of another
  trainer, all such keys in one problem naming them (``meshrl.config.async_keys``).
- ``model_engine`` selects verl's training backend: megatron; verl's FSDP names load with one warning
  (meshrl trains with its Megatron backend); any other engine is refused.
- A recipe may list other recipes to start from: ``defaults: [base_recipe, ...]`` (names resolve in
  the recipe's folder, then in ``recipes/``), merged in order before the recipe itself, or where Hydra's
  ``_self_`` stands in the list. verl's example configs are such recipes (``defaults: [ppo_megatron_trainer,
  _self_]``); their ``hydra.searchpath`` may name verl's own config folder (``.../verl/trainer/config``,
  whose tree is the schema's), any other search path is refused as on the command line.
Semantic checks (ranges, cross-key rules) are ``meshrl.config.validate.validate_config``.
"""

from __future__ import annotations

import difflib
import functools
import pickle
import re
import warnings
from pathlib import Path
from typing import Iterable, Sequence

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from meshrl.config.async_keys import (ASYNC_CONFIG_NAMES, ASYNC_TRAINING, asks_for_async, fill_fully_async_batch,
                                      section_read)
from meshrl.config.schema import MODEL_ENGINES, MeshRLConfig
from meshrl.config.refusals import ConfigError

_ABSENT = object()
# The recipes: an installed wheel's copy (meshrl/recipes, setup.py's package_dir), else the checkout's recipes/.
_PACKAGED_RECIPES = Path(__file__).resolve().parents[1] / "recipes"
RECIPES_DIR = _PACKAGED_RECIPES if _PACKAGED_RECIPES.is_dir() else Path(__file__).resolve().parents[2] / "recipes"
VERL_ASYNC_CONFIGS_DIR = Path(__file__).resolve().parent / "verl_async"
# verl's --config-name values for its FSDP and Megatron trainers; both trees are the schema's.
VERL_BASE_CONFIGS = ("ppo_trainer", "ppo_megatron_trainer")


class _AsyncTrainingKey(ConfigError):
    """A key that asks for asynchronous training (``meshrl.config.async_keys``); all of them make one problem."""


def _async_training_error(keys: Sequence[str]) -> ConfigError:
    engine = [k for k in keys if k.startswith("rollout.")
              and OmegaConf.select(_defaults_template(), f"actor_rollout_ref.{k.partition('=')[0]}", default=None)
              is not None]
    hint = (f" ({', '.join(k.partition('=')[0] for k in engine)}: the top-level rollout section is the fully async "
            "rollouter's; the rollout engine's keys are actor_rollout_ref.rollout.*)") if engine else ""
    return ConfigError(f"{', '.join(keys)}: {ASYNC_TRAINING}{hint}", [k.partition("=")[0] for k in keys])


def _one_error(problems: list[ConfigError]) -> ConfigError:
    asked = [k for p in problems if isinstance(p, _AsyncTrainingKey) for k in p.keys]
    if asked:
        problems = [p for p in problems if not isinstance(p, _AsyncTrainingKey)] + [_async_training_error(asked)]
    if len(problems) == 1:
        return problems[0]
    lines = "\n  - ".join(str(p) for p in problems)
    return ConfigError(f"{len(problems)} config problems:\n  - {lines}", [k for p in problems for k in p.keys])


@functools.lru_cache(maxsize=1)
def _defaults_template() -> DictConfig:
    cfg = OmegaConf.structured(MeshRLConfig)
    OmegaConf.set_struct(cfg, True)
    return cfg


@functools.lru_cache(maxsize=1)
def _defaults_pickle() -> bytes:
    return pickle.dumps(_defaults_template())


def default_config() -> DictConfig:
    """The schema's defaults as a struct-mode OmegaConf tree (unknown keys are refused); a fresh copy."""
    # Unpickling the built tree is ~6x faster than deep-copying it, which is several times faster than building it
    # from the dataclasses again (every config check starts here).
    return pickle.loads(_defaults_pickle())


def all_keys(cfg: DictConfig, prefix: str = "") -> list[str]:
    """Every dotted key path in ``cfg`` (leaves and sections)."""
    keys = []
    for key in cfg.keys():
        path = f"{prefix}{key}"
        keys.append(path)
        node = cfg._get_node(key)
        if isinstance(node, DictConfig) and not node._is_missing() and not node._is_none():
            keys.extend(all_keys(node, path + "."))
    return keys


@functools.lru_cache(maxsize=1024)
def suggest(bad_key: str, limit: int = 3) -> tuple[str, ...]:
    """Schema keys close to ``bad_key``: same leaf name elsewhere in the tree first, then spelling."""
    # Cached: a verl script's unknown keys recur across scripts, and each look-up compares every key.
    keys = all_keys(_defaults_template())
    leaf = bad_key.rsplit(".", 1)[-1]
    same_leaf = [k for k in keys if k.rsplit(".", 1)[-1] == leaf]
    close = difflib.get_close_matches(bad_key, keys, n=limit, cutoff=0.6)
    matcher = difflib.SequenceMatcher(b=leaf)

    def leaf_is_close(key: str) -> bool:
        matcher.set_seq1(key.rsplit(".", 1)[-1])
        # The cheap upper bounds first, as difflib.get_close_matches does: most keys fail them.
        return matcher.real_quick_ratio() > 0.8 and matcher.quick_ratio() > 0.8 and matcher.ratio() > 0.8

    by_leaf = [k for k in keys if leaf_is_close(k)]
    out: list[str] = []
    for key in same_leaf + close + by_leaf:
        if key not in out and key != bad_key:
            out.append(key)
    return tuple(out[:limit])


def _unknown_key_error(bad_key: str, source: str) -> ConfigError:
    hint = suggest(bad_key)
    did_you_mean = f" Did you mean: {', '.join(hint)}?" if hint else ""
    return ConfigError(f"unknown config key '{bad_key}' (from {source}).{did_you_mean}", [bad_key])


def _flatten(tree: dict, prefix: str = "") -> Iterable[tuple[str, object]]:
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            yield from _flatten(value, path + ".")
        else:
            yield path, value


def _is_free_form(cfg: DictConfig, key: str) -> bool:
    """True when ``key`` lies under a ``Dict[str, Any]`` field (e.g. ``model.override_config.*``)."""
    node = cfg
    for part in key.split(".")[:-1]:
        if not isinstance(node, DictConfig) or part not in node:
            return False
        node = node._get_node(part)
        # Schema sections are dataclasses; a plain-dict object type marks a free-form field.
        if isinstance(node, DictConfig) and node._metadata.object_type is dict:
            return True
    return False


def is_schema_key(cfg: DictConfig, key: str) -> bool:
    """True when ``key`` is a key of ``cfg``'s schema: a field, or an entry of a free-form dict field. Any other key
    is refused as unknown (``meshrl.config.key_policy.key_status`` names it so)."""
    return _is_free_form(cfg, key) or OmegaConf.select(cfg, key, default=_ABSENT) is not _ABSENT


def _is_string_list(cfg: DictConfig, key: str) -> bool:
    node = OmegaConf.select(cfg, key, default=None)
    return isinstance(node, ListConfig) and node._metadata.element_type is str


def _set(cfg: DictConfig, key: str, value: object, source: str) -> None:
    """Set ``key``; a key of an asynchronous trainer's sections is set, then reported (``_AsyncTrainingKey``):
    ``load_config`` drops the report once the whole config is known to run that trainer."""
    _update(cfg, key, value, source)
    if asks_for_async(key):
        raise _AsyncTrainingKey(ASYNC_TRAINING, [f"{key}={value}"])


def _update(cfg: DictConfig, key: str, value: object, source: str) -> None:
    if not is_schema_key(cfg, key):
        raise _unknown_key_error(key, source)
    free_form = _is_free_form(cfg, key)
    if isinstance(value, str) and _is_string_list(cfg, key):
        value = [value]
    try:
        OmegaConf.update(cfg, key, value, merge=True, force_add=free_form)
    except ConfigKeyError as exc:
        raise _unknown_key_error(getattr(exc, "full_key", key) or key, source) from None
    except ValidationError as exc:
        expected = _expected_type(cfg, key)
        raise ConfigError(f"config key '{key}' (from {source}): {str(exc).splitlines()[0]}; "
                          f"expected {expected}.", [key]) from None


def _expected_type(cfg: DictConfig, key: str) -> str:
    parent, _, leaf = key.rpartition(".")
    node = OmegaConf.select(cfg, parent) if parent else cfg
    try:
        ref = node._get_node(leaf)._metadata.ref_type
        return getattr(ref, "__name__", str(ref)).replace("typing.", "")
    except (AttributeError, KeyError):
        return "a value of the schema's type"


def parse_override(item: str) -> tuple[str, object]:
    """``'a.b=1'`` → ``('a.b', 1)``, the value parsed as YAML (as Hydra does)."""
    if item.startswith("~"):
        raise ConfigError(f"override '{item}': deleting keys is not supported; set the key instead.")
    if not item.strip():
        raise ConfigError(f"override {item!r} is blank: a shell script line ending in a backslash followed by a "
                          "space or a comment passes a blank argument and ends the command there, so the lines "
                          "after it never reach meshrl; remove the space or comment after the backslash.")
    key, sep, raw = item.lstrip("+").partition("=")
    if not sep or not key:
        raise ConfigError(f"override '{item}' is not of the form key=value "
                          "(e.g. algorithm.adv_estimator=grpo).", [key.strip()] if key.strip() else [])
    escaped, raw = _hide_hydra_escapes(raw)
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"override '{item}': the value is not valid YAML ({exc}).") from None
    return key.strip(), _restore_hydra_escapes(value, escaped)


# Hydra's override grammar lets an unquoted value carry its special characters escaped with a backslash
# (``a.\{*\}`` is the string ``a.{*}``); YAML has no such escape. Each escaped character is parsed as a
# private-use placeholder, then put back into the strings of the parsed value.
_HYDRA_ESCAPE = re.compile(r"\\([\\()\[\]{}:=, \t])")
_PLACEHOLDER_BASE = 0xE000


def _hide_hydra_escapes(raw: str) -> tuple[list[str], str]:
    escaped: list[str] = []

    def hide(match: re.Match) -> str:
        escaped.append(match.group(1))
        return chr(_PLACEHOLDER_BASE + len(escaped) - 1)

    return escaped, _HYDRA_ESCAPE.sub(hide, raw)


def _restore_hydra_escapes(value, escaped: list[str]):
    if not escaped:
        return value
    if isinstance(value, str):
        return "".join(escaped[ord(c) - _PLACEHOLDER_BASE] if 0 <= ord(c) - _PLACEHOLDER_BASE < len(escaped) else c
                       for c in value)
    if isinstance(value, list):
        return [_restore_hydra_escapes(v, escaped) for v in value]
    if isinstance(value, dict):
        return {_restore_hydra_escapes(k, escaped): _restore_hydra_escapes(v, escaped) for k, v in value.items()}
    return value


def resolve_recipe(name: str | Path, relative_to: Path | None = None) -> Path | None:
    """A recipe name or path → an existing YAML file; ``None`` for verl's base configs (the schema
    defaults) when no such file exists."""
    candidates = [Path(name)]
    stem = str(name) if str(name).endswith((".yaml", ".yml")) else f"{name}.yaml"
    if Path(stem).stem in ASYNC_CONFIG_NAMES:  # verl's, or a copy of it: the name says what it is
        return VERL_ASYNC_CONFIGS_DIR / f"{Path(stem).stem}.yaml"
    if relative_to is not None:
        candidates.append(relative_to / stem)
    candidates.append(RECIPES_DIR / stem)
    for path in candidates:
        if path.is_file():
            return path
    if Path(stem).stem in VERL_BASE_CONFIGS:
        return None
    known = sorted(p.stem for p in RECIPES_DIR.glob("*.yaml")) if RECIPES_DIR.is_dir() else []
    close = difflib.get_close_matches(Path(stem).stem, known, n=3)
    hint = f" Did you mean: {', '.join(close)}?" if close else f" Known recipes: {', '.join(known)}."
    raise ConfigError(f"recipe '{name}' not found (looked in {', '.join(str(c) for c in candidates)}).{hint}")


def _apply_recipe(cfg: DictConfig, path: Path | None, problems: list[ConfigError],
                  seen: tuple[Path, ...] = ()) -> None:
    if path is None:
        return
    if path in seen:
        raise ConfigError(f"recipe defaults form a cycle: {' -> '.join(map(str, seen + (path,)))}")
    try:
        tree = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"recipe {path} is not valid YAML: {exc}") from None
    if not tree:  # a blank file (or one of comments only) would run the defaults as if it were the recipe asked for
        raise ConfigError(f"recipe {path} is empty: it sets no key. Write the recipe's sections into it (see "
                          "recipes/cpu_tiny_grpo.yaml), or leave out --config-name to run the defaults")
    if not isinstance(tree, dict):
        raise ConfigError(f"recipe {path} must be a mapping of sections, got {type(tree).__name__}")
    _check_search_path(tree.pop("hydra", None), path)
    defaults = list(tree.pop("defaults", []) or [])
    for parent in defaults if "_self_" in defaults else [*defaults, "_self_"]:
        if parent != "_self_":
            _apply_recipe(cfg, resolve_recipe(parent, path.parent), problems, seen + (path,))
            continue
        for key, value in _flatten(tree):
            try:
                _set(cfg, key, value, source=str(path))
            except ConfigError as exc:
                problems.append(exc)


def _check_search_path(hydra: object, path: Path) -> None:
    """A recipe's ``hydra`` section may only point at verl's own config folder (module docstring)."""
    if hydra is None:
        return
    entries = hydra.get("searchpath") if isinstance(hydra, dict) and set(hydra) == {"searchpath"} else None
    if not isinstance(entries, list) or not all(str(e).rstrip("/").endswith("verl/trainer/config") for e in entries):
        raise ConfigError(f"recipe {path}: hydra: {hydra!r}; meshrl reads a hydra section only as a searchpath to "
                          "verl's own config folder (verl/trainer/config, whose tree is meshrl's schema). Other "
                          "search paths load configs from outside verl's tree: drop them", ["hydra"])


def _check_model_engine(cfg: DictConfig) -> None:
    engine = cfg.model_engine
    if engine not in MODEL_ENGINES:
        raise ConfigError(f"model_engine '{engine}': meshrl trains with its Megatron backend; use "
                          f"model_engine=megatron (one of {', '.join(MODEL_ENGINES)}).", ["model_engine"])
    if engine != "megatron":
        warnings.warn(f"model_engine={engine}: meshrl trains with its Megatron backend (the fsdp_config "
                      "param_offload / optimizer_offload flags carry over to it); set model_engine=megatron "
                      "to silence this.", stacklevel=3)


def _config_group_error(overrides: Sequence[str]) -> ConfigError | None:
    """One problem for Hydra's config-group selections and search path among ``overrides``, or None."""
    groups = [item.lstrip("+") for item in overrides
              if "@" in item.partition("=")[0] or item.lstrip("+").startswith("hydra.searchpath=")]
    if not groups:
        return None
    return ConfigError(
        f"{', '.join(groups)}: Hydra config-group selections and search paths load configs from outside verl's own "
        "tree (verl's Megatron Lite engine is chosen this way); meshrl has one config tree and trains with its "
        "Megatron backend: drop them, and use the actor_rollout_ref.actor.megatron.* keys instead of the selected "
        "config's", [item.partition("=")[0] for item in groups])


def load_config(overrides: Sequence[str] = (), recipe: str | Path | None = None) -> DictConfig:
    """Defaults ← recipe ← overrides, checked key by key and type by type (see module docstring)."""
    if (error := _config_group_error(overrides)) is not None:
        raise error
    cfg = default_config()
    problems: list[ConfigError] = []
    if recipe is not None:
        _apply_recipe(cfg, resolve_recipe(recipe), problems)
    for item in overrides:
        try:
            key, value = parse_override(item)
            _set(cfg, key, value, source=f"override '{item}'")
        except ConfigError as exc:
            problems.append(exc)
    # the asynchronous trainers' keys are theirs: refused only in a run of a trainer that does not read them
    problems = [p for p in problems if not (isinstance(p, _AsyncTrainingKey) and all(section_read(cfg, k) for k in
                                                                                    p.keys))]
    if problems:
        raise _one_error(problems)
    _check_model_engine(cfg)
    try:
        OmegaConf.resolve(cfg)
    except OmegaConfBaseException as exc:
        raise ConfigError(f"config interpolation failed: {exc}") from None
    fill_fully_async_batch(cfg)
    return cfg
