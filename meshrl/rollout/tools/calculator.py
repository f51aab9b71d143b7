"""A calculator tool: one arithmetic expression in, its value out (the GSM8K-with-calculator task's tool).

Arguments: ``{"expression": "<arithmetic>"}``. The expression is parsed with Python's ``ast`` and only
numbers, parentheses, unary ``+ -`` and binary ``+ - * / // % **`` are evaluated (no names, calls or
attributes: nothing else of Python is reachable). ``**`` with an exponent above 64 in magnitude or a base
above 10**12 is refused, so a call cannot spend seconds or gigabytes on one number. The value is written
as an integer when it is one (``7.0`` -> ``7``), else with up to 12 significant digits.
"""

from __future__ import annotations

import ast
import operator
from typing import Any, Mapping

from meshrl.rollout.tools.base import Tool

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_EXPONENT = 64
MAX_POWER_BASE = 10 ** 12
MAX_EXPRESSION_CHARS = 500


def evaluate(expression: str) -> float | int:
    """The value of an arithmetic ``expression`` (module docstring); ``ValueError`` saying why not."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"the expression is longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as error:
        raise ValueError(f"not an arithmetic expression: {error.msg}") from None
    return _eval(tree.body)


def _eval(node: ast.AST) -> float | int:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and (abs(right) > MAX_EXPONENT or abs(left) > MAX_POWER_BASE):
            raise ValueError(f"powers are limited to |base| <= 10**12 and |exponent| <= {MAX_EXPONENT}")
        try:
            return _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise ValueError("division by zero") from None
    raise ValueError(f"only numbers and + - * / // % ** are allowed, found {ast.unparse(node)!r}")


def format_number(value: float | int) -> str:
    if isinstance(value, complex):
        raise ValueError("the result is not a real number")
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return str(value) if isinstance(value, int) else f"{value:.12g}"


class CalculatorTool(Tool):
    """``{"expression": str}`` -> its value (module docstring)."""

    def call(self, arguments: dict[str, Any], create_kwargs: Mapping[str, Any]) -> str:
        expression = arguments.get("expression")
        if not isinstance(expression, str):
            raise ValueError("the arguments need 'expression', a string such as \"12 * (3 + 4)\"")
        return format_number(evaluate(expression))
