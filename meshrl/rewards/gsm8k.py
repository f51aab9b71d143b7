"""GSM8K rule reward (verl semantics).

Extraction, after removing ``,`` and ``$`` from the candidate:
- ``strict``: the number after the *last* ``#### `` marker (the format the GSM8K instruction asks for);
- ``flexible``: the last number anywhere in the response.

Score: ``score`` (1.0) if the extracted answer equals the ground truth, ``format_score`` (default 0.0)
if an answer was extracted but is wrong, 0.0 if nothing could be extracted.

Equality is numeric (``Decimal``), so "18.00" matches "18"; verl compares strings, which scores that
response 0. Pass ``numeric=False`` for verl's exact string comparison.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Literal

# A number may carry thousands separators and a leading "$" (both stripped before comparing).
_NUMBER = r"-?\$?\s?\d[\d,]*(?:\.\d+)?"
_STRICT = re.compile(r"####\s*(" + _NUMBER + ")")
_FLEXIBLE = re.compile(_NUMBER)


def _clean(number: str) -> str:
    return number.replace(",", "").replace("$", "").replace(" ", "")


def extract_answer(text: str, method: Literal["strict", "flexible"] = "strict") -> str | None:
    """The answer in ``text`` by ``method`` (see the module docstring), or None if there is none."""
    if method == "strict":
        matches = _STRICT.findall(text)
    elif method == "flexible":
        matches = _FLEXIBLE.findall(text)
    else:
        raise ValueError(f"GSM8K extraction method must be 'strict' or 'flexible', got {method!r}")
    return _clean(matches[-1]) if matches else None


def _equal(answer: str, ground_truth: str, numeric: bool) -> bool:
    if not numeric:
        return answer == ground_truth
    try:
        return Decimal(answer) == Decimal(ground_truth)
    except InvalidOperation:
        return answer == ground_truth


def compute_score(
    solution_str: str,
    ground_truth: str,
    method: Literal["strict", "flexible"] = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
    numeric: bool = True,
) -> float:
    """``score`` if the extracted answer equals ``ground_truth``, ``format_score`` if wrong, 0.0 if absent."""
    answer = extract_answer(solution_str, method)
    if answer is None:
        return 0.0
    return score if _equal(answer, _clean(str(ground_truth)), numeric) else format_score
