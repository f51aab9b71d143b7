"""A local HTTP server speaking SandboxFusion's ``POST /run_code`` API for ``language=python``, and
:func:`local_sandbox`, which starts one as a subprocess and stops it.

Request (JSON, SandboxFusion's field names): ``code`` (required), ``language`` (``python`` only; any
other is refused with HTTP 400), ``run_timeout`` (seconds, default 10), ``memory_limit_MB`` (default and
``-1``: the server's ``--memory-limit-mb``), ``stdin``, ``files`` (relative path -> base64 content,
written beside the program), ``compile_timeout`` (accepted: Python has no compile step, as in
SandboxFusion), ``fetch_files`` (must be empty: refused otherwise).

Response: ``{"status": "Success" | "Failed" | "SandboxError", "message", "compile_result": null,
"run_result": {"status": "Finished" | "TimeLimitExceeded" | "Error", "execution_time", "return_code",
"stdout", "stderr"}, "executor_pod_name": null, "files": {}}``; ``Success`` when the program exited 0,
``Failed`` otherwise, ``message`` naming why (``timeout``, ``cpu_time``, ``output_limit``,
``exit:<code>``, ``signal:<name>``), ``SandboxError`` when the jail could not start it.
``GET /health`` answers ``{"status": "ok", "max_concurrent", "isolation"}``.

At most ``max_concurrent`` programs run at once (one jail slot each); further requests wait for a slot.
"""

from __future__ import annotations

import base64
import binascii
import concurrent.futures
import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from meshrl.rewards.sandbox.limits import Jail, Limits, RunResult, isolation_report

_REASON_TEXT = {
    "timeout": "wall time limit (run_timeout) exceeded",
    "cpu_time": "CPU time limit exceeded",
    "output_limit": "output limit exceeded: the program was killed",
    "sandbox_error": "the sandbox could not start the program",
}


class BadRequest(ValueError):
    """A request the server refuses (HTTP 400), with what to send instead."""


def parse_request(body: bytes, default_memory_mb: int) -> tuple[str, Limits, str | None, dict[str, bytes]]:
    """(code, limits, stdin, files) from a ``/run_code`` body, or :class:`BadRequest`."""
    try:
        req = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadRequest(f"body is not JSON: {exc}") from None
    if not isinstance(req, dict) or not isinstance(req.get("code"), str):
        raise BadRequest("body must be a JSON object with a string field 'code'")
    language = req.get("language", "python")
    if language != "python":
        raise BadRequest(f"language {language!r} is not supported by meshrl's local sandbox (python only); "
                         "point reward_model.sandbox_fusion.url at a SandboxFusion server for other languages")
    if req.get("fetch_files"):
        raise BadRequest("fetch_files is not supported by meshrl's local sandbox; print what you need to stdout")
    stdin = req.get("stdin")
    if stdin is not None and not isinstance(stdin, str):
        raise BadRequest(f"stdin must be a string or null, got {type(stdin).__name__}")
    memory = req.get("memory_limit_MB", -1)
    try:
        files = {path: base64.b64decode(data, validate=True) for path, data in (req.get("files") or {}).items()}
        limits = Limits(run_timeout_s=float(req.get("run_timeout", 10)),
                        memory_mb=default_memory_mb if memory in (-1, None) else int(memory))
    except (ValueError, TypeError, AttributeError, binascii.Error) as exc:
        raise BadRequest(f"bad run_timeout / memory_limit_MB / files: {exc}") from None
    return req["code"], limits, stdin, files


def response_for(result: RunResult) -> dict:
    """SandboxFusion's response for one run (see the module docstring)."""
    if result.reason == "sandbox_error":
        status = "SandboxError"
    else:
        status = "Success" if result.status == "Finished" and result.return_code == 0 else "Failed"
    message = ("" if result.reason is None
               else f"{result.reason}: {_REASON_TEXT.get(result.reason, 'the program failed')}")
    return {"status": status, "message": message, "compile_result": None,
            "run_result": {"status": result.status, "execution_time": result.execution_time,
                           "return_code": result.return_code, "stdout": result.stdout, "stderr": result.stderr},
            "executor_pod_name": None, "files": {}}


class SandboxServer(ThreadingHTTPServer):
    """HTTP server whose requests run on a bounded thread pool; programs on ``max_concurrent`` slots."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], max_concurrent: int, memory_limit_mb: int = 1024,
                 python: str | None = None):
        self.jail = Jail(max_concurrent, python=python)
        self.max_concurrent = max_concurrent
        self.memory_limit_mb = memory_limit_mb
        self.isolation = isolation_report()
        # Waiting requests hold a pool thread each; a few more than the slots keeps /health answering.
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=max_concurrent + 4,
                                                           thread_name_prefix="sandbox")
        super().__init__(address, _Handler)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}/run_code"

    def process_request(self, request, client_address):
        self._pool.submit(self._handle, request, client_address)

    def _handle(self, request, client_address):
        try:
            self.finish_request(request, client_address)
        except Exception:  # noqa: BLE001 - http.server's own policy: report and keep serving
            self.handle_error(request, client_address)
        finally:
            self.shutdown_request(request)

    def server_close(self):
        super().server_close()
        self._pool.shutdown(wait=True)  # in-flight runs finish (each bounded by its run_timeout)
        self.jail.close()


class _Handler(BaseHTTPRequestHandler):
    server: SandboxServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format, *args):  # noqa: A002 - http.server's signature; one line per request is noise
        pass

    def _send(self, code: int, payload: dict):
        body = json.dumps(payload).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):  # noqa: N802 - http.server's naming
        if self.path.rstrip("/") == "/health":
            self._send(200, {"status": "ok", "max_concurrent": self.server.max_concurrent,
                             "isolation": self.server.isolation})
        else:
            self._send(404, {"detail": f"no GET {self.path}; POST /run_code or GET /health"})

    def do_POST(self):  # noqa: N802
        if self.path.rstrip("/") != "/run_code":
            self._send(404, {"detail": f"no POST {self.path}; POST /run_code"})
            return
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        try:
            code, limits, stdin, files = parse_request(body, self.server.memory_limit_mb)
            result = self.server.jail.run(code, limits, stdin=stdin, files=files)
        except (BadRequest, ValueError) as exc:  # ValueError: a file path outside the run's directory
            self._send(HTTPStatus.BAD_REQUEST, {"detail": str(exc)})
            return
        self._send(200, response_for(result))


def serve(host: str, port: int, max_concurrent: int, memory_limit_mb: int, python: str | None) -> None:
    """Serve until SIGTERM/SIGINT; prints ``meshrl sandbox: <url>`` (flushed) once listening."""
    server = SandboxServer((host, port), max_concurrent, memory_limit_mb, python)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    thread = threading.Thread(target=server.serve_forever, name="sandbox-http", daemon=True)
    thread.start()
    print(f"meshrl sandbox: {server.url}", flush=True)
    stop.wait()
    server.shutdown()
    server.server_close()


@contextlib.contextmanager
def local_sandbox(max_concurrent: int = 4, memory_limit_mb: int = 1024, start_timeout_s: float = 30.0,
                  python: str | None = None) -> Iterator[str]:
    """Start ``python -m meshrl.rewards.sandbox serve --port 0`` and yield its ``/run_code`` URL; on exit
    stop it (SIGTERM, then SIGKILL of its process group after 30 s) so nothing is left behind."""
    cmd = [sys.executable, "-m", "meshrl.rewards.sandbox", "serve", "--host", "127.0.0.1", "--port", "0",
           "--max-concurrent", str(max_concurrent), "--memory-limit-mb", str(memory_limit_mb)]
    if python is not None:
        cmd += ["--python", python]
    # stderr is inherited: the server writes there only on failure, and an unread pipe could block it.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], start_timeout_s)
        line = proc.stdout.readline() if ready else ""
        if not line.startswith("meshrl sandbox: "):
            raise RuntimeError(f"the local sandbox did not start within {start_timeout_s:.0f} s "
                               f"(command: {' '.join(cmd)}); its error is on stderr above")
        yield line.split(": ", 1)[1].strip()
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        proc.stdout.close()
