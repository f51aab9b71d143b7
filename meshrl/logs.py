"""Where the libraries' output goes: the console keeps meshrl's own lines, the rest lands in the run folder.

A run's console shows meshrl's lines only: the run plan's start-up notes, the resume line, the per-step
progress, validation, the final summary, meshrl's warnings and every error. What vLLM, Ray, Megatron,
transformers and torch write (config dumps, INFO lines, "Transformer Engine and Apex are not installed" once
per worker, C++ warnings) goes to ``<trainer.default_local_dir>/logs/`` (``logs_dir``), appended to:

    driver.log                       the driver's library log records (INFO and up) and library warnings
    <WorkerClass>-rank<N>.log        everything a worker process writes: its stdout and stderr are redirected
                                     at the file-descriptor level, so C++ output and the engine's are included

What stays on the console, in the driver and in the workers alike:

- log records of meshrl's loggers (``meshrl.*``) at WARNING and up, and any logger's at ERROR and up (the
  libraries' own console handlers, e.g. Ray's and torch's, are taken off so that their records reach the
  root logger, which decides);
- Python warnings attributed (by their ``stacklevel``) to a file of the meshrl package, as
  ``meshrl: warning: <message>``;
- everything meshrl prints itself: the driver's stdout and stderr are left alone.

A worker's console lines reach the driver through Ray's log forwarding (``log_to_driver``), prefixed with the
worker's name and pid (``(ActorRolloutRefWorker pid=...)``). Errors are never hidden: besides the ERROR
records, an exception that ends a run carries a note naming the logs folder (shown under its traceback), and
a worker's exception reaches the driver as the message of ``meshrl.workers.group.WorkerError``.
``trainer.verbose=True`` changes nothing: the libraries write where they always do, and no log file is
written.
"""

from __future__ import annotations

import logging
import os
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TextIO

LOGS_DIR = "logs"
DRIVER_LOG = "driver.log"
_PACKAGE_DIR = str(Path(__file__).resolve().parent) + os.sep
_LINE = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def logs_dir(run_dir: str | Path) -> Path:
    """The folder of a run's library output: ``<run_dir>/logs``."""
    return Path(run_dir) / LOGS_DIR


def worker_log_name(worker_class: str, rank: int) -> str:
    """The file a worker process writes to inside ``logs_dir``."""
    return f"{worker_class}-rank{rank}.log"


def is_meshrl_source(filename: str) -> bool:
    """Whether ``filename`` (a warning's or a frame's) is a file of the meshrl package."""
    return os.path.abspath(filename).startswith(_PACKAGE_DIR)


class ConsoleFilter(logging.Filter):
    """The log records the console shows: meshrl's at WARNING and up, anyone's at ERROR and up."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR:
            return True
        return record.levelno >= logging.WARNING and (record.name == "meshrl" or record.name.startswith("meshrl."))


class ConsoleFormatter(logging.Formatter):
    """``meshrl: warning: <message>`` for meshrl's records, ``<logger>: ERROR: <message>`` for a library's."""

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        if record.name == "meshrl" or record.name.startswith("meshrl."):
            return f"meshrl: {record.levelname.lower()}: {text}"
        return f"{record.name}: {record.levelname}: {text}"


def _open_log(path: Path, who: str) -> TextIO:
    """``path`` opened for appending (a resumed run adds to its files), line-buffered so ``tail -f`` follows
    it, after a header line naming the process."""
    path.parent.mkdir(parents=True, exist_ok=True)
    file = open(path, "a", encoding="utf-8", buffering=1)
    file.write(f"===== {time.strftime('%Y-%m-%d %H:%M:%S')} {who}, pid {os.getpid()} =====\n")
    return file


def _show_warning(console: TextIO, file: TextIO):
    """A ``warnings.showwarning`` that writes meshrl's warnings to ``console`` (and ``file``), the others to
    ``file`` only."""

    def show(message, category, filename, lineno, file_=None, line=None) -> None:
        text = warnings.formatwarning(message, category, filename, lineno, line)
        file.write(text)
        if is_meshrl_source(filename):
            console.write(f"meshrl: warning: {message}\n")
            console.flush()

    return show


def _route(console: TextIO, file: TextIO) -> Callable[[], None]:
    """Route this process's log records and warnings: the root logger (at INFO) writes every record to ``file``
    and the console's (``ConsoleFilter``) to ``console``; the libraries' own console handlers (Ray's ``ray``,
    torch's, transformers': they bypass the root logger) are taken off so that their records reach it; Python
    warnings go by ``_show_warning``. Returns the function that undoes all of it."""
    to_file = logging.StreamHandler(file)
    to_file.setFormatter(logging.Formatter(_LINE))
    to_console = logging.StreamHandler(console)
    to_console.addFilter(ConsoleFilter())
    to_console.setFormatter(ConsoleFormatter())
    root = logging.getLogger()
    saved_level, saved_show = root.level, warnings.showwarning
    detached = [(logger, handler, logger.propagate) for logger, handler in _console_handlers_of_libraries()]
    for logger, handler, _ in detached:
        logger.removeHandler(handler)
        logger.propagate = True
    root.addHandler(to_file)
    root.addHandler(to_console)
    root.setLevel(logging.INFO)
    warnings.showwarning = _show_warning(console, file)

    def undo() -> None:
        warnings.showwarning = saved_show
        root.setLevel(saved_level)
        root.removeHandler(to_file)
        root.removeHandler(to_console)
        for logger, handler, propagate in detached:
            logger.addHandler(handler)
            logger.propagate = propagate

    return undo


def _console_handlers_of_libraries() -> list[tuple[logging.Logger, logging.Handler]]:
    """The stream handlers (not files) that loggers other than meshrl's hold."""
    found = []
    for name, logger in list(logging.root.manager.loggerDict.items()):
        if not isinstance(logger, logging.Logger) or name == "meshrl" or name.startswith("meshrl."):
            continue
        found += [(logger, h) for h in logger.handlers
                  if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler)]
    return found


@contextmanager
def driver_output(log_dir: Path, *, verbose: bool) -> Iterator[Path | None]:
    """Inside the block, the driver's library output goes to ``log_dir/driver.log`` (module docstring); its
    path is printed once on entry. Yields ``log_dir``, or None with ``verbose`` (``trainer.verbose``), which
    leaves everything as it is.

    An ``Exception`` leaving the block gets a note naming ``log_dir`` (shown under its traceback). Every
    change is undone on exit, so one process may run several trainings.
    """
    if verbose:
        yield None
        return
    console = sys.stderr
    file = _open_log(log_dir / DRIVER_LOG, "driver")
    undo = _route(console, file)
    print(f"meshrl: library output (vLLM, Ray, Megatron, transformers, torch) goes to {log_dir}/; "
          "trainer.verbose=True shows it here", file=console, flush=True)
    try:
        yield log_dir
    except Exception as exc:
        exc.add_note(f"meshrl: the full output of the libraries and workers of this run is in {log_dir}/")
        raise
    finally:
        undo()
        file.close()


def route_worker_output(log_dir: Path, name: str) -> Path:
    """Send everything this worker process writes to ``log_dir/name`` from now on (module docstring); returns
    the file's path. For the whole process: first thing in a dedicated worker process; called again (a worker
    kept for another run: ``meshrl.workers.pool``), it points the output at the new file and nothing else changes.

    The process's stdout and stderr file descriptors are pointed at the file (library output, C++ warnings,
    child processes such as an engine's); the console's lines go to the stderr the process had before, which
    Ray forwards to the driver.
    """
    global _worker_console
    path = log_dir / name
    file = _open_log(path, path.stem)
    sys.stdout.flush()
    sys.stderr.flush()
    first = _worker_console is None
    if first:
        _worker_console = os.fdopen(os.dup(2), "w", buffering=1, encoding="utf-8")
    os.dup2(file.fileno(), 1)
    os.dup2(file.fileno(), 2)
    file.close()  # descriptors 1 and 2 keep the file open
    if first:
        _route(_worker_console, sys.stderr)
    return path


_worker_console: TextIO | None = None  # the stderr a routed worker process had first: its console
