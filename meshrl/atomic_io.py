"""Crash-safe writes of a file or a whole folder: readers see the old version or the new one, never a mix.

``write_text_atomically`` and ``publish_dir`` follow one contract (``publish_cached_dir``, for caches that
several processes build at once, the first three steps):

1. the new version is written under a temporary name in the *same* folder as the target (a rename
   is atomic only within one filesystem);
2. it is fsynced (the file, or every file and folder of a new tree), so its bytes reach the disk
   before its name does;
3. it is renamed onto the target (``os.replace``, atomic on POSIX);
4. the parent folder is fsynced, so the rename itself survives a power loss.

A crash before step 3 leaves the previous version intact under the target name, plus the temporary,
which the caller names and therefore knows how to clean up; after step 4 the new version is durable.

This module sits below every layer (it knows only the filesystem), so the parallel layer's
checkpoints and exports and the trainer's checkpoint folders share it.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def write_text_atomically(path: Path, text: str, *, tmp: Path | None = None) -> None:
    """Replace file ``path`` with ``text`` following the module's contract.

    ``tmp`` is the temporary file (default ``<name>.tmp-<pid>`` beside ``path``; the pid keeps two
    processes writing the same target from sharing one temporary). It must be in ``path``'s folder.
    """
    path = Path(path)
    tmp = Path(tmp) if tmp is not None else path.with_name(f"{path.name}.tmp-{os.getpid()}")
    if tmp.parent != path.parent:
        raise ValueError(f"temporary {tmp} must be in the folder of {path}, or the rename is not atomic")
    with open(tmp, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    _fsync(path.parent)


def publish_dir(tmp: Path, final: Path, *, aside: Path) -> None:
    """Move the finished folder ``tmp`` to ``final`` following the module's contract (fsync included).

    ``os.replace`` cannot overwrite a non-empty folder, so an existing ``final`` is first renamed to
    ``aside`` and deleted only after ``tmp`` took its place. A crash between those two renames leaves
    no ``final``, the previous version whole under ``aside``, and the new one whole under ``tmp``:
    name ``aside`` so that the caller's clean-up of temporaries recognises it. ``tmp`` and ``aside``
    must be in ``final``'s folder.
    """
    tmp, final, aside = Path(tmp), Path(final), Path(aside)
    if not tmp.parent == aside.parent == final.parent:
        raise ValueError(f"{tmp} and {aside} must be in the folder of {final}, or the renames are not atomic")
    _fsync_tree(tmp)
    replaced = final.exists()
    if replaced:
        os.replace(final, aside)
    os.replace(tmp, final)
    _fsync(final.parent)
    if replaced:
        shutil.rmtree(aside)


def publish_cached_dir(tmp: Path, final: Path, complete: Path) -> None:
    """Publish the finished folder ``tmp`` as the cache entry ``final`` that several processes may build at once
    (the ranks of a launch, two test processes): the first to publish wins, the others discard their ``tmp``. A
    complete entry (its file ``complete`` exists) is never removed, since another process may be reading it; an
    incomplete one (left by an interrupted writer) is. The same folder in the same place: no fsync (a cache)."""
    if not complete.is_file():
        shutil.rmtree(final, ignore_errors=True)
    try:
        os.replace(tmp, final)
    except OSError:  # published meanwhile by another process (a rename onto a non-empty folder fails)
        shutil.rmtree(tmp, ignore_errors=True)
        if not complete.is_file():
            raise


def _fsync(path: Path) -> None:
    """fsync a file or a folder (a folder's fsync makes the names in it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    """fsync every file and folder under ``root``, each folder after its contents, ``root`` last."""
    for dirpath, _, filenames in os.walk(root, topdown=False):
        for name in filenames:
            _fsync(Path(dirpath, name))
        _fsync(Path(dirpath))
