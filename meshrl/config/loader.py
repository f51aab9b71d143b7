"""Build a run's configuration: schema defaults ← recipe YAML (with its ``defaults``) ← ``key=value`` overrides.

Contract:
- Every key must exist in the schema (``meshrl.config.schema``); an unknown key raises ``ConfigError``
  naming the key, where it came from, and the closest valid keys ("did you mean ...?").
- A value of the wrong type raises ``ConfigError`` naming the key and the expected type.
- Overrides use verl's / Hydra's syntax: ``a.b=1``, ``a.b='[x,y]'`` (YAML values), ``+a.b=1`` and
  ``++a.b=1`` (accepted, same as ``a.b=1``: every valid key already exists), ``~a.b`` is refused.
- A recipe may list other recipes to start from: ``defaults: [base_recipe, ...]`` (names resolve in
  the recipe's folder, then in ``recipes/``), merged in order before the recipe itself.
Semantic checks (ranges, cross-key rules) are ``meshrl.config.validate.validate_config``.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Iterable, Sequence

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from meshrl.config.schema import MeshRLConfig

_ABSENT = object()
RECIPES_DIR = Path(__file__).resolve().parents[2] / "recipes"


class ConfigError(ValueError):
    """A configuration problem, with a message that says which key and how to fix it."""


def default_config() -> DictConfig:
    """The schema's defaults as a struct-mode OmegaConf tree (unknown keys are refused)."""
    cfg = OmegaConf.structured(MeshRLConfig)
    OmegaConf.set_struct(cfg, True)
    return cfg


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


def suggest(bad_key: str, cfg: DictConfig, limit: int = 3) -> list[str]:
    """Valid keys close to ``bad_key``: same leaf name elsewhere in the tree first, then spelling."""
    keys = all_keys(cfg)
    leaf = bad_key.rsplit(".", 1)[-1]
    same_leaf = [k for k in keys if k.rsplit(".", 1)[-1] == leaf]
    close = difflib.get_close_matches(bad_key, keys, n=limit, cutoff=0.6)
    by_leaf = [k for k in keys if difflib.SequenceMatcher(None, k.rsplit(".", 1)[-1], leaf).ratio() > 0.8]
    out: list[str] = []
    for key in same_leaf + close + by_leaf:
        if key not in out and key != bad_key:
            out.append(key)
    return out[:limit]


def _unknown_key_error(bad_key: str, cfg: DictConfig, source: str) -> ConfigError:
    hint = suggest(bad_key, cfg)
    did_you_mean = f" Did you mean: {', '.join(hint)}?" if hint else ""
    return ConfigError(f"unknown config key '{bad_key}' (from {source}).{did_you_mean}")


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


def _set(cfg: DictConfig, key: str, value: object, source: str) -> None:
    free_form = _is_free_form(cfg, key)
    if not free_form and OmegaConf.select(cfg, key, default=_ABSENT) is _ABSENT:
        raise _unknown_key_error(key, cfg, source)
    try:
        OmegaConf.update(cfg, key, value, merge=True, force_add=free_form)
    except ConfigKeyError as exc:
        raise _unknown_key_error(getattr(exc, "full_key", key) or key, cfg, source) from None
    except ValidationError as exc:
        expected = _expected_type(cfg, key)
        raise ConfigError(f"config key '{key}' (from {source}): {str(exc).splitlines()[0]}; "
                          f"expected {expected}.") from None


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
    key, sep, raw = item.lstrip("+").partition("=")
    if not sep or not key:
        raise ConfigError(f"override '{item}' is not of the form key=value "
                          "(e.g. algorithm.adv_estimator=grpo).")
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"override '{item}': the value is not valid YAML ({exc}).") from None
    return key.strip(), value


def resolve_recipe(name: str | Path, relative_to: Path | None = None) -> Path:
    """A recipe name or path → an existing YAML file."""
    candidates = [Path(name)]
    stem = str(name) if str(name).endswith((".yaml", ".yml")) else f"{name}.yaml"
    if relative_to is not None:
        candidates.append(relative_to / stem)
    candidates.append(RECIPES_DIR / stem)
    for path in candidates:
        if path.is_file():
            return path
    known = sorted(p.stem for p in RECIPES_DIR.glob("*.yaml")) if RECIPES_DIR.is_dir() else []
    close = difflib.get_close_matches(Path(stem).stem, known, n=3)
    hint = f" Did you mean: {', '.join(close)}?" if close else f" Known recipes: {', '.join(known)}."
    raise ConfigError(f"recipe '{name}' not found (looked in {', '.join(str(c) for c in candidates)}).{hint}")


def _apply_recipe(cfg: DictConfig, path: Path, seen: tuple[Path, ...] = ()) -> None:
    if path in seen:
        raise ConfigError(f"recipe defaults form a cycle: {' -> '.join(map(str, seen + (path,)))}")
    try:
        tree = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"recipe {path} is not valid YAML: {exc}") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"recipe {path} must be a mapping of sections, got {type(tree).__name__}")
    for parent in tree.pop("defaults", []) or []:
        _apply_recipe(cfg, resolve_recipe(parent, path.parent), seen + (path,))
    for key, value in _flatten(tree):
        _set(cfg, key, value, source=str(path))


def load_config(overrides: Sequence[str] = (), recipe: str | Path | None = None) -> DictConfig:
    """Defaults ← recipe ← overrides, checked key by key and type by type (see module docstring)."""
    cfg = default_config()
    if recipe is not None:
        _apply_recipe(cfg, resolve_recipe(recipe))
    for item in overrides:
        key, value = parse_override(item)
        _set(cfg, key, value, source=f"override '{item}'")
    try:
        OmegaConf.resolve(cfg)
    except OmegaConfBaseException as exc:
        raise ConfigError(f"config interpolation failed: {exc}") from None
    return cfg
