"""Process-wide runtime settings: the project cache folder and the environment of the engines.

Every cache meshrl or its engines write (model conversions, vLLM, torch inductor, Ray temp files,
Hugging Face) lives under one folder, ``cache_dir()``, never scattered in the home directory:

    $MESHRL_CACHE_DIR                          if set
    <repo>/.cache                              for an editable install (the repo holds setup.py)
    $XDG_CACHE_HOME/meshrl or ~/.cache/meshrl  otherwise

``configure_environment()`` must run before vLLM, Ray or transformers are imported; entry points call
it first. It only sets variables the user has not set, so a user's choice always wins.

What a killed run leaves is cleared here too: a dead driver's processes and temporary folder (``prune_run_temp_dirs``,
``stop_leftovers``) and the shared memory of a killed vLLM process tree (``remove_orphaned_shared_memory``); and the
helpers a process forks for a task it waits on die with it (``forks_die_with_this_process``).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import functools
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

_PACKAGE_DIR = Path(__file__).resolve().parent


def cache_dir() -> Path:
    """The project cache folder (created on first use)."""
    env = os.environ.get("MESHRL_CACHE_DIR")
    if env:
        path = Path(env)
    elif (_PACKAGE_DIR.parent / "setup.py").is_file():
        path = _PACKAGE_DIR.parent / ".cache"
    else:
        base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        path = Path(base) / "meshrl"
    path.mkdir(parents=True, exist_ok=True)
    return path


def has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def configure_environment() -> None:
    """Point every engine's caches at ``cache_dir()`` and keep a single machine offline and on loopback."""
    root = cache_dir()
    defaults = {
        # No hub is reachable: fail fast instead of retrying network calls.
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_HOME": str(root / "huggingface"),
        "VLLM_CACHE_ROOT": str(root / "vllm"),
        "TORCHINDUCTOR_CACHE_DIR": str(root / "inductor"),
        "TRITON_CACHE_DIR": str(root / "triton"),
        "RAY_TMPDIR": str(root / "ray"),
        # Ray: no token auth file in $HOME, no telemetry, and stay on 127.0.0.1 on one node.
        "RAY_AUTH_MODE": "disabled",
        "RAY_USAGE_STATS_ENABLED": "0",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "MPLCONFIGDIR": str(root / "matplotlib"),
    }
    if not os.environ.get("RAY_ADDRESS"):
        # Single node: keep Ray on 127.0.0.1. Not on a cluster: children inherit it, and `ray start
        # --address` then refuses to join.
        defaults["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    for key, value in defaults.items():
        os.environ.setdefault(key, value)
    # Ray expects its temp dir to exist.
    Path(os.environ["RAY_TMPDIR"]).mkdir(parents=True, exist_ok=True)


# Ray keeps one folder per session (its logs: the post-mortem of a failed run) under RAY_TMPDIR and never
# removes them; meshrl keeps the newest few of those whose driver is gone.
KEPT_RAY_SESSIONS = 8


def prune_ray_sessions(root: Path | None = None, keep: int = KEPT_RAY_SESSIONS) -> list[Path]:
    """Remove Ray session folders under ``root`` (default ``RAY_TMPDIR``) beyond the newest ``keep`` whose
    driver process is dead; the removed paths. A session folder is named ``session_<date>_<time>_<usec>_<pid>``
    by Ray, ``<pid>`` the process that started it: a live pid keeps it (two runs may share the folder)."""
    root = Path(root or os.environ["RAY_TMPDIR"])
    stale = []
    for folder in root.glob("session_2*"):
        pid = folder.name.rsplit("_", 1)[-1]
        if folder.is_dir() and not folder.is_symlink() and pid.isdigit() and not psutil.pid_exists(int(pid)):
            stale.append(folder)
    stale.sort(key=lambda folder: folder.name, reverse=True)  # the name starts with the start time
    for folder in stale[keep:]:
        shutil.rmtree(folder, ignore_errors=True)
    return stale[keep:]


# A training run's own temporary folder: <TMPDIR>/meshrl-run-<driver pid>-<random>.
RUN_TEMP_PREFIX = "meshrl-run-"
_run_temp: Path | None = None  # this process's, once made


def use_run_temp_dir() -> Path:
    """Give this process and every process it starts (Ray's daemons and workers inherit ``TMPDIR``) one
    temporary folder, removed when this process exits. Temporary files of a process killed with ``kill -9``
    (a worker's ``multiprocessing`` sockets, say) go with it; the folder of a killed driver is removed by the
    next run's start (``prune_run_temp_dirs``). Call before Ray starts. A process calls it once: later calls (a
    test or notebook running several trainings in one process) return the same folder."""
    global _run_temp
    if _run_temp is not None and _run_temp.is_dir():
        return _run_temp
    base = Path(tempfile.gettempdir())
    prune_run_temp_dirs(base)
    _run_temp = Path(tempfile.mkdtemp(prefix=f"{RUN_TEMP_PREFIX}{os.getpid()}-", dir=base))
    # Others may pass, not list: the code sandbox's programs run under their own uids inside it.
    os.chmod(_run_temp, 0o711)
    os.environ["TMPDIR"] = tempfile.tempdir = str(_run_temp)
    atexit.register(shutil.rmtree, _run_temp, ignore_errors=True)
    return _run_temp


def prune_run_temp_dirs(base: Path) -> list[Path]:
    """Remove the run temporary folders under ``base`` whose driver is dead, after stopping the processes that run
    left (``stop_leftovers``); the removed paths."""
    stale = []
    for folder in base.glob(f"{RUN_TEMP_PREFIX}*"):
        pid = folder.name[len(RUN_TEMP_PREFIX):].split("-", 1)[0]
        if folder.is_dir() and pid.isdigit() and not psutil.pid_exists(int(pid)):
            stop_leftovers(folder)
            shutil.rmtree(folder, ignore_errors=True)
            stale.append(folder)
    return stale


def stop_leftovers(folder: Path, settle_s: float = 10.0) -> list[int]:
    """Kill the processes whose ``TMPDIR`` is the run temporary folder ``folder`` of a dead driver: that run's
    leftovers (every process a run starts inherits its folder). After a ``kill -9`` of the driver, Ray's dashboard and
    runtime-env agents first report their raylet's death to the GCS, dead too, and wait up to 60 s for it
    (``ray._private.utils.publish_error_to_driver``) before they exit; a worker still saving a checkpoint forks
    megatron's writers, which, orphaned, wait forever on their dead parent's queue. So every such process is first
    stopped (SIGSTOP: it can fork no more) and the processes are looked for again until no new one appears; then all
    are killed, and looked for once more when they are gone. The next look waits until every process just sent
    SIGSTOP is seen stopped: the signal takes effect when the process returns to user space, so one inside ``fork``
    finishes it first and its child appears after a look made at once (the leftover writer of CI's stop 50).
    ``settle_s`` bounds the waiting (a process in uninterruptible sleep stops late). Returns the pids killed."""
    deadline = time.monotonic() + settle_s
    stopped: dict[int, psutil.Process] = {}
    while True:
        found = [proc for proc in _processes_with_tmpdir(folder) if proc.pid not in stopped]
        if found:
            for proc in found:
                with contextlib.suppress(psutil.Error):
                    proc.suspend()
                    stopped[proc.pid] = proc
            _wait_until(found, _STOPPED, deadline)
            continue
        for proc in stopped.values():
            with contextlib.suppress(psutil.Error):
                proc.kill()
        _wait_until(list(stopped.values()), _GONE, min(deadline, time.monotonic() + 1.0))
        if time.monotonic() > deadline or not any(proc.pid not in stopped for proc in _processes_with_tmpdir(folder)):
            return sorted(stopped)


_GONE = (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
_STOPPED = (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP, *_GONE)


def _wait_until(processes: list[psutil.Process], states: tuple[str, ...], deadline: float) -> None:
    """Until each of ``processes`` is in one of ``states`` or gone, or ``deadline``; polled, not waited for: a
    child of this process is not reaped here (its ``Popen`` keeps its exit code)."""
    waiting = list(processes)
    while waiting and time.monotonic() < deadline:
        still = []
        for proc in waiting:
            with contextlib.suppress(psutil.Error):
                if proc.status() not in states:
                    still.append(proc)
        waiting = still
        if waiting:
            time.sleep(0.005)


# The process and thread inside ``forks_die_with_this_process`` (None outside): a child forked there dies with them.
_dying_with: tuple[int, int] | None = None
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


@contextlib.contextmanager
def forks_die_with_this_process():
    """Within the block, a child this thread forks (``os.fork``: ``multiprocessing``'s fork context) gets SIGKILL
    when the forking thread ends (Linux ``PR_SET_PDEATHSIG``; elsewhere nothing changes). For helpers the block
    waits for, such as megatron's checkpoint writers: when the Ray actor saving is killed (its driver died, the
    machine ran short of memory), each writer otherwise waits forever on a queue its dead parent was to fill, holding
    a copy of the actor's memory. Only this thread's forks: another thread's child may outlive its forking thread."""
    global _dying_with
    if not sys.platform.startswith("linux"):
        yield
        return
    _register_die_with_parent()
    previous, _dying_with = _dying_with, (os.getpid(), threading.get_ident())
    try:
        yield
    finally:
        _dying_with = previous


@functools.cache
def _register_die_with_parent() -> None:
    os.register_at_fork(after_in_child=_die_with_parent)


def _die_with_parent() -> None:
    if _dying_with is None or _dying_with[1] != threading.get_ident():  # the forking thread is the child's own
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != _dying_with[0]:  # the parent died before the request: nobody will send the signal
        os._exit(1)


def _processes_with_tmpdir(folder: Path) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get("TMPDIR") == str(folder):
                found.append(proc)
        except (psutil.Error, OSError):  # gone, or another user's
            continue
    return found


SHM_DIR = Path("/dev/shm")


def shm_names() -> set[str]:
    """The names under ``/dev/shm`` now. Empty where POSIX shared memory is not a folder (macOS): its names cannot be
    listed there, so nothing is removed early or late (the names are still per run)."""
    try:
        return set(os.listdir(SHM_DIR))
    except FileNotFoundError:
        return set()


def remove_orphaned_shared_memory(names: set[str]) -> list[str]:
    """Unlink those of ``names`` that are Python ``multiprocessing`` shared memory (``psm_*`` segments: vLLM's
    message-queue rings; ``sem.mp-*`` named semaphores) which no live process of this user has mapped or open: what a
    process tree killed with its resource tracker left (a served model's engine core and worker, which vLLM's own
    server shutdown force-kills on CPU, then the group's SIGKILL); returns them. An entry a live process holds is
    kept, so a name of another engine starting beside this one is safe."""
    candidates = {name for name in names if name.startswith(("psm_", "sem.mp-"))}
    if not candidates:
        return []
    held: set[str] = set()
    for pid in psutil.pids():
        with contextlib.suppress(OSError):  # gone, or another user's (which cannot open this user's 0600 files)
            with open(f"/proc/{pid}/maps") as maps:
                held.update(line.rsplit("/dev/shm/", 1)[1].split()[0] for line in maps if "/dev/shm/" in line)
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if target.startswith(f"{SHM_DIR}/"):
                        held.add(target[len(str(SHM_DIR)) + 1:].split()[0])
    removed = []
    for name in sorted(candidates - held):
        with contextlib.suppress(FileNotFoundError, PermissionError):
            (SHM_DIR / name).unlink()
            removed.append(name)
    return removed
