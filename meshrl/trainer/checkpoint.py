"""Driver-side checkpoint folders: atomic saves, rotation, and verl's resume semantics.

Layout under ``trainer.default_local_dir`` (verl's names, so verl users find what they expect)::

    latest_checkpointed_iteration.txt    the step of the checkpoint written last, e.g. "120"
    global_step_120/
        actor/ critic/ ...               the parts, written by the workers (``write_parts``); with
                                         ``hf_model`` in a role's ``checkpoint.save_contents``,
                                         ``<role>/huggingface/`` also holds its HF export (verl's place;
                                         with LoRA the merged weights, the PEFT adapter in ``actor/lora_adapter/``)
        trainer_state.pt                 the driver's state dict (torch.save), authoritative
        trainer_state.json               a human-readable view of it (scalars; tensors summarised)
        COMPLETE                         written last: the folder holds a whole checkpoint, whose parts the
                                         workers checked finite (``meshrl.parallel.checkpoint``); it lists
                                         every file's size, so a file cut later (a partial copy, a full
                                         disk while copying) is named before a resume starts any worker
        PRUNED                           only where rotation removed a part (it lists them): no longer resumable

A save builds everything in ``global_step_N.tmp-<pid>``, fsyncs it, and renames it into place
(``meshrl.atomic_io``), so a ``global_step_N`` folder appears whole or not at all; the ``latest``
pointer moves only afterwards, replaced the same way.
A crash at any point leaves the previous checkpoint and pointer as they were; the half-written
``*.tmp-<pid>`` folder is removed by the next manager start. So does a part that refuses to be written
(a worker whose weights hold NaN or inf): the error then says which checkpoint is still the latest, and
rotation, which runs only after a save, has removed nothing.

Driver state is loaded with ``torch.load(weights_only=True)`` plus NumPy arrays and scalars (the RNG
states), so resuming never runs code from a checkpoint file. A save checks the state loads back that
way before marking the folder complete: a state the resume could not read fails at the first save,
not hours later at resume time.
"""

from __future__ import annotations

import json
import math
import logging
import os
import re
import shutil
from collections.abc import Callable, Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import torch

from meshrl.atomic_io import publish_dir, write_text_atomically
from meshrl.config.checkpoint_contents import KEEP_KEYS
from meshrl.config.schema import RESUME_MODES

logger = logging.getLogger(__name__)

LATEST_FILE = "latest_checkpointed_iteration.txt"
COMPLETE_MARKER = "COMPLETE"
DRIVER_STATE_PT = "trainer_state.pt"
DRIVER_STATE_JSON = "trainer_state.json"
PRUNED_MARKER = "PRUNED"

_STEP_DIR = re.compile(r"global_step_(\d+)")
# The temporary names this module creates; nothing else in a shared run folder is touched.
_TMP_NAME = re.compile(rf"(?:global_step_\d+|{re.escape(LATEST_FILE)})\.tmp-(\d+)(?:-\w+)?")

# What weights_only unpickling needs beyond torch's defaults to read NumPy arrays and scalars (the
# legacy NumPy RNG state is an array); found through pickling itself, so NumPy 1.x and 2.x both work.
_NUMPY_SAFE_GLOBALS = [
    np.arange(1).__reduce__()[0],
    np.float32(0).__reduce__()[0],
    np.ndarray,
    np.dtype,
    *(getattr(np.dtypes, name) for name in np.dtypes.__all__),
]

_PLAIN_DATA = (
    "Driver state must be plain data (dicts, lists, numbers, strings, tensors, NumPy arrays); "
    "convert objects with their state_dict()."
)


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, incomplete, or unreadable; the message names the folder."""


def step_of(path: Path) -> int | None:
    """N for a folder named ``global_step_N``; None for any other name (temporary folders included)."""
    match = _STEP_DIR.fullmatch(Path(path).name)
    return int(match.group(1)) if match else None


def is_complete(path: Path) -> bool:
    """True when ``path`` is a ``global_step_N`` folder whose save finished (marker and driver state present)."""
    path = Path(path)
    return step_of(path) is not None and (path / COMPLETE_MARKER).is_file() and (path / DRIVER_STATE_PT).is_file()


def pruned_parts(path: Path) -> list[str]:
    """The parts rotation removed from checkpoint ``path`` (empty for a whole checkpoint)."""
    marker = Path(path) / PRUNED_MARKER
    return json.loads(marker.read_text()) if marker.is_file() else []


def parts_to_keep(trainer: Any) -> dict[str, int | None]:
    """How many of each checkpoint part to keep: ``trainer.max_actor_ckpt_to_keep`` / ``max_critic_ckpt_to_keep``."""
    return {"actor": trainer.max_actor_ckpt_to_keep, "critic": trainer.max_critic_ckpt_to_keep}


class CheckpointManager:
    """Saves, rotates and finds the checkpoints under one root folder (``trainer.default_local_dir``).

    Args:
        root: the checkpoint root; created if missing.
        keep: per part (a subfolder the workers write: ``actor``, ``critic``), how many checkpoints keep it
            (``parts_to_keep``); None or 0 keeps all, as verl. After each save a part is removed from the
            lowest steps beyond its count (the checkpoint just written always keeps everything); such a
            checkpoint is marked ``PRUNED`` and is no longer resumable, and one left with no part is
            deleted. With one count for every part (or one part) whole checkpoints simply rotate.
            Incomplete folders are neither counted nor deleted.

    Starting a manager removes ``*.tmp-<pid>`` leftovers of killed saves (those of a live process other
    than this one are left alone, with a warning: two trainers are writing the same root).
    """

    def __init__(self, root: Path, keep: Mapping[str, int | None] | None = None) -> None:
        for part, count in (keep or {}).items():
            if count is not None and count < 0:
                raise ValueError(f"{KEEP_KEYS.get(part, part)} must be None or >= 0, got {count}")
        self.root = Path(root).expanduser()
        self.keep = {part: count for part, count in (keep or {}).items() if count}
        self.root.mkdir(parents=True, exist_ok=True)
        self._remove_stale_temporaries()

    # ---------------------------------------------------------------- saving

    def save(self, step: int, driver_state: dict[str, Any], write_parts: Callable[[Path], None]) -> Path:
        """Write checkpoint ``global_step_<step>`` atomically and return its path.

        ``write_parts(tmp_dir)`` writes the workers' parts (``actor/``, ``critic/``, ...) into the
        temporary folder; then the driver state, the ``COMPLETE`` marker, fsync of every file and folder
        and the rename into place, the ``latest`` pointer (itself replaced atomically) and rotation follow.
        An exception before the rename removes the temporary folder, leaves the previous checkpoint
        and pointer untouched, and is re-raised with a note naming the latest checkpoint. Saving a step
        that already has a folder replaces it.

        Raises:
            CheckpointError: ``driver_state`` holds a type the resume could not load (named).
        """
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        final = self.root / f"global_step_{step}"
        tmp = self.root / f"{final.name}.tmp-{os.getpid()}"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        try:
            write_parts(tmp)
            _save_state_file(driver_state, tmp / DRIVER_STATE_PT)
            (tmp / DRIVER_STATE_JSON).write_text(json.dumps(_json_view(driver_state), indent=2) + "\n")
            marker = {"step": step, "completed_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                      "files": _file_sizes(tmp)}
            (tmp / COMPLETE_MARKER).write_text(json.dumps(marker) + "\n")
            # An old folder of the same step (a run resumed from an earlier step, or an incomplete copy)
            # moves aside under a temporary name that the next start removes.
            publish_dir(tmp, final, aside=self.root / f"{final.name}.tmp-{os.getpid()}-replaced")
        except BaseException as err:
            shutil.rmtree(tmp, ignore_errors=True)
            err.add_note(f"checkpoint {final} was not saved; the latest checkpoint is still {self.latest() or 'none'}")
            raise
        # The default temporary name (<name>.tmp-<pid>) is one _remove_stale_temporaries knows.
        write_text_atomically(self.root / LATEST_FILE, f"{step}\n")
        self._rotate(newest=final)
        logger.info("saved checkpoint %s", final)
        return final

    def _rotate(self, newest: Path) -> None:
        for part, count in self.keep.items():
            holding = [p for p in self.checkpoints() if p != newest and (p / part).is_dir()]
            # The newest count - 1 others keep the part, plus the one just written.
            for path in holding[: max(0, len(holding) - (count - 1))]:
                self._prune(path, part)
                logger.info("removed %s/%s (%s=%d)", path, part, KEEP_KEYS.get(part, part), count)
        for path in self.checkpoints():
            if path != newest and pruned_parts(path) and not any(p.is_dir() for p in path.iterdir()):
                self._delete(path)
                logger.info("removed old checkpoint %s (no part left)", path)

    def _prune(self, path: Path, part: str) -> None:
        # Marked before the part goes, so a folder missing a part always says so.
        write_text_atomically(path / PRUNED_MARKER, json.dumps(sorted({*pruned_parts(path), part})) + "\n")
        trash = self.root / f"{path.name}.tmp-{os.getpid()}-{part}"
        os.replace(path / part, trash)
        shutil.rmtree(trash)

    def _delete(self, path: Path) -> None:
        # Renamed before deletion so an interrupted delete never leaves a folder that looks whole.
        trash = self.root / f"{path.name}.tmp-{os.getpid()}-deleting"
        os.replace(path, trash)
        shutil.rmtree(trash)

    # ---------------------------------------------------------------- finding

    def checkpoints(self) -> list[Path]:
        """Complete checkpoint folders under the root, by step."""
        return complete_checkpoints(self.root)

    def latest(self) -> Path | None:
        """The checkpoint to resume from automatically, or None when there is none.

        The ``latest`` pointer wins (after a resume from an earlier step it names the newest write, not
        the highest step). Without a usable pointer (missing, unparsable, or naming a folder that is gone,
        incomplete or pruned) the highest complete, unpruned step is used, with a warning naming what was
        skipped.
        """
        return _latest_in(self.root)

    def resolve(self, resume_mode: str, resume_from_path: str | Path | None = None) -> Path | None:
        """The checkpoint a run starts from (``resolve_checkpoint`` under this root)."""
        return resolve_checkpoint(self.root, resume_mode, resume_from_path)

    def load_driver_state(self, path: Path) -> dict[str, Any]:
        """The driver state dict saved in checkpoint folder ``path`` (as given to :meth:`save`).

        Raises:
            CheckpointError: the folder is missing or incomplete, or its state file is unreadable.
        """
        return read_driver_state(path)

    # ---------------------------------------------------------------- start-up

    def _remove_stale_temporaries(self) -> None:
        for path in self.root.iterdir():
            match = _TMP_NAME.fullmatch(path.name)
            if match is None:
                continue
            pid = int(match.group(1))
            if pid != os.getpid() and psutil.pid_exists(pid):
                logger.warning("leaving %s: process %d is alive and may be saving into this root", path, pid)
                continue
            logger.info("removing %s, left by an interrupted save", path)
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)


def read_driver_state(path: Path) -> dict[str, Any]:
    """The driver state dict saved in complete checkpoint folder ``path``.

    Raises:
        CheckpointError: the folder is missing or incomplete, or its state file is unreadable.
    """
    path = Path(path)
    _require_complete(path)
    return _load_state_file(path / DRIVER_STATE_PT)


def resolve_checkpoint(root: Path, resume_mode: str, resume_from_path: str | Path | None = None) -> Path | None:
    """The checkpoint a run in ``root`` starts from, with verl's ``trainer.resume_mode`` semantics.

    ``auto``: the latest (``CheckpointManager.latest``; None: start from scratch, also when ``root`` does not exist
    yet). ``disable``: None. ``resume_path``: ``resume_from_path``, which must be a complete ``global_step_N`` folder.

    Raises:
        ValueError: unknown mode, or ``resume_path`` without a path.
        CheckpointError: the path is missing or not a complete checkpoint (the message names it).
    """
    if resume_mode == "disable":
        return None
    if resume_mode == "auto":
        return _latest_in(root) if root.is_dir() else None
    if resume_mode != "resume_path":
        raise ValueError(f"trainer.resume_mode={resume_mode!r} is not one of {', '.join(RESUME_MODES)}")
    if not resume_from_path:
        raise ValueError("trainer.resume_mode=resume_path needs trainer.resume_from_path (a global_step_N folder)")
    path = Path(resume_from_path).expanduser()
    _require_complete(path)
    return path


def damaged_files(path: Path) -> list[str]:
    """The files of complete checkpoint ``path`` that differ from what its save wrote (``COMPLETE`` lists every
    file's size): ``'<file>: missing'`` / ``'<file>: <n> bytes, its save wrote <m>'``. Empty for a checkpoint saved
    before the sizes were listed: only loading it can tell."""
    written = json.loads((Path(path) / COMPLETE_MARKER).read_text()).get("files", {})
    problems = []
    for name, size in written.items():
        file = Path(path) / name
        if not file.is_file():
            problems.append(f"{file}: missing")
        elif (now := file.stat().st_size) != size:
            problems.append(f"{file}: {now} bytes, its save wrote {size}")
    return problems


def _file_sizes(folder: Path) -> dict[str, int]:
    return {str(file.relative_to(folder)): file.stat().st_size
            for file in sorted(folder.rglob("*")) if file.is_file() and not file.is_symlink()}


def complete_checkpoints(root: Path) -> list[Path]:
    """The complete ``global_step_N`` folders in ``root``, by step."""
    return sorted((p for p in root.iterdir() if p.is_dir() and is_complete(p)), key=step_of)


def _latest_in(root: Path) -> Path | None:
    pointer = root / LATEST_FILE
    if pointer.is_file():
        text = pointer.read_text().strip()
        target = root / f"global_step_{text}"
        if text.isdigit() and is_complete(target) and not pruned_parts(target):
            return target
        logger.warning(
            "%s names %r, which is not a complete checkpoint or was pruned (%s); falling back to the highest whole one",
            pointer, text, target,
        )
    whole = [p for p in complete_checkpoints(root) if not pruned_parts(p)]
    return whole[-1] if whole else None


def _require_complete(path: Path) -> None:
    if not path.is_dir():
        raise CheckpointError(f"checkpoint folder {path} does not exist" + (" (it is a file)" if path.exists() else ""))
    if step_of(path) is None:
        latest = _latest_in(path)
        hint = f" It looks like a checkpoint root; did you mean {latest}?" if latest else ""
        raise CheckpointError(f"{path} is not a checkpoint folder (expected a global_step_N folder).{hint}")
    if not is_complete(path):
        missing = [name for name in (COMPLETE_MARKER, DRIVER_STATE_PT) if not (path / name).is_file()]
        raise CheckpointError(
            f"checkpoint {path} is incomplete (missing {', '.join(missing)}): its save did not finish, it was "
            "copied partially, or another tool wrote it. Resume from another global_step_N folder."
        )
    pruned = pruned_parts(path)
    if pruned:
        latest = _latest_in(path.parent)
        raise CheckpointError(
            f"checkpoint {path} no longer holds its {', '.join(pruned)} part ("
            + ", ".join(f"removed by {KEEP_KEYS.get(part, part)}" for part in pruned)
            + "). Resume from a whole checkpoint" + (f", e.g. {latest}." if latest else ".")
        )


def _save_state_file(state: dict[str, Any], path: Path) -> None:
    """torch.save, then the resume's own load, so a state the resume could not read fails now."""
    try:
        torch.save(state, path)
    except Exception as err:
        raise CheckpointError(f"cannot save the driver state: {err}. {_PLAIN_DATA}") from err
    _load_state_file(path)


def _load_state_file(path: Path) -> dict[str, Any]:
    try:
        with torch.serialization.safe_globals(_NUMPY_SAFE_GLOBALS):
            return torch.load(path, weights_only=True)
    except Exception as err:
        unsupported = re.search(r"GLOBAL (\S+)", str(err))
        if unsupported:
            raise CheckpointError(f"cannot load the driver state {path}: it holds {unsupported.group(1)}. "
                                  f"{_PLAIN_DATA}") from err
        # Not a type the state may not hold: the file itself is unreadable (cut short, overwritten)
        raise CheckpointError(f"cannot load the driver state {path}: {str(err).splitlines()[0]}; the file is "
                              "damaged") from err


def _json_view(value: Any) -> Any:
    """JSON-safe view of the state for people: tensors and long lists summarised, non-finite floats as null."""
    if isinstance(value, dict):
        return {str(k): _json_view(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        if len(value) > 16:
            return f"<{type(value).__name__} of {len(value)}>"
        return [_json_view(v) for v in value]
    if isinstance(value, (torch.Tensor, np.ndarray)):
        if math.prod(value.shape) == 1:
            return _json_view(value.item())
        return f"<{type(value).__name__} {list(value.shape)} {value.dtype}>"
    if isinstance(value, np.generic):
        return _json_view(value.item())
    if isinstance(value, float):
        return value if np.isfinite(value) else None
    if value is None or isinstance(value, (bool, int, str)):
        return value
    return f"<{type(value).__name__}>"

