"""Run one untrusted Python program in an isolated child process, with limits, and clean up after it.

What each run gets (Linux; built by ``_jail.py`` from OS facilities, no hand-rolled tricks):

- **Its own temporary directory**, ``<root>/run-XXXX``, owned by the run's uid, the working directory
  and ``HOME``/``TMPDIR``; removed after the run, whatever the program left in it.
- **No network**: a new network namespace (only a loopback device, down), so ``connect`` fails even to
  127.0.0.1; from Landlock ABI 4 TCP bind/connect are also denied by Landlock.
- **A new pid namespace** with the program as its pid 1: no process outside it can be named (``getppid()``
  is 0, ``kill(pid)`` of an outside pid is ``ESRCH``), and when pid 1 dies the kernel kills every
  process left in the namespace, so a fork bomb's survivors, daemons and ``setsid`` children all go.
- **Another uid** (as root: one uid per concurrency slot, never 0, no supplementary groups): it cannot
  signal the caller's processes, write root's files, or raise its limits; and ``RLIMIT_NPROC`` (which
  root ignores) holds for it, counted per slot so a fork bomb in one slot does not starve the others.
- **rlimits**: ``RLIMIT_CPU`` (CPU seconds; SIGXCPU, then SIGKILL one second later), ``RLIMIT_AS``
  (address space: ``memory_limit_mb``), ``RLIMIT_NPROC``, ``RLIMIT_FSIZE`` (largest file it can write),
  no core dumps.
- **Landlock** (when the kernel has it): every file-system change outside its directory is denied
  (``/tmp`` and ``/dev/shm`` are world-writable, so the uid alone would not stop those writes); writing
  ``/dev/null`` is allowed. Reading the file system stays allowed (the interpreter and its libraries).
- **Wall time**, enforced by the caller: at the deadline the program's pid 1 is killed through a pidfd
  (its namespace goes with it) and the launcher's process group too.
- **Output cap**: at most ``max_output_bytes`` of stdout and of stderr are read; the first byte beyond
  kills the run (status ``Error``, reason ``output_limit``).

What is NOT contained: reading world-readable files (the program sees the same file system: the venv,
``/etc``; nothing secret should be world-readable there); disk use inside its own directory beyond one
file's ``RLIMIT_FSIZE`` (many files); CPU and memory pressure on the machine within the limits (use
``max_concurrent`` to bound it); kernel exploits. When the caller is not root, the jail uses a user
namespace instead of another uid: ``RLIMIT_NPROC`` then counts all of the caller's processes, so the
process limit is only as good as the caller's own process count leaves room for (documented, not
hidden: :func:`isolation_report` says which case applies).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import queue
import select
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_JAIL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_jail.py")
# Slot uids: high, unnamed uids (no passwd entry), spread per server process so that two servers on a
# machine rarely share a slot's RLIMIT_NPROC count.
_UID_BASE = 1_500_000_000
_UID_STRIDE = 256
# Longest wait for a killed run's namespace to empty (the kernel kills them all; this bounds a stuck exit).
_REAP_WAIT_S = 30.0


@dataclasses.dataclass(frozen=True)
class Limits:
    """Per-run limits. ``cpu_s`` defaults to the wall time rounded up (RLIMIT_CPU is whole seconds)."""

    run_timeout_s: float = 10.0
    memory_mb: int = 1024
    nproc: int = 64
    max_output_bytes: int = 1 << 20
    max_file_bytes: int = 64 << 20
    cpu_s: int | None = None

    def __post_init__(self):
        if not self.run_timeout_s > 0:
            raise ValueError(f"run_timeout must be > 0 seconds, got {self.run_timeout_s}")
        if self.memory_mb < 64:
            raise ValueError("memory_limit_MB must be >= 64 (the interpreter alone needs ~30 MB), "
                             f"got {self.memory_mb}")
        if self.nproc < 1 or self.max_output_bytes < 1 or self.max_file_bytes < 1:
            raise ValueError(f"nproc, max_output_bytes and max_file_bytes must be >= 1: {self}")


@dataclasses.dataclass
class RunResult:
    """One run. ``status``: ``Finished`` (the program exited or was killed by a signal of its own
    making: see ``return_code``, negative for a signal), ``TimeLimitExceeded`` (wall or CPU time), or
    ``Error`` (output cap, or the jail could not start it). ``reason`` names the cause of anything but
    a clean exit 0: ``timeout``, ``cpu_time``, ``output_limit``, ``signal:<name>``, ``exit:<code>``,
    ``sandbox_error``."""

    status: str
    return_code: int | None
    stdout: str
    stderr: str
    execution_time: float
    reason: str | None


def isolation_report() -> dict:
    """What the jail can use on this machine (see the module docstring for what each means)."""
    libc_abi = subprocess.run([sys.executable, "-I", "-S", "-c",
                               f"import runpy; print(runpy.run_path({_JAIL!r})['landlock_abi']())"],
                              capture_output=True, text=True, check=True).stdout.strip()
    return {"separate_uid": os.geteuid() == 0, "user_namespace": os.geteuid() != 0,
            "landlock_abi": int(libc_abi)}


def _usable_by_others(path: str) -> bool:
    """Whether a uid with no rights of its own can execute ``path`` (every directory on the way o+x)."""
    real = os.path.realpath(path)
    parts = [real] + [os.path.dirname(real)]
    while parts[-1] != "/":
        parts.append(os.path.dirname(parts[-1]))
    return all(os.stat(p).st_mode & 0o001 for p in parts)


def program_interpreter(python: str | None = None) -> str:
    """The Python that runs programs: ``python`` if given, else this process's interpreter when the
    run's uid can execute it, else ``python3`` on ``/usr/bin:/bin`` (a venv under root's 0700 home is
    out of reach of another uid)."""
    if python is not None:
        candidates = [python]
    else:
        candidates = [sys.executable, *filter(None, [shutil.which("python3", path="/usr/bin:/bin")])]
    if os.geteuid() != 0:
        return candidates[0]
    for c in candidates:
        prefix = sys.base_prefix if c == sys.executable else os.path.dirname(c)  # where its stdlib lives
        if _usable_by_others(c) and _usable_by_others(prefix):
            return c
    raise RuntimeError(f"no Python interpreter that the sandbox's uid can execute among {candidates}: "
                       "install python3 readable by all users (o+rx on it and its directories) or pass python=<path>")


def _traversable_temp_dir() -> str:
    """The temporary folder, if every directory on its path lets other users pass (a program runs under its
    slot's uid and must reach its directory); else ``/tmp``. A caller's private ``TMPDIR`` (mode 0700) would
    otherwise make every run fail with "Permission denied"."""
    for candidate in (tempfile.gettempdir(), "/tmp"):
        path = Path(candidate).resolve()
        if all(p.stat().st_mode & stat.S_IXOTH for p in (path, *path.parents)):
            return str(path)
    raise RuntimeError(f"neither {tempfile.gettempdir()} nor /tmp can be traversed by other users (o+x), which the "
                       "sandbox's programs need; set TMPDIR to such a folder")


class Jail:
    """A root directory for runs and ``slots`` uids; :meth:`run` blocks for a free slot.

    ``close()`` kills nothing (each :meth:`run` waits for its own program) and removes the root."""

    def __init__(self, slots: int, python: str | None = None):
        if slots < 1:
            raise ValueError(f"max_concurrent must be >= 1, got {slots}")
        self.python = program_interpreter(python)
        self.root = tempfile.mkdtemp(prefix="meshrl-sandbox-", dir=_traversable_temp_dir())
        os.chmod(self.root, 0o711)  # runs can reach their own directory, not list the others
        self._slots: queue.Queue[int] = queue.Queue()
        base = _UID_BASE + (os.getpid() % 1_000_000) * _UID_STRIDE
        for i in range(slots):
            self._slots.put(base + i)

    def close(self):
        shutil.rmtree(self.root, ignore_errors=True)

    def run(self, code: str, limits: Limits, stdin: str | None = None,
            files: dict[str, bytes] | None = None) -> RunResult:
        """Run ``code`` as ``main.py`` with ``files`` (relative paths) beside it and ``stdin``."""
        uid = self._slots.get()
        try:
            workdir = tempfile.mkdtemp(prefix="run-", dir=self.root)
            try:
                _write_inputs(workdir, code, files or {})
                if os.geteuid() == 0:
                    for dirpath, _, names in os.walk(workdir):
                        for p in [dirpath, *(os.path.join(dirpath, n) for n in names)]:
                            os.chown(p, uid, uid)
                return _run_in_jail(self.python, workdir, limits, stdin or "", uid if os.geteuid() == 0 else None)
            finally:
                shutil.rmtree(workdir, ignore_errors=True)
        finally:
            self._slots.put(uid)


def _write_inputs(workdir: str, code: str, files: dict[str, bytes]):
    for rel, data in files.items():
        path = os.path.normpath(os.path.join(workdir, rel))
        if os.path.isabs(rel) or not path.startswith(workdir + os.sep):
            raise ValueError(f"file {rel!r} must be a relative path inside the run's directory")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
    with open(os.path.join(workdir, "main.py"), "w") as f:
        f.write(code)


def _run_in_jail(python: str, workdir: str, limits: Limits, stdin: str, uid: int | None) -> RunResult:
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8",
           "PYTHONDONTWRITEBYTECODE": "1", "PYTHONIOENCODING": "utf-8"}
    report_r, report_w = os.pipe()
    cfg = {"workdir": workdir, "argv": [python, "main.py"], "env": env,
           "cpu_s": limits.cpu_s or max(1, int(-(-limits.run_timeout_s // 1))),
           "memory_bytes": limits.memory_mb << 20, "nproc": limits.nproc, "fsize_bytes": limits.max_file_bytes,
           "uid": uid, "gid": uid, "report_fd": report_w}
    # stdin from an unlinked file: no writer thread, and a program that never reads it cannot block us.
    with tempfile.TemporaryFile() as stdin_file:
        stdin_file.write(stdin.encode())
        stdin_file.seek(0)
        start = time.monotonic()
        launcher = subprocess.Popen([sys.executable, "-I", "-S", _JAIL, json.dumps(cfg)], stdin=stdin_file,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=(report_w,),
                                    start_new_session=True)
    os.close(report_w)
    with _Watch(launcher, report_r) as watch:
        overflow, timed_out = watch.collect(start + limits.run_timeout_s, limits.max_output_bytes)
    elapsed = time.monotonic() - start
    out, err = (b"".join(chunks).decode(errors="replace") for chunks in (watch.out, watch.err))
    if watch.error is not None:
        return RunResult("Error", None, out, err + watch.error, elapsed, "sandbox_error")
    if timed_out:
        return RunResult("TimeLimitExceeded", None, out, err, elapsed, "timeout")
    if overflow:
        return RunResult("Error", None, out, err, elapsed, "output_limit")
    status = watch.status
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        # RLIMIT_CPU: SIGXCPU at the soft limit, SIGKILL at the hard one (a program that catches SIGXCPU).
        if sig == signal.SIGXCPU or (sig == signal.SIGKILL and watch.cpu_s >= cfg["cpu_s"]):
            return RunResult("TimeLimitExceeded", -sig, out, err, elapsed, "cpu_time")
        return RunResult("Finished", -sig, out, err, elapsed, f"signal:{signal.Signals(sig).name}")
    code = os.WEXITSTATUS(status)
    return RunResult("Finished", code, out, err, elapsed, None if code == 0 else f"exit:{code}")


class _Watch:
    """Reads a launcher's stdout/stderr/report pipes until all close or a limit is hit, and makes sure
    on exit that the program, its namespace and the launcher are gone and reaped."""

    def __init__(self, launcher: subprocess.Popen, report_fd: int):
        self.launcher = launcher
        self.report = os.fdopen(report_fd, "rb", buffering=0)
        self.out: list[bytes] = []
        self.err: list[bytes] = []
        self.pidfd: int | None = None
        self.status: int | None = None
        self.error: str | None = None
        self.cpu_s = 0.0
        self._report_buf = b""

    def __enter__(self):
        return self

    def collect(self, deadline: float, cap: int) -> tuple[bool, bool]:
        """Returns (output over ``cap``, past ``deadline``)."""
        sizes = {"out": 0, "err": 0}
        with selectors.DefaultSelector() as sel:
            sel.register(self.launcher.stdout, selectors.EVENT_READ, "out")
            sel.register(self.launcher.stderr, selectors.EVENT_READ, "err")
            sel.register(self.report, selectors.EVENT_READ, "report")
            while sel.get_map():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False, True
                for key, _ in sel.select(left):
                    data = os.read(key.fd, 65536)
                    if not data:
                        sel.unregister(key.fileobj)
                        continue
                    if key.data == "report":
                        self._on_report(data)
                        continue
                    keep = cap - sizes[key.data]
                    sizes[key.data] += len(data)
                    (self.out if key.data == "out" else self.err).append(data[:max(keep, 0)])
                    if sizes[key.data] > cap:
                        return True, False
        return False, False

    def _on_report(self, data: bytes):
        self._report_buf += data
        *lines, self._report_buf = self._report_buf.split(b"\n")
        for line in lines:
            kind, _, value = line.decode().partition(" ")
            if kind == "pid":
                with contextlib.suppress(ProcessLookupError):
                    self.pidfd = os.pidfd_open(int(value))
            elif kind == "status":
                status, cpu = value.split()
                self.status, self.cpu_s = int(status), float(cpu)
            else:
                self.error = value

    def __exit__(self, *exc):
        # Kill pid 1 (a no-op for a finished run): its namespace goes with it, and the launcher, its
        # parent, reaps it only once every process in it is gone, so the slot's process count is back to
        # zero when the launcher exits. Its process group too, for a launcher killed before reporting.
        if self.pidfd is not None:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
        else:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.launcher.pid, signal.SIGKILL)
        self.launcher.wait()
        if self.status is None and self.error is None:
            # Killed before the launcher reported: drain what it wrote before dying.
            with contextlib.suppress(OSError):
                self._on_report(self.report.read() or b"")
        if self.pidfd is not None:
            # A pid 1 read only in that drain outlived its launcher (a run timed out before its launcher's
            # report was read, e.g. on a loaded machine): kill it too. Its pidfd turns readable only when its
            # exit is complete, which the kernel holds back until every process of its namespace is gone.
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
            select.select([self.pidfd], [], [], _REAP_WAIT_S)
            os.close(self.pidfd)
        self.report.close()
        self.launcher.stdout.close()
        self.launcher.stderr.close()
