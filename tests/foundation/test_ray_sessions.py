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
