"""Code rewards: a response's program run against its row's test cases in a sandbox speaking SandboxFusion's
``/run_code`` API, and the sandbox a training run uses.

**Sources** (``CODE_SOURCES``, dispatched by :func:`meshrl.rewards.dispatch.default_compute_score`): the data
sources verl scores by running code (``codecontests``, ``apps``, ``codeforces``, ``taco``: PRIME's Eurus-2
sets) and HumanEval as ``python -m meshrl.data.code_tasks humaneval`` writes it (``HUMANEVAL_SOURCE``).

**Score** (:func:`compute_score`): verl's ``sandbox_fusion.compute_score`` with ``continuous=True``, as verl's
``default_compute_score`` calls it: the fraction of the first 10 test cases passed (all pass: 1.0; a problem
with one case, e.g. HumanEval's ``check(entry_point)``, scores 0 or 1); a response without a fenced code
block scores 0. Test cases are the row's ``reward_model.ground_truth``, JSON of ``inputs``/``outputs``
(stdin / expected stdout) and/or ``assert_case`` (see :mod:`meshrl.rewards.sandbox.client`).

**Failures are data**: the result is ``{"score", "reward_error"}``. ``reward_error`` is None when every case
ran to a verdict (passed, printed a wrong answer, or failed an assertion of the tests), else the reason of
the first case that did not (:func:`case_error`): ``no_code``, ``timeout`` (wall time), ``cpu_time``,
``memory`` (``MemoryError``), ``output_limit``, ``signal`` (killed by a signal) or ``runtime_error`` (any
other crash). The reward pool counts them per batch as ``reward/errors/<reason>``. A sandbox that fails is
not data about the program: one that does not answer (:class:`~meshrl.rewards.sandbox.SandboxUnreachable`),
cannot start the program (``sandbox_error``) or refuses the request (``api_error``) fails the call with an
error naming the URL (:class:`SandboxFailure` for the last two), and the pool stops the run after
``reward_model.max_failed_batches`` batches in which every call failed (e.g. a jail that cannot start any
program would otherwise train on all-zero scores).

**Case time limit**: verl gives each case 10 s (``CASE_TIMEOUT_S``); meshrl gives ``min(10 s, timeout_s / 2)``
(:func:`case_timeout`) where ``timeout_s`` is the reward pool's per-response limit, so that a looping
program is reported by the sandbox (``timeout``) before the pool kills the reward process for the response.

**Concurrency**: each reward process scores one response at a time and runs its test cases in parallel, all
under one semaphore of ``max_concurrent`` slots shared by the processes; a batch of one-test problems
(HumanEval) therefore runs at most ``reward_model.num_workers`` programs at once.

**The run's sandbox** (:func:`run_sandbox`): ``reward_model.sandbox_fusion.url`` when set (checked before the
run by :func:`check_sandbox`); when null and the run's data holds code sources, a local server
(:func:`meshrl.rewards.sandbox.local_sandbox`, ``max_concurrent`` slots, ``memory_limit_mb`` per program)
started for the run, its URL said once, and stopped when the run ends, however it ends.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from meshrl.rewards.sandbox import SandboxUnreachable, local_sandbox, run_code
from meshrl.rewards.sandbox import compute_score as sandbox_score

HUMANEVAL_SOURCE = "openai/openai_humaneval"
CODE_SOURCES = frozenset({"codecontests", "apps", "codeforces", "taco", HUMANEVAL_SOURCE})
CASE_TIMEOUT_S = 10.0  # verl's sandbox_fusion.compute_score default, per test case
ERROR_KEY = "reward_error"  # the pool counts this extra output as reward/errors/<reason>

# Case errors of the sandbox itself, not of the program (module docstring)
SANDBOX_FAILURES = ("sandbox_error", "api_error")

# The exception name on the last line of a Python traceback ("ValueError: ...", "pkg.Error").
_EXCEPTION = re.compile(r"^([A-Za-z_][\w.]*)(?::|$)")


class SandboxFailure(RuntimeError):
    """The sandbox at a URL could not run a program, or refused the request (the message names both)."""


def case_timeout(reward_timeout_s: float) -> float:
    """Seconds each test case may run: verl's 10 s, or half the pool's per-response limit when that is less."""
    return min(CASE_TIMEOUT_S, reward_timeout_s / 2)


def case_error(meta: Mapping[str, Any]) -> str | None:
    """The reason one case ran to no verdict (module docstring; ``SANDBOX_FAILURES`` too), or None for a pass or
    a wrong answer."""
    status = meta.get("status")
    if status in ("success", "wrong_answer"):
        return None
    if status == "no_code" or status in SANDBOX_FAILURES:
        return status
    # meshrl's local server names its reason first ("cpu_time: CPU time limit exceeded"); SandboxFusion does not
    reason = str(meta.get("reason") or "").split(":", 1)[0]
    if reason in ("cpu_time", "output_limit", "signal"):
        return reason
    if status == "timeout":
        return "timeout"
    lines = str(meta.get("stderr") or "").strip().splitlines()
    exception = _EXCEPTION.match(lines[-1]) if lines else None
    name = exception.group(1).rsplit(".", 1)[-1] if exception else ""
    if name == "AssertionError":  # the tests' assertion failed: a wrong answer, not a crash
        return None
    return "memory" if name == "MemoryError" else "runtime_error"


def compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info: Mapping[str, Any] | None = None,
                  *, sandbox_fusion_url: str, concurrent_semaphore=None, memory_limit_mb: int = 1024,
                  timeout: float = CASE_TIMEOUT_S) -> dict[str, Any]:
    """``{"score", "reward_error"}`` of one response (module docstring); ``verl``'s argument names.

    Raises:
        SandboxUnreachable: no answer from ``sandbox_fusion_url`` after the client's retries.
        SandboxFailure: the sandbox could not start the program or refused the request.
        ValueError: malformed test cases (the message names the keys it found).
    """
    score, metadata = sandbox_score(sandbox_fusion_url, solution_str, ground_truth, continuous=True, timeout=timeout,
                                    memory_limit_mb=memory_limit_mb, concurrent_semaphore=concurrent_semaphore)
    reasons = [case_error(meta) for meta in metadata]
    for meta, reason in zip(metadata, reasons):
        if reason in SANDBOX_FAILURES:
            detail = meta.get("api_request_error") or meta.get("reason") or str(meta.get("stderr") or "")[-300:]
            raise SandboxFailure(f"the sandbox at {sandbox_fusion_url} did not run the program ({reason}): {detail}")
    return {"score": score, ERROR_KEY: next(filter(None, reasons), None)}


def uses_code_sources(reward_sources: Iterable[str]) -> bool:
    """Whether any of these ``data.reward_fn_key`` values is scored by running code."""
    return not CODE_SOURCES.isdisjoint(reward_sources)


def check_sandbox(url: str) -> None:
    """Run ``print(...)`` at ``url``; a sandbox that does not answer or cannot run it raises ``ConnectionError``
    naming the URL (called before a run starts, so a down sandbox never costs a step)."""
    try:
        response = run_code(url, "print('meshrl sandbox check')", run_timeout=10, retries=1)
    except (SandboxUnreachable, RuntimeError) as exc:
        raise ConnectionError(str(exc)) from None
    stdout = str((response.get("run_result") or {}).get("stdout") or "")
    if response.get("status") != "Success" or stdout.strip() != "meshrl sandbox check":
        raise ConnectionError(f"sandbox at {url} answered but could not run print(): status "
                              f"{response.get('status')!r}, message {response.get('message')!r}")


@contextlib.contextmanager
def run_sandbox(url: str | None, *, needed: bool, max_concurrent: int, memory_limit_mb: int,
                say: Callable[[str], None] = print) -> Iterator[str | None]:
    """The sandbox URL for a run's code rewards: ``url`` when given; else, when ``needed`` (the data holds code
    sources), a local server started here (its URL said once through ``say``) and stopped on leaving,
    whatever ends the block; else None (no code to run)."""
    if url or not needed:
        yield url or None
        return
    with local_sandbox(max_concurrent=max_concurrent, memory_limit_mb=memory_limit_mb) as local:
        say(f"meshrl: code rewards run in a local sandbox at {local} (reward_model.sandbox_fusion.url is unset; "
            f"max_concurrent={max_concurrent}, memory_limit_mb={memory_limit_mb})")
        yield local
