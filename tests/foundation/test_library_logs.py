"""The console keeps meshrl's lines, the libraries' output goes to the run folder's logs (``meshrl.logs``)."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

import meshrl
from meshrl.logs import DRIVER_LOG, driver_output, logs_dir, worker_log_name

MESHRL_FILE = str(Path(meshrl.__file__).resolve().parent / "trainer" / "main.py")
LIBRARY_FILE = str(Path(logging.__file__).resolve())


def emit_one_of_each(library: logging.Logger) -> None:
    """A line of every kind, each with its own text: library INFO / WARNING / ERROR records, a meshrl WARNING
    record, a library warning and a meshrl warning (located by file name, as warnings.warn's stacklevel does)."""
    library.info("library info line")
    library.warning("library warning record")
    library.error("library error record")
    logging.getLogger("meshrl.rewards.pool").warning("meshrl warning record")
    logging.getLogger("meshrl.trainer.checkpoint").info("meshrl info record")
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.warn_explicit("library python warning", UserWarning, LIBRARY_FILE, 1)
        warnings.warn_explicit("meshrl python warning", UserWarning, MESHRL_FILE, 1)


@pytest.fixture
def library_logger():
    """A library logger as Ray's and torch's are: its own console handler, not propagating to the root."""
    logger = logging.getLogger("fakelib.core")
    handler = logging.StreamHandler(sys.stderr)
    logger.addHandler(handler)
    logger.propagate = False
    logger.setLevel(logging.INFO)
    yield logger, handler
    logger.removeHandler(handler)
    logger.propagate = True


def test_driver_output_keeps_meshrl_lines_and_errors_on_the_console_and_the_rest_in_the_file(
        tmp_path, capsys, library_logger):
    logger, handler = library_logger
    root = logging.getLogger()
    before = (list(root.handlers), root.level, warnings.showwarning, list(logger.handlers))
    with driver_output(logs_dir(tmp_path), verbose=False) as folder:
        emit_one_of_each(logger)
    console = capsys.readouterr().err
    log = (tmp_path / "logs" / DRIVER_LOG).read_text()

    assert folder == tmp_path / "logs"
    assert console.count(str(folder)) == 1  # the path, said once
    assert "meshrl: warning: meshrl warning record" in console
    assert "meshrl: warning: meshrl python warning" in console
    assert "fakelib.core: ERROR: library error record" in console  # errors are never hidden
    for quiet in ("library info line", "library warning record", "library python warning", "meshrl info record"):
        assert quiet not in console
        assert quiet in log
    assert "library error record" in log and "meshrl warning record" in log and "meshrl python warning" in log
    # Everything is as it was: the library's own handlers back (pytest's capture is one), the root and showwarning.
    assert (list(root.handlers), root.level, warnings.showwarning, list(logger.handlers)) == before
    assert handler in logger.handlers and logger.propagate is False


def test_driver_output_appends_and_names_the_folder_under_a_failure(tmp_path, capsys):
    with pytest.raises(RuntimeError) as info:
        with driver_output(logs_dir(tmp_path), verbose=False):
            raise RuntimeError("worker rank 0 failed")
    assert any(str(tmp_path / "logs") in note for note in info.value.__notes__)
    with pytest.raises(KeyboardInterrupt) as interrupted:  # a signal's one line stays alone (meshrl.trainer.interrupts)
        with driver_output(logs_dir(tmp_path), verbose=False):
            raise KeyboardInterrupt
    assert not getattr(interrupted.value, "__notes__", None)
    assert (tmp_path / "logs" / DRIVER_LOG).read_text().count("===== ") == 2  # a second run appends


def test_verbose_leaves_the_libraries_on_the_console_and_writes_no_file(tmp_path, capsys, library_logger):
    logger, _ = library_logger
    with driver_output(logs_dir(tmp_path), verbose=True) as folder, pytest.warns(UserWarning) as shown:
        emit_one_of_each(logger)
    assert [str(w.message) for w in shown] == ["library python warning", "meshrl python warning"]
    assert folder is None and not (tmp_path / "logs").exists()
    assert "library info line" in capsys.readouterr().err


WORKER = textwrap.dedent("""
    import logging, os, sys, warnings
    from pathlib import Path
    from meshrl.logs import route_worker_output
    sys.path.insert(0, {tests!r})
    from test_library_logs import emit_one_of_each
    library = logging.getLogger("fakelib.core")
    library.addHandler(logging.StreamHandler(sys.stderr))
    library.propagate = False
    library.setLevel(logging.INFO)
    print(route_worker_output(Path(sys.argv[1]), "Worker-rank3.log"))
    print("library print", flush=True)
    os.write(2, b"c++ warning on fd 2\\n")
    emit_one_of_each(library)
""")


def test_a_worker_process_writes_everything_to_its_file_and_meshrl_lines_to_its_former_stderr(tmp_path):
    script = WORKER.format(tests=str(Path(__file__).parent))
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    log = (tmp_path / worker_log_name("Worker", 3)).read_text()
    console = done.stdout + done.stderr  # what Ray would forward to the driver
    for quiet in ("library print", "c++ warning on fd 2", "library info line", "library warning record",
                  "library python warning", "meshrl info record", str(tmp_path)):
        assert quiet not in console
        assert quiet in log
    assert "meshrl: warning: meshrl warning record" in console and "meshrl: warning: meshrl python warning" in console
    assert "fakelib.core: ERROR: library error record" in console
    assert log.startswith("===== ") and "Worker-rank3, pid" in log.splitlines()[0]


def test_a_rank_built_in_process_keeps_its_callers_output(tmp_path):
    from meshrl.workers.rank import RankWorker

    from meshrl.config import load_config
    from meshrl.config.run_plan import build_run_plan

    plan = build_run_plan(load_config([f"trainer.default_local_dir={tmp_path}"]))
    RankWorker(0, 1, {}, "model", plan=plan)
    assert not (tmp_path / "logs").exists()
