"""Client for SandboxFusion's ``/run_code`` API (a SandboxFusion deployment or meshrl's local server),
and code scoring against test cases with verl's semantics (``verl.utils.reward_score.sandbox_fusion``).

Scoring contract (:func:`compute_score`), as verl's: the code is the last fenced ```` ```python ````
block of the completion, else the first fenced block (a one-word language line dropped); a completion
with no fenced block scores 0. ``test_cases`` (a dict or its JSON) holds ``inputs``/``outputs`` (stdin
and the expected stdout, compared with trailing newlines stripped; an expected ``None`` passes on a
clean exit) and optionally ``assert_case`` (one snippet per case appended to the code, HumanEval
style: inputs/outputs then default to ``""``/``None``). Each case is one run; its result is ``True``
(passed), ``False`` (wrong answer), or an error code: ``-1`` API/sandbox error, ``-2`` runtime error,
``-3`` time limit. score = passed cases / cases, or over the first 10 cases when ``continuous``.
Returns ``(score, metadata)``, one metadata dict per case with ``status`` (``success``,
``wrong_answer``, ``runtime_error``, ``timeout``, ``api_error``, ``sandbox_error``) and the sandbox's
``reason`` (e.g. ``output_limit``), so failures are data the trainer can count. A sandbox that does not
answer after the retries is not data: :class:`SandboxUnreachable` (naming the URL) propagates, so a run
whose sandbox went down stops with that message instead of training on zeros.

Concurrency: the cases of one completion run on threads, and ``concurrent_semaphore`` (verl's argument,
``reward_model.sandbox_fusion.max_concurrent`` slots shared by every reward process) bounds the requests
in flight across all of them; without one, at most ``MAX_CASE_THREADS`` per completion.

Function-call cases (LeetCode-style sets: ``fn_name`` in the test cases), as verl runs them: the code runs
inside a harness (:func:`function_call_program`) with the standard modules a solution may assume imported
(``math``, ``collections``, ``typing``, ... and their names); each stdin line is one JSON argument; the
harness calls the global function ``fn_name``, else that method of a ``Solution()`` instance, and prints the
result (JSON for None, bools, lists, tuples and dicts, else ``str``), which is compared as stdout. Where
verl's harness prints nothing on an exception (a wrong answer), this one lets it end the program (a
runtime error with its traceback): the score is the same. A blank line ends the arguments (verl would
fail a case whose stdin ends with a newline on the empty line).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import time
import urllib.error
import urllib.request

# Seconds added to compile + run timeouts for the HTTP round trip (verl: API_TIMEOUT = 10).
API_TIMEOUT_S = 10.0
CONTINUOUS_CASES = 10
# What a LeetCode-style solution may use without importing it (the modules verl's harness imports).
HARNESS_MODULES = ("string", "re", "datetime", "collections", "heapq", "bisect", "copy", "math", "random",
                   "statistics", "itertools", "functools", "operator", "io", "sys", "json", "typing")
MAX_CASE_THREADS = 32


class SandboxUnreachable(ConnectionError):
    """No answer from the sandbox at a URL after the retries."""


def run_code(url: str, code: str, *, run_timeout: float = 10, memory_limit_mb: int = 1024, stdin: str | None = None,
             compile_timeout: float = 10, retries: int = 3, retry_delay_s: float = 0.5) -> dict:
    """POST one program to ``url`` (the full ``.../run_code`` address, as verl's
    ``reward_model.sandbox_fusion.url``) and return SandboxFusion's response JSON.

    Connection errors and HTTP 502/503/504 are retried ``retries`` times with a linearly growing delay;
    then :class:`SandboxUnreachable` names the URL. Other HTTP errors raise at once (a 400 carries the
    server's reason)."""
    payload = json.dumps({"code": code, "language": "python", "run_timeout": run_timeout,
                          "compile_timeout": compile_timeout, "memory_limit_MB": memory_limit_mb,
                          "stdin": stdin, "files": {}, "fetch_files": []}).encode()
    request = urllib.request.Request(url, data=payload, method="POST",
                                     headers={"Content-Type": "application/json", "Accept": "application/json"})
    last: Exception | None = None
    for attempt in range(retries + 1):
        if attempt:
            time.sleep(retry_delay_s * attempt)
        try:
            with urllib.request.urlopen(request, timeout=compile_timeout + run_timeout + API_TIMEOUT_S) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            if exc.code not in (502, 503, 504):
                detail = exc.read().decode(errors="replace")[:500]
                raise RuntimeError(f"sandbox at {url} refused the request: HTTP {exc.code} {detail}") from None
            last = exc
        except (urllib.error.URLError, ConnectionError, TimeoutError) as exc:
            last = exc
    raise SandboxUnreachable(f"sandbox at {url} is unreachable after {retries + 1} tries ({last}); start one with "
                             "`python -m meshrl.rewards.sandbox serve --port 0` or check "
                             "reward_model.sandbox_fusion.url")


def extract_code(completion: str) -> str | None:
    """The program in a completion (see the module docstring), or None when it has no fenced block."""
    if "```python" in completion:
        return completion.split("```python")[-1].split("```")[0]
    parts = completion.split("```")
    if len(parts) < 2:
        return None
    block = parts[1]
    first, sep, rest = block.partition("\n")
    return rest if sep and first.strip().isalpha() else block


def _case_result(response: dict, expected) -> tuple[bool | int, str]:
    """verl's per-case verdict from one SandboxFusion response."""
    run = response.get("run_result") or {}
    api_status = response.get("status")
    if api_status == "Success" and run.get("status") == "Finished":
        passed = expected is None or str(run.get("stdout") or "").rstrip("\n") == str(expected).rstrip("\n")
        return (True, "success") if passed else (False, "wrong_answer")
    if api_status == "Failed" and run:
        if run.get("status") == "TimeLimitExceeded":
            return -3, "timeout"
        return -2, "runtime_error"
    return -1, "sandbox_error"


def check_case(url: str, code: str, stdin, expected, *, timeout: float, memory_limit_mb: int,
               concurrent_semaphore=None) -> tuple[bool | int, dict]:
    """Run one case (holding a slot of ``concurrent_semaphore`` while the request is in flight). A request the
    sandbox refuses is case result ``-1``; an unreachable sandbox raises :class:`SandboxUnreachable`."""
    meta = {"input": stdin, "expected_output": None if expected is None else str(expected)}
    try:
        with concurrent_semaphore if concurrent_semaphore is not None else contextlib.nullcontext():
            response = run_code(url, code, run_timeout=timeout, compile_timeout=timeout,
                                memory_limit_mb=memory_limit_mb, stdin=None if stdin is None else str(stdin))
    except RuntimeError as exc:
        return -1, {**meta, "status": "api_error", "api_request_error": str(exc)}
    result, status = _case_result(response, expected)
    run = response.get("run_result") or {}
    return result, {**meta, "status": status, "api_status": response.get("status"), "run_status": run.get("status"),
                    "reason": response.get("message") or None, "stdout": run.get("stdout"),
                    "stderr": run.get("stderr"), "exit_code": run.get("return_code"),
                    "duration": run.get("execution_time")}


def function_call_program(code: str, fn_name: str) -> str:
    """``code`` inside the function-call harness for ``fn_name`` (module docstring)."""
    imports = "\n".join(f"import {m}\nfrom {m} import *" for m in HARNESS_MODULES)
    return f"""{imports}

{code}

def _meshrl_call(name):
    lines = sys.stdin.read().split("\\n")
    if "" in lines:
        lines = lines[:lines.index("")]
    args = [json.loads(line) for line in lines]
    target = globals().get(name)
    if target is None and "Solution" in globals():
        target = getattr(globals()["Solution"](), name)
    if target is None:
        raise NameError(f"function or method {{name!r}} not found")
    result = target(*args)
    print(json.dumps(result) if result is None or isinstance(result, (bool, list, tuple, dict)) else result)


_meshrl_call({fn_name!r})
"""


def compute_score(url: str, completion: str, test_cases, *, continuous: bool = False, timeout: float = 10,
                  memory_limit_mb: int = 1024, concurrent_semaphore=None) -> tuple[float, list[dict]]:
    """Score a completion against its test cases (contract in the module docstring)."""
    code = extract_code(completion)
    if code is None:
        return 0.0, [{"status": "no_code", "error": "Invalid completion (missing code block)"}]
    cases = json.loads(test_cases) if isinstance(test_cases, (str, bytes)) else dict(test_cases)
    asserts = cases.get("assert_case")
    if isinstance(asserts, list):
        cases.setdefault("inputs", [""] * len(asserts))
        cases.setdefault("outputs", [None] * len(asserts))
    else:
        asserts = [""] * len(cases.get("inputs") or [])
    inputs, outputs = cases.get("inputs"), cases.get("outputs")
    if inputs is None or outputs is None or not len(inputs) == len(outputs) == len(asserts):
        raise ValueError(f"test_cases need inputs and outputs of one length (and assert_case, if given, too); got "
                         f"keys {sorted(cases)} with lengths "
                         f"{[len(v) for v in (inputs or [], outputs or [], asserts)]}")
    if not inputs:
        return 0.0, []
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(len(inputs), MAX_CASE_THREADS)) as pool:
        fn_name = cases.get("fn_name")
        programs = [code + "\n\n" + a for a in asserts]
        if fn_name:
            programs = [function_call_program(program, fn_name) for program in programs]
        futures = [pool.submit(check_case, url, program, i, o, timeout=timeout,
                               memory_limit_mb=memory_limit_mb, concurrent_semaphore=concurrent_semaphore)
                   for program, i, o in zip(programs, inputs, outputs)]
        results = [f.result() for f in futures]
    verdicts = [r for r, _ in results]
    metadata = [{"case_index": k, **m} for k, (_, m) in enumerate(results)]
    considered = verdicts[:CONTINUOUS_CASES] if continuous else verdicts
    return sum(v is True for v in considered) / len(considered), metadata
