"""Which config keys code reads, each by its full dotted path (``tests/foundation/test_key_policy.py`` checks
that meshrl reads every key it does not refuse or warn about).

``recording()`` is a context manager: while it is active, every value that code outside omegaconf reads from a
*tracked* config tree is recorded under the full dotted path of its key, with the function that read it. A read
is an attribute (``cfg.trainer.seed``), ``cfg[key]``, ``cfg.get(key)``, ``OmegaConf.select(cfg, "a.b")`` or an
iteration over a section's values (``items()``, ``values()``, ``dict(section)``: each key is handed to the caller).
A section read on the way to a leaf (``cfg.trainer``) is recorded too, under its own path.

- Only trees handed to ``ConfigReads.track`` are recorded: a run's config (paths from its root), or a role's
  section rebuilt from plain containers, as a worker rebuilds it (``OmegaConf.create(section)``, whose paths start
  below the section: ``track(section, prefix="critic")`` puts them back under it). Reads of other trees (the
  schema's defaults a check compares with) are not reads of the run's keys.
- omegaconf's own reads (a merge, ``OmegaConf.to_container``) are not recorded: a bulk copy consumes no key in
  particular. Values copied into a plain dict and read from it as a dict are recorded through
  ``ConfigReads.track_dict``.
- The reader is ``module.qualname`` of the calling function (past ``collections.abc``'s mapping methods), so that
  a caller can tell a consumer from a walk that reads every key (``meshrl.config.key_policy`` compares each key
  with its default).

DictConfig and OmegaConf are patched only while ``recording()`` is active, and restored when it ends.
"""

from __future__ import annotations

import contextlib
import sys
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping
from types import FrameType
from typing import Any

from omegaconf import DictConfig, OmegaConf

_ACTIVE: ConfigReads | None = None
# Mapping's mixin methods (values(), ...), which read a section for their caller
_PASS_THROUGH = ("_collections_abc",)


def _reader(frame: FrameType) -> str | None:
    """``module.qualname`` of the function that ``frame`` (a read's caller) reads for; None: omegaconf itself."""
    while frame.f_globals.get("__name__") in _PASS_THROUGH:
        frame = frame.f_back
    module = frame.f_globals.get("__name__", "")
    return None if module.split(".")[0] == "omegaconf" else f"{module}.{frame.f_code.co_qualname}"


class ConfigReads:
    """The reads of tracked trees: ``paths[full dotted key]`` is the set of functions that read it."""

    def __init__(self) -> None:
        self.paths: defaultdict[str, set[str]] = defaultdict(set)
        self._roots: dict[int, tuple[DictConfig, str]] = {}  # id(root) -> (root, prefix); the root kept alive

    def track(self, cfg: DictConfig, prefix: str = "") -> DictConfig:
        """Record reads of ``cfg``'s tree, their paths under ``prefix`` (the dotted key of a section rebuilt on its
        own); returns ``cfg``."""
        root = cfg._get_root()
        self._roots[id(root)] = (root, prefix)
        return cfg

    def track_dict(self, values: Mapping[str, Any], prefix: str) -> dict[str, Any]:
        """A copy of ``values`` (a section's values as a plain dict) whose ``[key]`` and ``get(key)`` are recorded
        as reads of ``prefix.key``."""
        return _RecordedDict(self, prefix, values)

    def _record(self, node: DictConfig, keys: list[str], caller: FrameType) -> None:
        tracked = self._roots.get(id(node._get_root()))
        reader = _reader(caller) if tracked is not None else None
        if reader is None:
            return
        for key in keys:
            path = node._get_full_key(key)
            self.paths[f"{tracked[1]}.{path}" if tracked[1] else path].add(reader)


class _RecordedDict(dict):
    """``ConfigReads.track_dict``'s copy: a plain dict whose key reads are recorded under a section's path."""

    def __init__(self, reads: ConfigReads, prefix: str, values: Mapping[str, Any]) -> None:
        super().__init__(values)
        self._reads, self._prefix = reads, prefix

    def _note(self, key: str) -> None:
        reader = _reader(sys._getframe(2))
        if reader is not None:
            self._reads.paths[f"{self._prefix}.{key}"].add(reader)

    def __getitem__(self, key: str) -> Any:
        value = super().__getitem__(key)
        self._note(key)
        return value

    def get(self, key: str, default: Any = None) -> Any:
        value = super().get(key, default)
        self._note(key)
        return value


@contextlib.contextmanager
def recording() -> Iterator[ConfigReads]:
    """Record the reads of the trees the yielded ``ConfigReads`` tracks until the block ends (one at a time)."""
    global _ACTIVE
    if _ACTIVE is not None:
        raise RuntimeError("config reads are already being recorded")
    reads = _ACTIVE = ConfigReads()
    originals = {name: DictConfig.__dict__[name] for name in ("__getattr__", "__getitem__", "get", "items")}
    select = OmegaConf.__dict__["select"]

    def one_key(original: Callable[..., Any]) -> Callable[..., Any]:
        def read(self: DictConfig, key: Any, *args: Any, **kwargs: Any) -> Any:
            value = original(self, key, *args, **kwargs)
            if isinstance(key, str):
                reads._record(self, [key], sys._getframe(1))
            return value
        return read

    def items(self: DictConfig) -> Any:
        view = originals["items"](self)
        reads._record(self, [str(key) for key, _ in view], sys._getframe(1))
        return view

    def recorded_select(cfg: Any, key: str, *args: Any, **kwargs: Any) -> Any:
        value = select.__func__(cfg, key, *args, **kwargs)
        if isinstance(cfg, DictConfig):
            reads._record(cfg, [key], sys._getframe(1))
        return value

    for name in ("__getattr__", "__getitem__", "get"):
        setattr(DictConfig, name, one_key(originals[name]))
    DictConfig.items = items
    OmegaConf.select = staticmethod(recorded_select)
    try:
        yield reads
    finally:
        for name, original in originals.items():
            setattr(DictConfig, name, original)
        OmegaConf.select = select
        _ACTIVE = None
