"""The ``meshrl`` commands besides training on bad input: one message naming the argument or file and what to do,
exit 2, no traceback; run in process (each fails before its work starts)."""

from __future__ import annotations

import json

import pytest

from meshrl import cli


def test_train_without_a_recipe_and_its_help_show_meshrls_form(capsys):
    assert cli.main(["train"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: meshrl train RECIPE [key=value ...]\n") and err.endswith(
        "meshrl train: give a recipe, e.g. meshrl train cpu_tiny_grpo\n")
    with pytest.raises(SystemExit) as done:
        cli.main(["train", "--help"])
    out = capsys.readouterr().out
    assert done.value.code == 0 and out.startswith("usage: meshrl train RECIPE [key=value ...]\n       meshrl train "
                                                   "--config-name NAME")
    assert "python -m meshrl.trainer.main" not in out


def test_preprocess_into_a_folder_it_cannot_write(capsys):
    with pytest.raises(SystemExit) as done:
        cli.main(["preprocess", "gsm8k", "--local_dir", "/sys/meshrl-data"])  # sysfs: read-only even for root
    err = capsys.readouterr().err
    assert done.value.code == 2 and err.endswith("error: --local_dir /sys/meshrl-data: cannot write there (Operation "
                                                 "not permitted); choose a folder you can write\n"), err


@pytest.mark.parametrize("command", ["hf-to-mcore", "mcore-to-hf"])
def test_convert_with_a_broken_or_missing_config_json(tmp_path, capsys, command):
    model = tmp_path / "model"
    model.mkdir()
    flag = "--hf" if command == "hf-to-mcore" else "--hf-config"
    args = ["convert", command, "--out", str(tmp_path / "out")] + (
        [] if command == "hf-to-mcore" else ["--ckpt", str(tmp_path)])
    assert cli.main([*args, flag, str(model)]) == 2
    assert capsys.readouterr().err == (f"meshrl convert: error: {flag} {model} has no config.json; give the model's "
                                       "Hugging Face folder\n")
    (model / "config.json").write_text('{"model_type": "llama", "hidden_size": ')  # cut short
    assert cli.main([*args, flag, str(model)]) == 2
    assert capsys.readouterr().err == (f"meshrl convert: error: {flag} {model}: It looks like the config file at "
                                       f"'{model / 'config.json'}' is not a valid JSON file. Fix its config.json, or "
                                       "copy it again from the model's source\n")
    assert not (tmp_path / "out").exists()


def test_plot_names_the_lines_it_leaves_out(tmp_path, capsys):
    lines = [json.dumps({"step": 1, "critic/score/mean": 0.5}), "{broken", json.dumps({"step": "2"}),
             json.dumps({"step": 3, "critic/score/mean": 0.7}), '{"step": 4, "critic/sc']
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines))
    assert cli.main(["plot", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    assert captured.err == (f"meshrl plot: {tmp_path / 'metrics.jsonl'}: 3 line(s) left out, not a JSON object with an "
                            "integer 'step' (line 2, 3, 5); a run killed while writing leaves its last line cut\n")
    assert (tmp_path / "metrics.png").is_file()


def test_plan_of_a_cpu_run_limits_each_process_to_its_share_of_this_machines_memory(capsys):
    import psutil

    assert cli.main(["plan", "cpu_tiny_grpo", "trainer.device=cpu", "trainer.n_gpus_per_node=2", "--json"]) == 0
    limit = json.loads(capsys.readouterr().out)["limit_bytes"]
    assert limit == pytest.approx(psutil.virtual_memory().total / 2)
    assert cli.main(["plan", "cpu_tiny_grpo", "trainer.device=cpu", "--gpu-memory-gib", "3", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["limit_bytes"] == 3 * 1024**3
