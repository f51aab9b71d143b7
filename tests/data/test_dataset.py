"""RLDataset on the real GSM8K test file with SmolLM2's chat template: ids, filtering, truncation, errors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from meshrl.data.dataset import UNKNOWN_SOURCE, DataFormatError, PromptTooLongError, RLDataset, load_datasets, truncate


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


def _config(tmp_path: Path, *overrides: str):
    from meshrl.config import load_config

    return load_config([f"data.train_files={tmp_path / 'train.jsonl'}", f"data.val_files={tmp_path / 'val.jsonl'}",
                        *overrides])


def _write(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_apply_chat_template_kwargs_reach_the_template(tmp_path: Path, smollm2_dir: Path) -> None:
    """data.apply_chat_template_kwargs (verl's key) go to apply_chat_template, e.g. Qwen3's enable_thinking."""
    from transformers import AutoTokenizer

    thinking = AutoTokenizer.from_pretrained(smollm2_dir)  # its own copy: the template is changed below
    thinking.chat_template += "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}"
    _write(tmp_path / "train.jsonl", [_good_row(i) for i in range(3)])
    _write(tmp_path / "val.jsonl", [_good_row(9)])
    plain, _ = load_datasets(_config(tmp_path).data, thinking)
    off, val = load_datasets(_config(tmp_path, "+data.apply_chat_template_kwargs.enable_thinking=false").data,
                             thinking)
    assert not thinking.decode(plain[0].prompt_ids).endswith("<think></think>")
    for sample in (off[0], off[2], val[0]):
        assert thinking.decode(sample.prompt_ids).endswith("assistant\n<think></think>")


def test_reward_fn_key_names_the_column_that_picks_the_reward(tmp_path: Path, tokenizer) -> None:
    rows = [{**_good_row(i), "ability": f"skill{i}"} for i in range(3)]
    del rows[2]["data_source"]  # another reward key makes data_source optional, as in verl
    _write(tmp_path / "train.jsonl", rows)
    _write(tmp_path / "val.jsonl", rows[:1])
    train, _ = load_datasets(_config(tmp_path, "data.reward_fn_key=ability").data, tokenizer)
    batch = train.get_batch([0, 2])
    assert batch.reward_sources == ["skill0", "skill2"] and batch.data_sources == ["openai/gsm8k", UNKNOWN_SOURCE]
    rows[1]["ability"] = 3
    _write(tmp_path / "train.jsonl", rows)
    with pytest.raises(DataFormatError, match=r"row 1: field 'ability' \(data.reward_fn_key names it\) must be a "
                                              r"string, got int"):
        load_datasets(_config(tmp_path, "data.reward_fn_key=ability").data, tokenizer)
    with pytest.raises(DataFormatError, match=r"row 2: field 'data_source' must be a string"):
        load_datasets(_config(tmp_path).data, tokenizer)


@pytest.mark.parametrize("shuffle", [True, False])
def test_max_samples_pick_rows_as_verl(tmp_path: Path, tokenizer, shuffle: bool) -> None:
    """train_max_samples / val_max_samples: N rows of all files together, drawn with data.seed when
    data.shuffle (np.random.default_rng(seed).choice, in the drawn order) else the first N, before filtering."""
    _write(tmp_path / "a.jsonl", [_good_row(i) for i in range(6)])
    _write(tmp_path / "b.jsonl", [_good_row(i) for i in range(6, 10)])
    _write(tmp_path / "val.jsonl", [_good_row(i) for i in range(20, 27)])
    rows = [(f"{tmp_path / 'a.jsonl'}", i) for i in range(6)] + [(f"{tmp_path / 'b.jsonl'}", i) for i in range(4)]
    overrides = [f"data.train_files=[{tmp_path / 'a.jsonl'},{tmp_path / 'b.jsonl'}]", f"data.shuffle={shuffle}",
                 "data.seed=3", "data.train_max_samples=5", "data.val_max_samples=2"]
    train, val = load_datasets(_config(tmp_path, *overrides).data, tokenizer)
    expected = np.random.default_rng(3).choice(10, size=5, replace=False) if shuffle else np.arange(5)
    assert [(s.source_file, s.row) for s in (train[i] for i in range(len(train)))] == [rows[i] for i in expected]
    expected_val = np.random.default_rng(3).choice(7, size=2, replace=False) if shuffle else np.arange(2)
    assert [val[i].row for i in range(len(val))] == expected_val.tolist()
    everything, _ = load_datasets(_config(tmp_path, *overrides[:3], "data.train_max_samples=-1").data, tokenizer)
    assert len(everything) == 10
    # The subset is chosen before over-long prompts are dropped, so fewer than N may remain.
    rows_b = [_good_row(i) for i in range(6, 10)]
    rows_b[0]["prompt"][0]["content"] = "long " * 600
    _write(tmp_path / "b.jsonl", rows_b)
    filtered, _ = load_datasets(_config(tmp_path, *overrides, "data.filter_overlong_prompts=true").data, tokenizer)
    assert len(filtered) == 5 - int(6 in expected) and filtered.num_filtered == int(6 in expected)
