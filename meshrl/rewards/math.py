r"""MATH-style rule reward: the answer is the last ``\boxed{...}`` of the response.

Score = 1.0 when the boxed answer is mathematically equivalent to the ground truth, else 0.0 (also
0.0 when the response has no boxed answer). Equivalence is decided by ``math-verify`` (Hugging
Face's maintained checker: LaTeX/expression parsing into SymPy, then numeric, symbolic, set,
interval and matrix comparison). Only when math-verify raises, times out, or extracts nothing do we
fall back to equality of normalised strings; that is flagged in :class:`MathJudgement` so that the
caller can count it (the pool reports it as ``reward/math_verify_fallback``).

Timeouts: math-verify guards parsing and comparison with ``signal.alarm``, which only works in the
main thread of a process. :func:`judge` passes ``timeout_seconds`` through when it runs in the main
thread (the normal case, including reward-pool worker processes) and disables math-verify's timer in
any other thread, where the wall-clock guard must come from :class:`meshrl.rewards.pool.RewardPool`.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass

_BOX_COMMANDS = ("\\boxed", "\\fbox")


def last_boxed_content(text: str) -> str | None:
    r"""Content of the last ``\boxed{...}`` / ``\fbox{...}`` in ``text`` (braces balanced), or None.

    ``\boxed 5`` (no braces) yields the token after the space, up to whitespace or ``$``. Escaped
    braces ``\{`` ``\}`` do not count towards the balance. An unterminated last box yields None
    (an earlier, complete box is *not* used: the last one is the answer the model committed to).
    """
    start = max(text.rfind(cmd) for cmd in _BOX_COMMANDS)
    if start < 0:
        return None
    cmd = next(c for c in _BOX_COMMANDS if text.startswith(c, start))
    pos = start + len(cmd)
    if pos < len(text) and text[pos] == " ":
        token = re.match(r"\s*([^\s$]+)", text[pos:])
        return token.group(1) if token else None
    if pos >= len(text) or text[pos] != "{":
        return None
    depth = 0
    i = pos
    while i < len(text):
        ch = text[i]
        if ch == "\\":
            i += 2  # skip the escaped character (\{ and \} are literal braces)
            continue
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return text[pos + 1 : i]
        i += 1
    return None


_STRIP_PATTERNS = (
    (re.compile(r"\\left|\\right|\\!|\\,|\\;|\\:|\\ |\$"), ""),
    (re.compile(r"\\[dt]frac"), r"\\frac"),
    (re.compile(r"\^\{?\\circ\}?"), ""),
    (re.compile(r"\\text\{\s*([^{}]*?)\s*\}"), r"\1"),
    (re.compile(r"\s+"), ""),
)


def normalize_answer(answer: str) -> str:
    r"""Normalised string form used only as math-verify's fallback.

    Removes spacing commands, ``\left``/``\right``, dollar signs, degree marks, ``\text{}`` wrappers
    and whitespace; ``\dfrac``/``\tfrac`` become ``\frac``; a trailing period is dropped.
    """
    out = answer
    for pattern, repl in _STRIP_PATTERNS:
        out = pattern.sub(repl, out)
    return out.rstrip(".")


@dataclass(frozen=True)
class MathJudgement:
    """Outcome of :func:`judge`: the score, the extracted answer, and whether the fallback decided."""

    score: float
    prediction: str | None
    math_verify_fallback: bool


def _math_verify_equal(ground_truth: str, prediction: str, timeout_seconds: int | None) -> bool:
    """Equivalence by math-verify; raises when math-verify fails or cannot extract either side."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    # Both sides are wrapped in \boxed{} so math-verify reads them as LaTeX answers (it also accepts
    # plain expressions such as "1/2" through ExprExtractionConfig).
    config = (LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig())
    gold = parse(f"\\boxed{{{ground_truth}}}", config, parsing_timeout=timeout_seconds, raise_on_error=True)
    pred = parse(f"\\boxed{{{prediction}}}", config, parsing_timeout=timeout_seconds, raise_on_error=True)
    if not gold or not pred:
        raise ValueError("math-verify extracted nothing")
    return bool(verify(gold, pred, timeout_seconds=timeout_seconds, raise_on_error=True))


def judge(solution_str: str, ground_truth: str, *, timeout_seconds: int = 5) -> MathJudgement:
    """Score ``solution_str`` against ``ground_truth`` (see the module docstring for the rule)."""
    from math_verify.errors import TimeoutException

    prediction = last_boxed_content(solution_str)
    if prediction is None:
        return MathJudgement(0.0, None, False)
    in_main_thread = threading.current_thread() is threading.main_thread()
    try:
        equal = _math_verify_equal(str(ground_truth), prediction, timeout_seconds if in_main_thread else None)
        return MathJudgement(float(equal), prediction, False)
    except (Exception, TimeoutException):  # TimeoutException derives from BaseException
        equal = normalize_answer(prediction) == normalize_answer(str(ground_truth))
        return MathJudgement(float(equal), prediction, True)


def compute_score(solution_str: str, ground_truth: str, *, timeout_seconds: int = 5) -> float:
    r"""1.0 if the last ``\boxed{}`` of ``solution_str`` is equivalent to ``ground_truth``, else 0.0."""
    return judge(solution_str, ground_truth, timeout_seconds=timeout_seconds).score
