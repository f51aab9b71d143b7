"""Name → function registries for advantage estimators, policy losses and KL penalty types.

Built-ins register themselves with a decorator::

    @register_advantage("grpo")
    def grpo(token_rewards, response_mask, *, uid, ...): ...

A config value may also name any importable function as ``"package.module:function"``, so users add
an estimator, a loss or a KL type without editing meshrl. Unknown names raise ValueError listing the
registered ones, with a did-you-mean.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
from collections.abc import Callable
from typing import Any, Generic, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


class Registry(Generic[F]):
    """Functions of one kind (`kind` is used in error messages), by name."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._functions: dict[str, F] = {}

    def register(self, *names: str) -> Callable[[F], F]:
        """Decorator registering a function under one or more names (aliases such as "k3", "low_var_kl")."""

        def decorator(fn: F) -> F:
            for name in names:
                existing = self._functions.get(name)
                if existing is not None and existing is not fn:
                    raise ValueError(
                        f"{self.kind} {name!r} is already registered to "
                        f"{existing.__module__}.{existing.__qualname__}"
                    )
                self._functions[name] = fn
            return fn

        return decorator

    def names(self) -> list[str]:
        return sorted(self._functions)

    def get(self, name: str) -> F:
        """The function registered as `name`, or the one a ``"module.path:function"`` string points to."""
        fn = self._functions.get(name)
        if fn is not None:
            return fn
        if ":" in name:
            return self._import(name)
        close = difflib.get_close_matches(name, self.names(), n=3, cutoff=0.5)
        hint = f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
        raise ValueError(
            f"unknown {self.kind} {name!r}.{hint} Available: {', '.join(self.names())}; "
            "or give your own as 'package.module:function'."
        )

    def _import(self, path: str) -> F:
        module_name, _, attribute = path.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as error:
            raise ValueError(f"{self.kind} {path!r}: cannot import module {module_name!r} ({error})") from error
        fn = getattr(module, attribute, None)
        if fn is None:
            public = [n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n))]
            close = difflib.get_close_matches(attribute, public, n=3, cutoff=0.6)
            hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
            raise ValueError(f"{self.kind} {path!r}: module {module_name!r} has no attribute {attribute!r}{hint}")
        if not callable(fn):
            raise ValueError(f"{self.kind} {path!r} is not callable")
        return fn


ADVANTAGE_ESTIMATORS: Registry[Callable[..., Any]] = Registry("advantage estimator")
POLICY_LOSSES: Registry[Callable[..., Any]] = Registry("policy loss")
KL_PENALTIES: Registry[Callable[..., Any]] = Registry("KL penalty type")

register_advantage = ADVANTAGE_ESTIMATORS.register
register_policy_loss = POLICY_LOSSES.register
register_kl_penalty = KL_PENALTIES.register


def call_with_available(fn: Callable[..., Any], *args: Any, **available: Any) -> Any:
    """Call `fn(*args, **kw)` with the subset of `available` that its signature names.

    The trainer holds one set of batch tensors (uid, values, greedy_scores, ...) and config options
    (gamma, clip_ratio_low, ...) shared by all methods; each method takes only what it declares. A
    keyword parameter without a default that is not available raises ValueError naming it.
    """
    signature = inspect.signature(fn)
    parameters = signature.parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return fn(*args, **available)
    keyword = {name: value for name, value in available.items() if name in parameters}
    positional = list(parameters.values())[len(args) :]
    missing = [
        p.name
        for p in positional
        if p.default is inspect.Parameter.empty
        and p.kind in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        and p.name not in keyword
    ]
    if missing:
        name = getattr(fn, "__qualname__", repr(fn))
        raise ValueError(f"{name} needs {', '.join(missing)}; available: {', '.join(sorted(available)) or 'none'}")
    return fn(*args, **keyword)
