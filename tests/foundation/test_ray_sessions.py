"""Ray's session folders under RAY_TMPDIR: the old ones of finished drivers are pruned, a live driver's never."""

import subprocess
import sys

from meshrl.runtime import prune_ray_sessions


def _dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_old_sessions_of_dead_drivers_go_and_live_ones_stay(tmp_path):
    dead, live = _dead_pid(), subprocess.os.getpid()
    names = [f"session_2026-11-0{day}_10-00-00_000000_{dead}" for day in range(1, 6)]
    names.append(f"session_2026-11-01_09-00-00_000000_{live}")  # the oldest, but its driver runs
    for name in names:
        (tmp_path / name / "logs").mkdir(parents=True)
    (tmp_path / "session_latest").symlink_to(tmp_path / names[4])
    (tmp_path / "unrelated").mkdir()

    removed = prune_ray_sessions(tmp_path, keep=2)

    assert sorted(p.name for p in removed) == sorted(names[:3])  # the three oldest dead ones
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == sorted([*names[3:], "session_latest", "unrelated"])


def test_a_process_makes_one_run_temp_dir_however_often_it_asks(monkeypatch, tmp_path):
    # In-process trainings (tests, notebooks) call main() again and again: the folder must not nest, or socket
    # paths under it grow past AF_UNIX's 107 characters.
    import tempfile

    import meshrl.runtime as runtime

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)
    monkeypatch.setattr(runtime, "_run_temp", None)
    first = runtime.use_run_temp_dir()
    assert first.parent == tmp_path and first.name.startswith(f"meshrl-run-{subprocess.os.getpid()}-")
    assert runtime.use_run_temp_dir() == first and tempfile.gettempdir() == str(first)


# Forks a child every millisecond (each sleeps on): a worker forking checkpoint writers while the next run stops it.
FORKER = """
import os, time
open(os.path.join(os.environ["TMPDIR"], "forking"), "w").close()
while True:
    if os.fork() == 0:
        time.sleep(60)
        os._exit(0)
    time.sleep(0.001)
"""


def test_a_dead_drivers_leftover_processes_are_stopped_with_its_folder(tmp_path):
    """After ``kill -9`` of a driver, Ray's agents linger up to 60 s on its dead GCS and a worker saving a checkpoint
    forks megatron's writers: the next run's start kills every process that inherited the dead run's folder as
    TMPDIR, a child forked while it was being stopped included, then removes the folder; a live run's stay."""
    import os
    import time

    import psutil

    from meshrl.runtime import RUN_TEMP_PREFIX, prune_run_temp_dirs

    dead, live = tmp_path / f"{RUN_TEMP_PREFIX}{_dead_pid()}-x", tmp_path / f"{RUN_TEMP_PREFIX}{os.getpid()}-y"
    processes = {}
    for folder in (dead, live):
        folder.mkdir()
        processes[folder] = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                                             env={**os.environ, "TMPDIR": str(folder)})
    forker = subprocess.Popen([sys.executable, "-c", FORKER], env={**os.environ, "TMPDIR": str(dead)})
    try:
        deadline = time.monotonic() + 30
        while not (dead / "forking").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.2)  # a few hundred children by now
        assert len(psutil.Process(forker.pid).children()) > 10
        assert prune_run_temp_dirs(tmp_path) == [dead]
        assert processes[dead].wait(timeout=10) != 0 and forker.wait(timeout=10) != 0  # killed
        time.sleep(0.5)  # the killed children's last moments
        orphans = [p for p in psutil.process_iter(["environ"]) if (p.info["environ"] or {}).get("TMPDIR") == str(dead)
                   and p.status() != psutil.STATUS_ZOMBIE]
        assert orphans == []
        assert processes[live].poll() is None and live.is_dir() and not dead.exists()
    finally:
        for process in (*processes.values(), forker):
            process.kill()
            process.wait()


# A worker saving a checkpoint: megatron's writer forked (multiprocessing's fork context) inside the block, a child
# forked outside it, each writing its pid; then it waits, as the writer's parent waits for the writer.
SAVER = """
import multiprocessing, os, sys, time
from meshrl.runtime import forks_die_with_this_process

def child(path):
    with open(path, "w") as out:
        out.write(str(os.getpid()))
    time.sleep(60)

folder = sys.argv[1]
with forks_die_with_this_process():
    multiprocessing.get_context("fork").Process(target=child, args=(folder + "/writer",)).start()
multiprocessing.get_context("fork").Process(target=child, args=(folder + "/other",)).start()
time.sleep(60)
"""


def test_a_writer_forked_while_saving_dies_with_its_killed_parent(tmp_path):
    """``kill -9`` of a Ray actor while it saves (its driver died, memory ran short): the writer it forked inside
    ``forks_die_with_this_process`` dies with it instead of waiting forever for its dead parent; a child forked
    outside the block is left alone (what the writer did before)."""
    import contextlib
    import os
    import signal
    import time

    import psutil

    saver = subprocess.Popen([sys.executable, "-c", SAVER, str(tmp_path)])
    try:
        deadline = time.monotonic() + 60
        while not all((tmp_path / name).exists() and (tmp_path / name).read_text() for name in ("writer", "other")):
            assert time.monotonic() < deadline and saver.poll() is None
            time.sleep(0.05)
        writer, other = (psutil.Process(int((tmp_path / name).read_text())) for name in ("writer", "other"))
        saver.send_signal(signal.SIGKILL)
        saver.wait()
        gone, alive = psutil.wait_procs([writer, other], timeout=5)
        assert [p.pid for p in gone] == [writer.pid] and [p.pid for p in alive] == [other.pid]
    finally:
        saver.kill()
        for name in ("writer", "other"):
            if (tmp_path / name).exists() and (tmp_path / name).read_text():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int((tmp_path / name).read_text()), signal.SIGKILL)
