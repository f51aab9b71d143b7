"""Procedurally generated tasks (from the ``reasoning-gym`` package), split into disjoint train/test sets.

A registered task is a reasoning-gym generator with fixed options. Its rows are made the same way on
every machine: draw ``pool_size`` items with ``seed``, keep the first item of each distinct question,
sort by question and shuffle with ``random.Random(seed)``; the first ``test_size`` questions are the
*test* split, the rest *train*. So the splits never share a question, and a model's validation
score measures questions it has not been trained on.

``arith`` (the main job's task): ``Calculate a op b.`` with ``a, b`` in 0..10 (reasoning-gym's
"1 digit") and ``op`` in ``+ - *`` (no negation, no parentheses): 299 train and 64 test questions. SmolLM2-135M-Instruct
usually writes the right result first ("7 * 8 = 56") and then keeps talking until the token cap,
often ending on another number; scored on the last number of the response, it gets ~0.45 greedy
and ~0.25 at temperature 1 — a dense reward signal that GRPO can turn into "answer, then stop"
within a few steps.

Rows use verl's layout with ``data_source = "reasoning_gym/<generator>"`` and the generator's answer
as ground truth; :mod:`meshrl.rewards.dispatch` scores these numerically on the last number.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

from meshrl.rewards.dispatch import DATA_SOURCE_PREFIX  # the reward that scores these tasks names their source

GENERATOR_PACKAGE = "reasoning-gym"


@dataclass(frozen=True)
class GeneratedTask:
    """A reasoning-gym generator with fixed options and the split rule of the module docstring."""

    generator: str
    options: Mapping[str, Any]
    pool_size: int
    test_size: int
    seed: int = 1
    instruction: str = ""  # appended to the question, after a space, when non-empty
    expected_sizes: tuple[int, int] = field(default=(0, 0))  # (train, test), checked when building

    @property
    def data_source(self) -> str:
        return DATA_SOURCE_PREFIX + self.generator


GENERATED_TASKS: dict[str, GeneratedTask] = {
    "arith": GeneratedTask(
        generator="basic_arithmetic",
        options={
            "min_terms": 2,
            "max_terms": 2,
            "min_digits": 1,
            "max_digits": 1,
            "operators": ("+", "-", "*"),
            "allow_parentheses": False,
            "allow_negation": False,
        },
        pool_size=5000,
        test_size=64,
        expected_sizes=(299, 64),
    ),
}


def _generator_version() -> str:
    try:
        return metadata.version(GENERATOR_PACKAGE)
    except metadata.PackageNotFoundError:
        raise ModuleNotFoundError(
            f"Generated tasks need the '{GENERATOR_PACKAGE}' package: pip install -e . installs it."
        ) from None


def fingerprint(name: str) -> str:
    """Identifies the rows of task ``name``: generator version, options, sizes and seed.

    reasoning-gym's output for a seed may change between versions, so the version is part of it.
    """
    task = GENERATED_TASKS[name]
    options = ",".join(f"{k}={v!r}" for k, v in sorted(task.options.items()))
    return (
        f"{GENERATOR_PACKAGE}=={_generator_version()}:{task.generator}({options}):"
        f"pool={task.pool_size}:test={task.test_size}:seed={task.seed}:instruction={task.instruction!r}"
    )


def build_generated_rows(name: str, split: str) -> list[dict[str, Any]]:
    """Rows of split ``'train'`` or ``'test'`` of registered task ``name`` (rule: module docstring).

    Raises:
        ValueError: the split sizes differ from the registered ones (a reasoning-gym version that
            generates differently; the message says so rather than training on other data silently).
    """
    if split not in ("train", "test"):
        raise ValueError(f"generated task {name!r} has splits ['train', 'test'], not {split!r}")
    _generator_version()
    import reasoning_gym  # imported here: it loads dozens of task modules, needed only to build rows

    task = GENERATED_TASKS[name]
    items = reasoning_gym.create_dataset(task.generator, size=task.pool_size, seed=task.seed, **task.options)
    first_by_question: dict[str, dict[str, Any]] = {}
    for item in items:
        first_by_question.setdefault(item["question"], item)
    distinct = sorted(first_by_question.values(), key=lambda item: item["question"])
    random.Random(task.seed).shuffle(distinct)
    test, train = distinct[: task.test_size], distinct[task.test_size:]
    if task.expected_sizes != (len(train), len(test)):
        raise ValueError(
            f"generated task {name!r}: {len(train)} train / {len(test)} test questions, expected "
            f"{task.expected_sizes[0]} / {task.expected_sizes[1]}; the installed {GENERATOR_PACKAGE} "
            f"{_generator_version()} generates differently from the pinned one (see setup.py)."
        )
    chosen = train if split == "train" else test
    suffix = f" {task.instruction}" if task.instruction else ""
    return [
        {
            "data_source": task.data_source,
            "prompt": [{"role": "user", "content": item["question"] + suffix}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(item["answer"])},
            "extra_info": {
                "split": split,
                "index": index,
                "question": item["question"],
                "answer": str(item["answer"]),
                "expression": item["metadata"].get("expression", ""),
            },
        }
        for index, item in enumerate(chosen)
    ]
