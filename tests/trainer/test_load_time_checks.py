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
     "actor_rollout_ref.actor.megatron.tensor_model_parallel_size: TP=3 does not divide num_attention_heads=4"),
    (["trainer.n_gpus_per_node=3", "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=3"],
     "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size: PP=3 x virtual PP=1 does not divide "
     "num_hidden_layers=2"),
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


@pytest.mark.parametrize("where, message", [
    ("/sys/meshrl-run", "trainer.default_local_dir=/sys/meshrl-run: cannot write in /sys (Permission denied); point "
                        "it at a folder you can write"),  # sysfs: read-only even for root, who ignores chmod
    ("{file}", "trainer.default_local_dir={file} is a file; the run writes its checkpoints, metrics and logs into a "
               "folder"),
    ("{file}/run", "trainer.default_local_dir={file}/run is inside {file}, which is a file"),
])
def test_a_run_folder_that_cannot_be_written_is_refused_before_anything_is_created(command, tmp_path, where, message):
    file = tmp_path / "a-file"
    file.write_text("")
    code, err = command(f"trainer.default_local_dir={where.format(file=file)}")
    assert code == 2 and err.startswith(f"meshrl: {message.format(file=file)}"), err
    assert file.read_text() == "" and sorted(p.name for p in tmp_path.iterdir()) == ["a-file", "data.jsonl"]


def test_devices_this_machine_lacks_are_refused(command, monkeypatch):
    import torch

    gpus = torch.cuda.device_count()
    if gpus == 0:
        code, err = command("trainer.device=cuda")
        assert code == 2 and "trainer.device=cuda, but torch sees no GPU on this machine; set trainer.device=cpu" in err
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)  # a one-GPU machine, for the count's check
        gpus = 1
    code, err = command("trainer.device=cuda", f"trainer.n_gpus_per_node={gpus + 1}")
    assert code == 2 and (f"trainer.n_gpus_per_node={gpus + 1}, but torch sees {gpus} GPU(s) on this machine; set "
                          f"trainer.n_gpus_per_node={gpus} or less") in err, err
    # Several machines' GPUs are Ray's to place: not counted here (Ray's start then fails the test's fixture)
    with pytest.raises(AssertionError, match="Ray started"):
        command("trainer.device=cuda", f"trainer.n_gpus_per_node={gpus + 1}", "trainer.nnodes=2")


@pytest.fixture
def tiny_model_files():
    """The tiny Llama's folder's files by name."""
    from meshrl.models.resolve import resolve_model_path

    return {p.name: p for p in resolve_model_path("tiny:llama").iterdir()}


@pytest.mark.parametrize("left_out, message", [
    ("model.safetensors", "actor_rollout_ref.model.path: {model} has no weights (no model.safetensors or "
                          "model.safetensors.index.json); download the model's weight files into it"),
    ("tokenizer", "actor_rollout_ref.model.path: no tokenizer loads from {model} (it has none of tokenizer.json, "
                  "tokenizer.model, vocab.json, vocab.txt, tokenizer_config.json); copy the model's tokenizer files"),
])
def test_a_model_folder_without_weights_or_tokenizer_is_refused(command, tmp_path, tiny_model_files, left_out,
                                                                 message):
    model = tmp_path / "model"
    model.mkdir()
    for name, file in tiny_model_files.items():
        if not name.startswith(left_out):
            (model / name).write_bytes(file.read_bytes())
    code, err = command(f"actor_rollout_ref.model.path={model}")
    assert code == 2 and err.startswith("meshrl: " + message.format(model=model)), err


def test_shards_an_index_names_must_be_there(tmp_path):
    from meshrl.trainer.early_checks import model_weights_problem

    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    (tmp_path / "model-00001-of-00002.safetensors").write_bytes(b"")
    assert model_weights_problem("k", tmp_path) == (
        f"k: {tmp_path / 'model.safetensors.index.json'} names 1 shard(s) the folder lacks "
        "(model-00002-of-00002.safetensors); download the model's files again")
    (tmp_path / "model-00002-of-00002.safetensors").write_bytes(b"")
    assert model_weights_problem("k", tmp_path) is None


def _checkpoints(run, steps, num_samples, with_sizes=True):
    """Checkpoints of the trainer's layout in ``run`` at ``steps``, their sampler having seen ``num_samples``
    prompts (the fixture's data holds 6); ``with_sizes=False``: as saved before COMPLETE listed the file sizes."""
    from meshrl.data.sampler import PromptSampler
    from meshrl.trainer.checkpoint import COMPLETE_MARKER, CheckpointManager

    manager = CheckpointManager(run)
    for step in steps:
        sampler = PromptSampler(num_samples, 4, seed=1)
        path = manager.save(step, {"step": step, "sampler": sampler.state_dict()},
                            lambda folder: ((folder / "actor").mkdir(), (folder / "actor" / "shard").write_bytes(
                                bytes(1000))))
        if not with_sizes:
            marker = json.loads((path / COMPLETE_MARKER).read_text())
            (path / COMPLETE_MARKER).write_text(json.dumps({k: v for k, v in marker.items() if k != "files"}))
    return run


def test_a_resume_that_cannot_work_is_refused_before_ray(command, tmp_path):
    run = _checkpoints(tmp_path / "run", [1, 2], num_samples=6)
    code, err = command("trainer.resume_mode=resume_path", f"trainer.resume_from_path={run / 'global_step_7'}")
    assert code == 2 and err == (f"meshrl: trainer.resume_from_path: checkpoint folder {run / 'global_step_7'} does "
                                 f"not exist ({run} holds global_step_1, global_step_2)\n")
    # The data changed since: 5 prompts where the checkpoint's sampler left 6
    code, err = command("data.train_max_samples=5")
    assert code == 2 and err.startswith(
        f"meshrl: trainer.resume_mode=auto resumes from {run / 'global_step_2'}, the latest checkpoint in "
        "trainer.default_local_dir: the prompts changed since the checkpoint, so resuming would not continue its data "
        "order (prompts in data.train_files (after filtering and data.train_max_samples): checkpoint 6, now 5). "
        "Restore them, or train the new prompts as a new run (trainer.resume_mode=disable"), err


def test_a_damaged_checkpoint_names_the_file_and_the_one_to_resume_from_instead(command, tmp_path):
    run = _checkpoints(tmp_path / "run", [1, 2], num_samples=6)
    shard = run / "global_step_2" / "actor" / "shard"
    shard.write_bytes(bytes(500))  # cut in half, as by a full disk while copying
    code, err = command()  # the fixture's command resumes from its run folder (resume_mode=auto)
    assert code == 2 and err == (
        f"meshrl: trainer.resume_mode=auto resumes from {run / 'global_step_2'}, the latest checkpoint in "
        f"trainer.default_local_dir, but the checkpoint is damaged: {shard}: 500 bytes, its save wrote 1000. Resume "
        f"from the one before it: trainer.resume_mode=resume_path trainer.resume_from_path={run / 'global_step_1'}\n")
    (run / "global_step_1" / "actor" / "shard").unlink()  # and the one before it is damaged too
    code, err = command("trainer.resume_mode=resume_path", f"trainer.resume_from_path={run / 'global_step_2'}")
    assert code == 2 and err.endswith(f"{shard}: 500 bytes, its save wrote 1000. No whole checkpoint before it is "
                                      "left: start over with trainer.resume_mode=disable (or another "
                                      "trainer.default_local_dir)\n"), err


def test_a_damaged_driver_state_of_a_checkpoint_without_sizes_is_named(command, tmp_path):
    run = _checkpoints(tmp_path / "run", [1], num_samples=6, with_sizes=False)
    state = run / "global_step_1" / "trainer_state.pt"
    state.write_bytes(state.read_bytes()[: state.stat().st_size // 2])
    code, err = command()
    assert code == 2 and f"but the checkpoint is damaged: {state}: " in err and "; the file is damaged. No whole " \
        "checkpoint before it is left" in err, err


def test_data_files_without_rows_or_at_a_mistyped_path_say_so(command, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    code, err = command(f"data.train_files={empty}")
    assert code == 2 and err == (f"meshrl: cannot load the prompts: {empty}: no rows, so there are no prompts; give "
                                 "a file that holds some\n")
    odd = tmp_path / "my data" / "été.parquet"  # a guess of a packaged set from this path would mislead
    code, err = command(f"data.train_files={odd}")
    assert code == 2 and err.startswith(
        f"meshrl: cannot load the prompts: data file {odd} does not exist (nor does its folder {odd.parent}); check "
        "the path (the packaged sets are 'embedded:<dataset>/<split>' with <dataset> one of gsm8k,"), err
    assert "preprocess" not in err
    split = tmp_path / "my data" / "gsm8k" / "train.parquet"  # where preprocess writes: its command, quoted
    code, err = command(f"data.train_files={split}")
    assert code == 2 and (f"Write it with `python -m meshrl.data.preprocess gsm8k --local_dir '{split.parent}'`, or "
                          "use 'embedded:gsm8k/train'") in err, err
