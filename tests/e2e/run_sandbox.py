"""Run ``python -m meshrl.trainer.main`` as a user does, and find everything the run left behind.

Each run gets its own temporary folder as ``TMPDIR`` and ``RAY_TMPDIR`` (Ray's session goes there): the run's processes
are the ones whose environment carries that ``TMPDIR`` or a folder in it (every process it starts inherits it, and a
daemon that outlives a killed driver still has it), its temporary files are that folder's contents, and its
shared-memory segments are the entries of ``/dev/shm`` that appeared while it ran, less those a live process outside the
sandbox leads or has mapped (``make test`` runs another test file beside this one: its engines, its spawn semaphores).
Ray keeps a folder per session under ``RAY_TMPDIR`` on purpose (logs, the post-mortem of a failed run;
``meshrl.runtime`` prunes old ones): not counted.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import psutil

REPO = Path(__file__).resolve().parents[2]
SHM = Path("/dev/shm")

# The tiny recipe, short: what every reliability run shares (the test adds its own overrides).
TINY = ["--config-name", "cpu_tiny_grpo", "trainer.device=cpu", "trainer.val_before_train=False",
        "trainer.test_freq=-1", "data.train_max_samples=64"]


def _shm_entries() -> set[str]:
    return set(os.listdir(SHM)) if SHM.is_dir() else set()


def _mapped_inodes(skip_pids: set[int]) -> set[int]:
    """Inodes of the ``/dev/shm`` files that live processes other than ``skip_pids`` have mapped (a named semaphore
    or segment in use: ``sem_open`` and ``shm_open`` map the file)."""
    inodes = set()
    for pid in psutil.pids():
        if pid in skip_pids:
            continue
        try:
            with open(f"/proc/{pid}/maps") as maps:
                inodes.update(int(line.split()[4]) for line in maps if "/dev/shm/" in line)
        except (OSError, IndexError, ValueError):
            continue  # gone, or another user's
    return inodes


def _held_elsewhere(name: str, sandbox_pids: set[int], mapped: set[int]) -> bool:
    """Whether ``name`` belongs to a live process outside the sandbox (a test running beside this one): a meshrl
    engine's segment (``meshrl.rollout.vllm_shm``: ``meshrl-<pid>-...``) whose leader is alive, or an entry such a
    process has mapped (e.g. a ``torch.multiprocessing`` spawn's ``sem.mp-*`` semaphore)."""
    match = re.match(r"meshrl-(\d+)-", name)
    if match is not None:
        return int(match[1]) not in sandbox_pids and psutil.pid_exists(int(match[1]))
    try:
        return (SHM / name).stat().st_ino in mapped
    except FileNotFoundError:
        return True  # removed meanwhile: not left behind


def _describe(process: psutil.Process) -> str:
    """A leftover process as the failure shows it: its command, and where it came from and waits."""
    try:
        with process.oneshot():
            parent = process.ppid()
            wchan = (Path(f"/proc/{process.pid}/wchan").read_text()
                     if Path(f"/proc/{process.pid}/wchan").exists() else "")
            return (f"{' '.join(process.cmdline()).strip()[:80]} (pid {process.pid}, parent {parent}"
                    f"{'' if psutil.pid_exists(parent) else ' gone'}, "
                    f"started {time.time() - process.create_time():.0f} s "
                    f"ago, TMPDIR {process.environ().get('TMPDIR')}, {process.status()}, waiting in {wchan or '?'}, "
                    f"{process.num_threads()} threads)")
    except psutil.Error as error:
        return f"pid {process.pid}: {error}"


@dataclass
class RunSandbox:
    """One run's ``TMPDIR``, and what was in ``/dev/shm`` before it started."""

    tmpdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="mr", dir="/tmp")))  # short: Ray's
    shm_before: set[str] = field(default_factory=_shm_entries)  # socket paths must stay under 107 characters

    @property
    def env(self) -> dict[str, str]:
        # meshrl keeps Ray's sessions in its cache folder unless RAY_TMPDIR is set (meshrl.runtime): here, the run's.
        return {**os.environ, "TMPDIR": str(self.tmpdir), "RAY_TMPDIR": str(self.tmpdir / "ray")}

    def processes(self) -> list[psutil.Process]:
        """Live processes started under this sandbox's ``TMPDIR`` (zombies awaiting their parent excluded)."""
        found = []
        for process in psutil.process_iter():
            try:
                tmpdir = process.environ().get("TMPDIR", "")
                if (process.pid != os.getpid() and (tmpdir + "/").startswith(f"{self.tmpdir}/")
                        and process.status() != psutil.STATUS_ZOMBIE):
                    found.append(process)
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
        return found

    def leftovers(self, wait_s: float = 30.0) -> dict[str, list[str]]:
        """What the run left: processes, files in its ``TMPDIR`` other than Ray's session logs, new shared-memory
        segments. Processes get ``wait_s`` to finish exiting (Ray's daemons notice a dead driver within seconds)."""
        deadline = time.monotonic() + wait_s
        while (alive := self.processes()) and time.monotonic() < deadline:
            time.sleep(0.5)
        files = []
        for path in sorted(self.tmpdir.rglob("*")):
            relative = path.relative_to(self.tmpdir)
            if path.is_dir() or relative.parts[0] == "ray":
                continue  # Ray's session folders: its post-mortem archive (meshrl prunes the old ones)
            files.append(str(relative))
        ours = {p.pid for p in alive}
        # A neighbour's entry can outlive its process for a moment (Python's resource tracker removes a killed
        # process's semaphores after it): an entry counts once it stayed a few seconds with no holder outside.
        settle = time.monotonic() + 5.0
        while True:
            mapped = _mapped_inodes(ours | {os.getpid()})
            shm = sorted(name for name in _shm_entries() - self.shm_before if not _held_elsewhere(name, ours, mapped))
            if not shm or time.monotonic() > settle:
                break
            time.sleep(0.5)
        return {"processes": [_describe(p) for p in alive if p.is_running()], "files": files, "shm": shm}

    def assert_clean(self, wait_s: float = 30.0) -> None:
        """Nothing left, processes given ``wait_s`` to exit."""
        left = self.leftovers(wait_s)
        assert not any(left.values()), left

    def cleanup(self) -> None:
        for process in self.processes():
            process.kill()
        shutil.rmtree(self.tmpdir, ignore_errors=True)


def run_main(sandbox: RunSandbox, *args: str, log: Path, until: Callable[[], bool] | None = None,
             signum: int | None = None, kill: Callable[[], list[psutil.Process]] | None = None,
             timeout_s: float = 420) -> int:
    """Run the trainer's command with ``args`` in ``sandbox``, output to ``log``; its exit code.

    With ``until``: once ``until()`` holds, send ``signum`` to the driver, or SIGKILL every process ``kill()``
    returns (a worker, or the driver itself); then wait for the driver's exit.
    """
    command = [sys.executable, "-m", "meshrl.trainer.main", *args]
    with open(log, "w") as out:
        process = subprocess.Popen(command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=sandbox.env)
        try:
            if until is not None:
                deadline = time.monotonic() + timeout_s
                while not until():
                    assert process.poll() is None, log.read_text()[-3000:]
                    assert time.monotonic() < deadline, "the run never reached the point to interrupt"
                    time.sleep(0.05)
                if signum is not None:
                    process.send_signal(signum)
                for victim in kill() if kill is not None else []:
                    victim.send_signal(signal.SIGKILL)
            return process.wait(timeout=timeout_s)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
