"""Crash-safe writes of a file or a whole folder: readers see the old version or the new one, never a mix.

``write_text_atomically`` and ``publish_dir`` follow one contract (``cached_dir``, for caches that several
processes may build at once, the first and third steps, under a lock):

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

import fcntl
import os
import shutil
from pathlib import Path
from typing import Callable


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


def cached_dir(final: Path, complete: str, build: Callable[[Path], None]) -> Path:
    """The cache folder ``final``, built once by ``build(tmp)`` into a temporary beside it and renamed into place;
    complete when its file ``complete`` exists. Several processes may ask at once (the ranks of a launch, two test
    processes): one builds under an exclusive lock on ``<final>.lock`` while the others wait for it, then find the
    folder complete. A complete folder is never removed or replaced (another process may be reading it); an
    incomplete one (an interrupted writer's) is. The same folder in the same place: no fsync (a cache)."""
    if (final / complete).is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with open(final.with_name(final.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if (final / complete).is_file():  # built by another process while this one waited
            return final
        tmp = final.with_name(f"{final.name}.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            build(tmp)
            if not (tmp / complete).is_file():  # e.g. transformers' save_pretrained writes nothing on a rank != 0
                raise RuntimeError(f"building the cache folder {final.name} wrote no {complete}; build it in one "
                                   "process (transformers saves a model only on torch.distributed rank 0)")
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
    return final


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
