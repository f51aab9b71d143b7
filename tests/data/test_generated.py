"""Generated (reasoning-gym) tasks: deterministic disjoint splits, verl layout, reward, caching."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from meshrl.data import generated
from meshrl.data import preprocess as pp
from meshrl.data.embedded import resolve_data_files
from meshrl.rewards.dispatch import default_compute_score

VERL_COLUMNS = ["data_source", "prompt", "ability", "reward_model", "extra_info"]


@pytest.fixture(scope="module")
def arith(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    written = pp.preprocess("arith", tmp_path_factory.mktemp("arith"), log=lambda _: None)
    assert list(written) == ["train", "test"]
    assert pq.read_schema(written["train"]).names == VERL_COLUMNS
    return {split: pq.read_table(path).to_pylist() for split, path in written.items()}


def test_splits_are_disjoint_distinct_and_sized(arith: dict[str, list[dict]]) -> None:
    train_q = [r["extra_info"]["question"] for r in arith["train"]]
    test_q = [r["extra_info"]["question"] for r in arith["test"]]
    assert (len(train_q), len(test_q)) == generated.GENERATED_TASKS["arith"].expected_sizes
    assert len(set(train_q)) == len(train_q) and len(set(test_q)) == len(test_q)
    assert not set(train_q) & set(test_q)


def test_rows_follow_the_task_options(arith: dict[str, list[dict]]) -> None:
    for split, rows in arith.items():
        for index, row in enumerate(rows):
            assert row["data_source"] == "reasoning_gym/basic_arithmetic"
            assert row["extra_info"]["split"] == split and row["extra_info"]["index"] == index
            assert row["prompt"] == [{"role": "user", "content": row["extra_info"]["question"]}]
            left, op, right = row["extra_info"]["expression"].split()
            # reasoning-gym's "1 digit" operands run from 0 to 10 inclusive.
            assert op in "+-*" and 0 <= int(left) <= 10 and 0 <= int(right) <= 10
            # The ground truth is the expression's value: the generator's answer is checked, not trusted.
            assert int(row["reward_model"]["ground_truth"]) == eval(f"{left} {op} {right}")  # noqa: S307


def test_every_ground_truth_scores_itself(arith: dict[str, list[dict]]) -> None:
    for row in arith["train"] + arith["test"]:
        truth, source = row["reward_model"]["ground_truth"], row["data_source"]
        assert default_compute_score(source, f"{row['extra_info']['expression']} = {truth}", truth) == 1.0
        # The last number counts: the right result followed by more talk with numbers is wrong.
        assert default_compute_score(source, f"= {truth}. Next, {truth} + 1000 = ...", truth) == 0.0


def test_rows_are_deterministic() -> None:
    assert pp.build_rows("arith", "test") == pp.build_rows("arith", "test")


def test_a_generator_that_changed_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    task = generated.GENERATED_TASKS["arith"]
    monkeypatch.setitem(generated.GENERATED_TASKS, "arith", dataclasses.replace(task, expected_sizes=(1, 1)))
    with pytest.raises(ValueError, match="generates differently"):
        pp.build_rows("arith", "train")


def test_embedded_resolution_is_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MESHRL_CACHE_DIR", str(tmp_path))
    (path,) = resolve_data_files("embedded:arith/test")
    assert path.is_file() and pq.read_metadata(path).num_rows == 64
    mtime = path.stat().st_mtime_ns
    assert resolve_data_files("embedded:arith/test") == [path] and path.stat().st_mtime_ns == mtime
    with pytest.raises(ValueError, match="has splits"):
        resolve_data_files("embedded:arith/validation")
