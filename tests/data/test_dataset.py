"""RLDataset on the real GSM8K test file with SmolLM2's chat template: ids, filtering, truncation, errors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from meshrl.data.dataset import DataFormatError, PromptTooLongError, RLDataset, truncate


@pytest.fixture(scope="module")
def full(gsm8k_dir: Path, tokenizer) -> RLDataset:
    return RLDataset(gsm8k_dir / "test.parquet", tokenizer, max_prompt_length=4096)


def test_ids_match_chat_template_and_metadata(full: RLDataset, tokenizer) -> None:
    assert len(full) == 1319 and full.num_filtered == 0 and full.num_truncated == 0
    for i in (0, 17, 1318):
        sample = full[i]
        expected = tokenizer.apply_chat_template(
            sample.messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        assert sample.prompt_ids == expected
        assert tokenizer.decode(sample.prompt_ids).endswith("<|im_start|>assistant\n")
        assert sample.data_source == "openai/gsm8k" and sample.row == i
        assert sample.extra_info["index"] == i and sample.extra_info["split"] == "test"
    assert full[0].ground_truth == "18"
    batch = full.get_batch([3, 1])
    assert batch.ground_truths == [full[3].ground_truth, full[1].ground_truth]
    assert batch.prompt_ids[1] == full[1].prompt_ids and batch.data_sources == ["openai/gsm8k"] * 2


def test_filter_overlong(gsm8k_dir: Path, tokenizer, full: RLDataset) -> None:
    limit = int(np.percentile(full.prompt_lengths, 90))
    ds = RLDataset(gsm8k_dir / "test.parquet", tokenizer, max_prompt_length=limit, filter_overlong_prompts=True)
    assert ds.num_filtered == int((full.prompt_lengths > limit).sum()) > 0
    assert len(ds) + ds.num_filtered == 1319
    assert ds.prompt_lengths.max() <= limit
    kept = [i for i in range(1319) if full.prompt_lengths[i] <= limit]
    assert [ds[j].row for j in range(len(ds))] == kept


def test_truncation_error_names_file_row_length(gsm8k_dir: Path, tokenizer, full: RLDataset) -> None:
    limit = int(np.percentile(full.prompt_lengths, 99))
    first = int(np.flatnonzero(full.prompt_lengths > limit)[0])
    path = gsm8k_dir / "test.parquet"
    with pytest.raises(PromptTooLongError) as err:
        RLDataset(path, tokenizer, max_prompt_length=limit, filter_overlong_prompts=False, truncation="error")
    message = str(err.value)
    assert str(path) in message and f"row {first} " in message
    assert f"{full.prompt_lengths[first]} tokens" in message and f"max_prompt_length={limit}" in message


@pytest.mark.parametrize("mode", ["left", "right", "middle"])
def test_truncation_modes(gsm8k_dir: Path, tokenizer, full: RLDataset, mode: str) -> None:
    limit = 64
    ds = RLDataset(
        gsm8k_dir / "test.parquet", tokenizer, max_prompt_length=limit, filter_overlong_prompts=False, truncation=mode
    )
    assert len(ds) == 1319 and ds.prompt_lengths.max() == limit
    assert ds.num_truncated == int((full.prompt_lengths > limit).sum())
    ids, cut = full[0].prompt_ids, ds[0].prompt_ids
    expected = {"left": ids[-limit:], "right": ids[:limit], "middle": ids[:32] + ids[-32:]}[mode]
    assert cut == expected


def test_truncate_odd_middle() -> None:
    assert truncate(list(range(10)), 5, "middle") == [0, 1, 2, 8, 9]
    assert truncate([1, 2], 5, "left") == [1, 2]
    with pytest.raises(ValueError):
        truncate(list(range(10)), 5, "error")


def _good_row(i: int) -> dict:
    return {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": f"What is {i} + 1?"}],
        "reward_model": {"style": "rule", "ground_truth": str(i + 1)},
        "extra_info": {"index": i},
    }


def test_malformed_rows_reported_with_file_and_row(tmp_path: Path, tokenizer) -> None:
    rows = [_good_row(i) for i in range(8)]
    del rows[1]["reward_model"]
    rows[2]["prompt"] = "a plain string"
    rows[3]["data_source"] = 7
    rows[5]["prompt"] = [{"role": "user"}]
    rows[6]["reward_model"] = {"ground_truth": ["a", "list"]}
    path = tmp_path / "bad.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DataFormatError) as err:
        RLDataset(path, tokenizer)
    message = str(err.value)
    assert message.startswith(f"5 malformed row(s) in {path}")
    expected = [
        (1, "reward_model"),
        (2, "'prompt' must be a non-empty list"),
        (3, "'data_source' must be a string"),
        (5, "prompt[0] must be"),
        (6, "ground_truth must be a string or number"),
    ]
    for row, why in expected:
        assert f"{path}, row {row}: " in message and why in message
    assert "row 0:" not in message and "Traceback" not in message


def test_jsonl_and_parquet_inputs_and_numbers(tmp_path: Path, tokenizer) -> None:
    rows = [_good_row(i) for i in range(3)]
    rows[0]["reward_model"]["ground_truth"] = 1  # numeric ground truths are read as strings
    rows[1]["extra_info"] = None
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    pq.write_table(pa.Table.from_pylist([_good_row(10)]), tmp_path / "b.parquet")
    ds = RLDataset([tmp_path / "a.jsonl", tmp_path / "b.parquet"], tokenizer)
    assert len(ds) == 4
    assert ds[0].ground_truth == "1" and ds[1].extra_info == {} and ds[3].ground_truth == "11"
    assert ds[3].source_file.endswith("b.parquet") and ds[3].row == 0


def test_bad_arguments_and_files(tmp_path: Path, tokenizer) -> None:
    with pytest.raises(ValueError, match="data.truncation must be one of"):
        RLDataset(tmp_path / "x.parquet", tokenizer, truncation="both")
    with pytest.raises(FileNotFoundError, match="meshrl.data.preprocess"):
        RLDataset(tmp_path / "missing.parquet", tokenizer)
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(DataFormatError, match="unsupported file type '.csv'"):
        RLDataset(tmp_path / "x.csv", tokenizer)
    (tmp_path / "one.jsonl").write_text(json.dumps(_good_row(0)) + "\n")
    with pytest.raises(ValueError, match="no prompts left"):
        RLDataset(tmp_path / "one.jsonl", tokenizer, max_prompt_length=3)


def test_tokenizer_without_chat_template(tmp_path: Path, tokenizer) -> None:
    (tmp_path / "one.jsonl").write_text(json.dumps(_good_row(0)) + "\n")
    template = tokenizer.chat_template
    try:
        tokenizer.chat_template = None
        with pytest.raises(ValueError, match="has no chat template"):
            RLDataset(tmp_path / "one.jsonl", tokenizer)
    finally:
        tokenizer.chat_template = template
