"""verl's function tools (``rollout.multi_turn.function_tool_path``): plain Python functions made tools.

The file at ``function_tool_path`` is run as a module; every function in it decorated with
``@function_tool`` (this module's, with verl's forms) is one tool::

    from meshrl.rollout.tools.function import function_tool   # verl: from verl.tools.function_tool import ...

    @function_tool                       # the tool's name is the function's; or @function_tool("name")
    def add(a: int, b: int) -> int:
        '''Add two integers.

        Args:
            a: the first
            b: the second
        '''
        return a + b

As verl's: the OpenAI schema is inferred by ``transformers.utils.get_json_schema`` (a Google-style docstring
with an ``Args:`` entry and a type hint for every parameter; variadic parameters are refused), unless given
as ``schema=``; ``async def`` functions are awaited; the model's arguments are the keyword arguments; the
return value becomes the tool message: a string as is, a dict as JSON, a tuple ``(response, reward[,
metrics])`` the response with its step reward (``ToolAnswer``; None counts as 0.0), anything else ``str()``.
Refused at preflight, naming the file: a missing file, one that fails to run (its error), one that imports
verl's decorator (this module's is the same: change the import), one with no decorated function, and two
tools of one name (also across ``tool_config_path``). Calls run as other tools do (``ToolRunner``: 30 s
``timeout_s``, errors and timeouts as error text).
"""

from __future__ import annotations

import asyncio
import importlib.util
import inspect
import json
import sys
from pathlib import Path
from typing import Any, Callable, Mapping

from meshrl.rollout.tools.base import Tool, ToolAnswer, ToolConfigError, check_schema

KEY = "actor_rollout_ref.rollout.multi_turn.function_tool_path"
_MARK = "__meshrl_function_tool__"  # (name, schema or None) set on a decorated function


def function_tool(name: str | Callable | None = None, *, schema: Mapping[str, Any] | None = None):
    """Mark a function as a tool (module docstring): ``@function_tool``, ``@function_tool("name")`` or
    ``@function_tool(schema={...})``; returns the function unchanged."""
    def mark(fn: Callable, tool_name: str | None) -> Callable:
        setattr(fn, _MARK, (tool_name or fn.__name__, dict(schema) if schema is not None else None))
        return fn

    if callable(name):
        return mark(name, None)
    return lambda fn: mark(fn, name)


def _inferred_schema(fn: Callable, name: str) -> dict[str, Any]:
    from transformers.utils import get_json_schema

    variadic = [p.name for p in inspect.signature(fn).parameters.values()
                if p.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)]
    if variadic:
        raise ToolConfigError(f"function tool {name!r}: variadic parameter(s) {variadic} have no OpenAI schema; "
                              "name every parameter")
    try:
        raw = get_json_schema(fn)
    except Exception as error:  # noqa: BLE001 - transformers' docstring / type-hint errors, with their message
        raise ToolConfigError(f"function tool {name!r}: its schema cannot be inferred ({type(error).__name__}: "
                              f"{error}); give it a Google-style docstring with Args: and type hints, or "
                              "@function_tool(schema=...)") from None
    function = {key: raw["function"][key] for key in ("description", "parameters") if key in raw["function"]}
    return {"type": "function", "function": {"name": name, **function}}  # verl's schema keeps no "return"


class FunctionTool(Tool):
    """A decorated function as a tool (module docstring)."""

    def __init__(self, fn: Callable, schema: Mapping[str, Any]) -> None:
        super().__init__({}, schema)
        self.fn = fn

    def call(self, arguments: dict[str, Any], create_kwargs: Mapping[str, Any]) -> ToolAnswer:
        result = self.fn(**arguments)
        if inspect.isawaitable(result):  # an async def tool, on this runner thread's own loop
            result = asyncio.run(_awaited(result))
        return answer_of(result)


async def _awaited(awaitable: Any) -> Any:
    return await awaitable


def _text(value: Any) -> str:
    if isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False) if isinstance(value, dict) else str(value)


def answer_of(result: Any) -> ToolAnswer:
    """A function's return value as the tool message and reward (module docstring)."""
    if isinstance(result, tuple):
        if not 1 <= len(result) <= 3:
            raise TypeError(f"a function tool returns (response,), (response, reward) or (response, reward, "
                            f"metrics), got a tuple of {len(result)}")
        reward = result[1] if len(result) > 1 and result[1] is not None else 0.0
        return ToolAnswer(_text(result[0]), float(reward))
    return ToolAnswer(_text(result))


def load_function_tools(path: str | Path) -> list[FunctionTool]:
    """The tools of a ``function_tool_path`` file, built (module docstring)."""
    path = Path(path).expanduser().resolve()
    try:
        return _load(path)
    except ToolConfigError as error:  # every problem names the key and the file
        raise ToolConfigError(f"{KEY}={path}: {error}") from None


def _load(path: Path) -> list[FunctionTool]:
    if not path.is_file():
        raise ToolConfigError("no such file")
    module_name = "_meshrl_function_tools_" + "".join(c if c.isalnum() else "_" for c in str(path))
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # the file may import its siblings through it, as in verl
    try:
        spec.loader.exec_module(module)
    except ModuleNotFoundError as error:
        sys.modules.pop(module_name, None)
        if (error.name or "").split(".")[0] == "verl":
            raise ToolConfigError(f"it imports {error.name}; meshrl's function_tool decorator is the same as verl's: "
                                  "`from meshrl.rollout.tools.function import function_tool`") from None
        raise ToolConfigError(f"the file failed to run: ModuleNotFoundError: {error}") from None
    except Exception as error:  # noqa: BLE001 - the user's file failing is reported with its cause
        sys.modules.pop(module_name, None)
        raise ToolConfigError(f"the file failed to run: {type(error).__name__}: {error}") from None
    functions = list({id(fn): fn for fn in vars(module).values() if callable(fn) and hasattr(fn, _MARK)}.values())
    if not functions:
        raise ToolConfigError("it defines no function decorated with meshrl.rollout.tools.function.function_tool")
    tools = []
    for fn in functions:
        name, schema = getattr(fn, _MARK)
        schema = check_schema(schema, f"@function_tool {name!r} schema") if schema is not None \
            else _inferred_schema(fn, name)
        tools.append(FunctionTool(fn, schema))
    names = [tool.name for tool in tools]
    if duplicates := sorted({name for name in names if names.count(name) > 1}):
        raise ToolConfigError(f"tool name(s) {duplicates} are given to more than one function")
    return tools
