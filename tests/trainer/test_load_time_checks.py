"""Mistakes found before any worker starts: the command prints one message, no traceback, and exits 2.

The model's sizes against the parallel layout (``preflight``), the data files and the batch size against the
data (``load_inputs``), through ``meshrl.trainer.main.main`` with Ray's start replaced by a failure.
"""

from __future__ import annotations

import json

import pytest

from meshrl.trainer.main import main
from meshrl.workers import cluster

ROW = {"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": "What is 1 + 1?"}],
       "reward_model": {"ground_truth": "2"}}


@pytest.fixture
def command(tmp_path, monkeypatch, capsys):
    """``command(*overrides) -> (exit code, stderr)`` of the tiny recipe on ``tmp_path/data.jsonl``; any
    Ray start fails the test."""

    def no_ray(cfg):
        raise AssertionError("Ray started")

    monkeypatch.setattr(cluster, "start_ray", no_ray)
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(ROW) + "\n" for _ in range(6)))

    def run(*overrides: str) -> tuple[int, str]:
        code = main(["--config-name", "cpu_tiny_grpo", f"data.train_files={data}", f"data.val_files={data}",
                     f"trainer.default_local_dir={tmp_path / 'run'}", *overrides])
        err = capsys.readouterr().err
        assert "Traceback" not in err
        return code, err

    return run


@pytest.mark.parametrize("overrides, message", [
    (["trainer.n_gpus_per_node=3", "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=3"],
     "actor_rollout_ref.actor.megatron.tensor_model_parallel_size: 3 does not divide the model's 4 attention heads"),
    (["trainer.n_gpus_per_node=3", "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=3"],
     "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size: PP×VPP = 3 does not divide the model's 2 layers"),
    (["actor_rollout_ref.model.path=/no/such/model"], "actor_rollout_ref.model.path: model path '/no/such/model'"),
])
def test_the_models_sizes_are_checked_before_ray(command, overrides, message):
    code, err = command(*overrides)
    assert code == 2 and err.startswith("meshrl: ") and message in err


def test_data_problems_name_the_file_and_row(command, tmp_path):
    code, err = command("data.train_files=/no/such/train.parquet")
    assert code == 2 and err.startswith("meshrl: cannot load the prompts: data file /no/such/train.parquet does not")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(ROW) + "\n" + json.dumps({**ROW, "reward_model": {}}) + "\n")
    code, err = command(f"data.train_files={bad}")
    assert code == 2 and f"{bad}, row 1: field 'reward_model' must be an object with a 'ground_truth'" in err
    bad.write_text(json.dumps(ROW) + "\n{not json\n")
    code, err = command(f"data.train_files={bad}")
    assert code == 2 and f"{bad}, line 2: invalid JSON" in err
    code, err = command("data.prompt_key=question")
    assert code == 2 and err == (f"meshrl: cannot load the prompts: {tmp_path / 'data.jsonl'}: no row has the field "
                                 "'question' that data.prompt_key names; the rows have data_source, prompt, "
                                 "reward_model\n")


def test_a_batch_larger_than_the_data_is_refused_with_the_numbers(command):
    code, err = command("data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=8")
    assert code == 2
    assert err == ("meshrl: data.train_batch_size: 8 prompts per step, but data.train_files holds only 6: no full "
                   "batch exists. Set data.train_batch_size=6 or less, or add prompts\n")
    code, err = command("data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
                        "data.train_max_samples=5")
    assert code == 2 and "holds only 5 (data.train_max_samples=5)" in err


def test_a_group_estimator_with_one_response_per_prompt_is_refused(command):
    code, err = command("actor_rollout_ref.rollout.n=1", "algorithm.adv_estimator=grpo_passk")
    assert code == 2 and "actor_rollout_ref.rollout.n: grpo_passk baselines each response against the other" in err


@pytest.mark.parametrize("source, name, expected", [
    (None, "compute_score", "custom_reward_function.path: FileNotFoundError: custom_reward_function.path="),
    ("def score(a, b, c, d=None):\n    return 0.0\n", "compute_score",
     "custom_reward_function.name: AttributeError: custom_reward_function.name='compute_score' is not a function"),
    ("def compute_score(a):\n    return 0.0\n", "compute_score", "must accept (data_source, solution_str"),
    ("import no_such_module_here\n", "compute_score", "ModuleNotFoundError: No module named 'no_such_module_here'"),
])
def test_a_broken_reward_file_stops_before_ray(command, tmp_path, source, name, expected):
    reward = tmp_path / "reward.py"
    if source is not None:
        reward.write_text(source)
    code, err = command(f"custom_reward_function.path={reward}", f"custom_reward_function.name={name}")
    assert code == 2 and expected in err, err
