"""verl's launch scripts run with meshrl: its invocation forms, its newer top-level keys, its example scripts.

The example scripts' arguments are vendored in ``tests/verl_scripts/arguments.json`` (``extract.py``)
with each script's outcome in ``classification.json`` (``classify.py``): the scripts recorded as
loading must load, and the others may fail only on keys the table records for them.
"""

import json
import sys
import warnings
from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf

from meshrl.config import ConfigError, default_config, load_config
from meshrl.trainer.main import main as train_main
from meshrl.trainer.main import parse_args
from meshrl.trainer.plot import plot_finished_run
from meshrl.trainer.tracking import METRICS_FILE
from meshrl.config.refusals import Checked
from meshrl.config.run_plan import build_run_plan
from meshrl.workers.cluster import ray_init_kwargs, ray_settings
from verl_scripts import classify

ARGUMENTS = json.loads(classify.ARGUMENTS.read_text())
TABLE = json.loads(classify.CLASSIFICATION.read_text())
SCRIPTS = {classify.script_id(s): s for s in ARGUMENTS["scripts"]}


def load(argv):
    recipe, overrides = parse_args(argv)
    return load_config(overrides, recipe=recipe)


@pytest.mark.parametrize("argv", [
    ["--config-path=config", "--config-name=ppo_trainer"],
    ["--config-path=./config", "--config-name=ppo_megatron_trainer.yaml"],
    ["--config-path", "config", "--config-name", "ppo_megatron_trainer"],
    ["-cp", "/nowhere/config", "-cn", "ppo_trainer.yaml"],
    ["trainer.nnodes=1", "--config-name=ppo_megatron_trainer", "trainer.nnodes=2"],
])
def test_verl_base_config_names_are_the_defaults(argv):
    cfg = load(argv)
    expected = default_config()
    if "trainer.nnodes=2" in argv:  # options among the overrides: the overrides keep their order
        expected.trainer.nnodes = 2
    assert OmegaConf.to_container(cfg, resolve=True) == OmegaConf.to_container(expected, resolve=True)


def test_other_config_names_still_resolve_as_recipes():
    assert load(["--config-name=cpu_tiny_grpo"]).algorithm.adv_estimator == "grpo"
    with pytest.raises(ConfigError, match="not found"):
        load(["--config-path=config", "--config-name=cpu_tiny_grpo"])


@pytest.mark.parametrize("override, key, value", [
    ("+algorithm.gamma=0.5", "algorithm.gamma", 0.5),
    ("++algorithm.gamma=0.5", "algorithm.gamma", 0.5),
    ("trainer.logger=[console,jsonl]", "trainer.logger", ["console", "jsonl"]),
    ("trainer.logger=['console','wandb']", "trainer.logger", ["console", "wandb"]),
    ('trainer.logger=["console","wandb"]', "trainer.logger", ["console", "wandb"]),
    ("trainer.logger=console", "trainer.logger", ["console"]),
    ("data.train_files=/data/train.parquet", "data.train_files", "/data/train.parquet"),
    ("data.train_files=['/a.parquet', '/b.parquet']", "data.train_files", ["/a.parquet", "/b.parquet"]),
    ("trainer.balance_batch=False", "trainer.balance_batch", False),
    ("actor_rollout_ref.actor.megatron.use_mbridge=True", "actor_rollout_ref.actor.megatron.use_mbridge", True),
    ("actor_rollout_ref.ref.megatron.vanilla_mbridge=True", "actor_rollout_ref.ref.megatron.vanilla_mbridge", True),
    ("ray_kwargs.ray_init.runtime_env.py_executable=null", "ray_kwargs.ray_init.runtime_env.py_executable", None),
    ("ray_kwargs.ray_init.num_cpus=12", "ray_kwargs.ray_init.num_cpus", 12),
    # Hydra's backslash escapes in unquoted values (verl's fsdp_turbo scripts): kept as the plain characters
    (r"trainer.experiment_name=a\,b\=c\ d", "trainer.experiment_name", "a,b=c d"),
    (r"+actor_rollout_ref.actor.fsdp_config.turbo_config.plan.apply_modules={layers.\{*\}:{},lm_head:{}}",
     "actor_rollout_ref.actor.fsdp_config.turbo_config.plan.apply_modules", {"layers.{*}": {}, "lm_head": {}}),
])
def test_hydra_override_forms(override, key, value):
    got = OmegaConf.select(load_config([override]), key)
    assert (OmegaConf.to_container(got) if OmegaConf.is_config(got) else got) == value


def test_a_blank_argument_names_the_shell_mistake_that_makes_it():
    # verl's run_deepseek7b_llm_pfppo.sh ends a line with "\  # comment": bash passes " " and stops there.
    with pytest.raises(ConfigError, match="backslash followed by a space or a comment"):
        load_config(["algorithm.adv_estimator=gae", " "])


def test_a_logger_string_in_a_recipe_is_a_list(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("trainer:\n  logger: console\n")
    assert list(load_config(recipe=recipe).trainer.logger) == ["console"]


def test_every_problem_is_reported_at_once():
    with pytest.raises(ConfigError) as err:
        load_config(["actor_rollout_ref.model.torch_dtyp=bfloat16", "data.train_batch_size=lots", "trainer.nnodes=2",
                     "reward_model.sandbox.url=http://x"])
    assert err.value.keys == ("actor_rollout_ref.model.torch_dtyp", "data.train_batch_size",
                              "reward_model.sandbox.url")
    assert str(err.value).startswith("3 config problems:")


def test_model_engine_megatron_loads_quietly_and_fsdp_with_one_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_config(["model_engine=megatron"]).model_engine == "megatron"
    for engine in ("fsdp", "dp"):
        with pytest.warns(UserWarning, match="Megatron backend") as caught:
            load_config([f"model_engine={engine}", "actor_rollout_ref.actor.fsdp_config.param_offload=True"])
        assert len(caught) == 1
    with pytest.raises(ConfigError, match="model_engine 'veomni'") as err:
        load_config(["model_engine=veomni"])
    assert err.value.keys == ("model_engine",)


def test_ray_kwargs_map_onto_the_ray_start(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    base = ["trainer.n_gpus_per_node=2", "algorithm.adv_estimator=gae"]  # 2 ranks x (policy + critic)
    assert ray_init_kwargs(load_config(base))["num_cpus"] == 4 + 2
    assert "runtime_env" not in ray_init_kwargs(load_config(base))
    kwargs = ray_init_kwargs(load_config([*base, "ray_kwargs.ray_init.num_cpus=16",
                                          "ray_kwargs.ray_init.runtime_env.env_vars.TOKENIZERS_PARALLELISM=true",
                                          "+ray_kwargs.ray_init.runtime_env.env_vars.NCCL_DEBUG=WARN",
                                          "ray_kwargs.ray_init.runtime_env.py_executable=null"]))
    assert kwargs["num_cpus"] == 16
    assert kwargs["runtime_env"] == {"env_vars": {"TOKENIZERS_PARALLELISM": "true", "NCCL_DEBUG": "WARN"}}
    kwargs = ray_init_kwargs(load_config(["ray_kwargs.ray_init.runtime_env.py_executable=/venv/bin/python"]))
    assert kwargs["runtime_env"] == {"py_executable": "/venv/bin/python"}


@pytest.mark.parametrize("overrides, address, message", [
    (["ray_kwargs.ray_init.runtime_env.pip=[numpy]"], None, "runtime_env.pip: meshrl's Ray workers run in the driver"),
    (["ray_kwargs.ray_init.num_cpus=3", "algorithm.adv_estimator=gae", "trainer.n_gpus_per_node=2"], None,
     "places 4 worker processes"),
    (["ray_kwargs.ray_init.num_cpus=8"], "127.0.0.1:6379", "RAY_ADDRESS joins a running cluster"),
])
def test_ray_kwargs_that_cannot_map_are_refused(monkeypatch, overrides, address, message):
    if address:
        monkeypatch.setenv("RAY_ADDRESS", address)
    else:
        monkeypatch.delenv("RAY_ADDRESS", raising=False)
    cfg = load_config(overrides)
    (problem,) = ray_settings(Checked(cfg, build_run_plan(cfg)))
    assert message in problem


def test_a_ray_the_caller_runs_is_used_and_num_cpus_cannot_size_it(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setitem(sys.modules, "ray", SimpleNamespace(is_initialized=lambda: True))
    assert ray_init_kwargs(load_config(["ray_kwargs.ray_init.runtime_env.env_vars.A=1"])) == {}  # nothing to start
    (problem,) = ray_settings(Checked(load_config(["ray_kwargs.ray_init.num_cpus=8"])))
    assert "this process already runs Ray" in problem
    (problem,) = ray_settings(Checked(load_config(["ray_kwargs.ray_init.runtime_env.pip=[numpy]"])))
    assert "runtime_env.pip" in problem  # refused whoever started Ray


def test_main_refuses_before_training(monkeypatch, capsys):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    verl = ["--config-path=config", "--config-name=ppo_trainer", "data.train_batch_size=8",
            "actor_rollout_ref.actor.ppo_mini_batch_size=8", "algorithm.adv_estimator=grpo",
            "actor_rollout_ref.rollout.n=2"]
    assert train_main([*verl, "actor_rollout_ref.model.torch_dtyp=bf16"]) == 2
    assert "unknown config key 'actor_rollout_ref.model.torch_dtyp'" in capsys.readouterr().err
    assert train_main([*verl, "actor_rollout_ref.model.lora.rank=8", "actor_rollout_ref.model.lora.type=dora"]) == 2
    assert "actor_rollout_ref.model.lora.type=dora: meshrl builds ['canonical_lora', 'lora']" in capsys.readouterr().err
    assert train_main([*verl, "ray_kwargs.ray_init.runtime_env.working_dir=."]) == 2
    assert "runtime_env.working_dir" in capsys.readouterr().err


def test_cli_train_passes_verl_arguments_through(monkeypatch):
    import meshrl.trainer.main
    from meshrl.cli import main as cli_main

    seen = []
    monkeypatch.setattr(meshrl.trainer.main, "main", lambda argv, prog: seen.append((list(argv), prog)) or 0)
    cli_main(["train", "--config-name", "ppo_trainer", "a.b=1"])
    cli_main(["train", "cpu_tiny_grpo", "a.b=1"])
    assert seen == [(["--config-name", "ppo_trainer", "a.b=1"], "meshrl train"),
                    (["--config-name", "cpu_tiny_grpo", "a.b=1"], "meshrl train")]


def test_a_run_without_the_jsonl_logger_ends_without_error(tmp_path):
    # verl's usual trainer.logger=['console','wandb'] writes no metrics.jsonl: nothing to draw, no error.
    assert "no metrics.jsonl" in plot_finished_run(tmp_path)
    assert not (tmp_path / "metrics.png").exists()
    (tmp_path / METRICS_FILE).write_text('{"step": 1, "score/mean": 0.5}\n')
    assert plot_finished_run(tmp_path).endswith(f"curves: {tmp_path / 'metrics.png'}")
    assert (tmp_path / "metrics.png").is_file()


def test_the_table_covers_every_vendored_script():
    assert set(TABLE["scripts"]) == set(SCRIPTS)
    assert set(ARGUMENTS["mirrors"]) == {"volcengine/verl", "verl-project/verl"}
    assert TABLE["summary"]["ok"] >= 96  # raise it when more scripts load (python tests/verl_scripts/classify.py)


@pytest.mark.parametrize("name", sorted(n for n, r in TABLE["scripts"].items() if r["outcome"] == "ok"))
def test_scripts_recorded_as_loading_load(name):
    assert classify.classify_script(SCRIPTS[name]) == {"outcome": "ok", "keys": []}


# How far a script gets: refused at load, refused by validation (or the Ray start), or ok.
PROGRESS = {"load": 0, "invalid": 1, "ok": 2}


def test_other_scripts_fail_only_on_their_recorded_keys():
    regressions = {}
    for name, recorded in TABLE["scripts"].items():
        if recorded["outcome"] in ("ok", "no call"):
            continue
        got = classify.classify_script(SCRIPTS[name])
        # A feature added since the table was written may take a script further: fine. Stopping
        # earlier, or at the same stage on a key the table does not list, is a regression.
        behind = PROGRESS[got["outcome"]] < PROGRESS[recorded["outcome"]]
        new_keys = got["outcome"] == recorded["outcome"] and not set(got["keys"]) <= set(recorded["keys"])
        if behind or new_keys:
            regressions[name] = got
    assert not regressions, ("scripts that load less well than recorded (if intended, rerun "
                             f"python tests/verl_scripts/classify.py): {regressions}")
