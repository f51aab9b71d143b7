"""``data.train_files`` / ``data.val_files`` entries → parquet paths, with the packaged datasets by name.

``embedded:<dataset>/<split>`` (e.g. ``embedded:gsm8k/train``, ``embedded:math500/test``) is the
split written by ``meshrl.data.preprocess`` into the project cache on first use; any other entry is
a path (``~`` expanded) that must exist — a missing one is an error that names the preprocess command.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from meshrl.runtime import cache_dir

PREFIX = "embedded:"


def resolve_data_files(files: str | Sequence[str]) -> list[Path]:
    entries = [files] if isinstance(files, str) else list(files)
    return [_resolve(str(entry)) for entry in entries]


def _resolve(entry: str) -> Path:
    if entry.startswith(PREFIX):
        from meshrl.data.preprocess import preprocess, splits_of

        dataset, _, split = entry[len(PREFIX):].partition("/")
        if split not in splits_of(dataset):
            raise ValueError(f"'{entry}': dataset {dataset!r} has splits {splits_of(dataset)}")
        return preprocess(dataset, cache_dir() / "data" / dataset, log=lambda _: None)[split]
    path = Path(entry).expanduser()
    if not path.is_file():
        guess = next((d for d in ("gsm8k", "math500", "math", "mawps", "arith") if d in entry), "gsm8k")
        raise FileNotFoundError(
            f"data file {path} does not exist. Write it with `python -m meshrl.data.preprocess {guess} "
            f"--local_dir {path.parent}`, or use '{PREFIX}{guess}/{path.stem}'.")
    return path
