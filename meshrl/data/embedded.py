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
        raise FileNotFoundError(_missing(path))
    return path


def _missing(path: Path) -> str:
    """Why ``path`` is no data file, and the preprocess command or ``embedded:`` name that makes it only when the
    path is one preprocess writes (``<dataset>/<split>.parquet``): a guess from any other path misleads."""
    import shlex

    from meshrl.data.preprocess import LOCAL_COPIES, PACKAGED, splits_of

    if path.exists():
        return f"data file {path} is a folder; give a .parquet or .jsonl file in it"
    where = "" if path.parent.is_dir() else f" (nor does its folder {path.parent})"
    dataset = path.parent.name
    if path.suffix == ".parquet" and dataset in PACKAGED and path.stem in splits_of(dataset):
        return (f"data file {path} does not exist{where}. Write it with `python -m meshrl.data.preprocess {dataset} "
                f"--local_dir {shlex.quote(str(path.parent))}`, or use '{PREFIX}{dataset}/{path.stem}'")
    if path.suffix == ".parquet" and dataset in LOCAL_COPIES:
        return (f"data file {path} does not exist{where}. Write it with `python -m meshrl.data.preprocess {dataset} "
                f"--local_dataset_path <a local copy of the hub's files> --local_dir {shlex.quote(str(path.parent))}`")
    return (f"data file {path} does not exist{where}; check the path (the packaged sets are "
            f"'{PREFIX}<dataset>/<split>' with <dataset> one of {', '.join(PACKAGED)})")
