"""The refusal registry (``meshrl.config.refusals``): every rule that refuses a configuration is registered, the
stages run them together, and nothing else in meshrl raises ``ConfigError`` but the readers of input."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

import meshrl
from meshrl.cli import main as cli
from meshrl.config import ConfigError, load_config
from meshrl.config.refusals import STAGES, Checked, catalogue, refusal, RULES
from meshrl.config.validate import validate_config
from meshrl.trainer.main import RULE_MODULES, load_rules

PACKAGE = Path(meshrl.__file__).parent
# Where ConfigError may be raised outside the registry: code that reads input rather than decides on it (the
# registry's module docstring): the config loader, and the entry's tokenizer, prompts and model-config loading.
READERS = {("config/loader.py", None), ("trainer/main.py", "load_inputs"), ("trainer/main.py", "model_config"),
           ("config/refusals.py", "refuse")}


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path.relative_to(PACKAGE).as_posix(), ast.parse(path.read_text())


def _functions_raising_config_error(tree):
    """(the top-level function's name, line) of each ``raise ConfigError(...)`` in ``tree``."""
    for top in tree.body:
        for node in ast.walk(top):
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and \
                    getattr(node.exc.func, "id", None) == "ConfigError":
                yield getattr(top, "name", None), node.lineno


def test_only_the_registry_and_the_input_readers_raise_config_errors():
    raised = {(module, function, line) for module, tree in _modules()
              for function, line in _functions_raising_config_error(tree)}
    outside = sorted((m, f, line) for m, f, line in raised if (m, None) not in READERS and (m, f) not in READERS)
    assert outside == [], f"refuse through a rule of meshrl.config.refusals instead: {outside}"
    assert {(m, f) for m, f, _ in raised} >= {r for r in READERS if r[1]}  # each reader listed still raises


def _decorated_rules():
    """{module: [stage, ...]} of every ``@refusal(stage, ...)`` in the package's source."""
    found: dict[str, list[str]] = {}
    for module, tree in _modules():
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef):
                for decorator in node.decorator_list:
                    if isinstance(decorator, ast.Call) and getattr(decorator.func, "id", None) == "refusal":
                        name = "meshrl." + module.removesuffix(".py").replace("/", ".")
                        found.setdefault(name, []).append(decorator.args[0].value)
    return found


def test_every_rule_is_registered_before_its_stage_runs():
    """A rule's module must be imported before its stage runs: the config stage's by meshrl.config.validate
    (validate_config runs it without the entry), the others' by the entry's RULE_MODULES."""
    decorated = _decorated_rules()
    later = {module for module, stages in decorated.items() if set(stages) - {"config"}}
    assert later <= set(RULE_MODULES), f"add to meshrl.trainer.main.RULE_MODULES: {later - set(RULE_MODULES)}"
    config_rules = sum(stages.count("config") for stages in decorated.values())
    code = ("import json, meshrl.config.validate\nfrom meshrl.config.refusals import RULES\n"
            "print(json.dumps(sorted(r.name for r in RULES if r.stage == 'config')))")
    registered = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                           check=True).stdout)
    assert len(registered) == config_rules, "a config-stage rule's module is not imported by meshrl.config.validate"
    load_rules()
    assert len(RULES) == sum(map(len, decorated.values()))
    assert {rule.stage for rule in RULES} == set(STAGES)
    for rule in RULES:
        assert rule.keys and rule.why, f"{rule.name}: name the keys it concerns and say why in its docstring"


def test_a_stage_lists_every_problem_of_its_rules_at_once():
    with pytest.raises(ConfigError) as err:  # three rules of the config stage, each with its own problem
        validate_config(load_config(["data.max_prompt_length=0", "algorithm.gamma=2",
                                     "trainer.v1.trainer_mode=colocate_async", "data.train_batch_size=6",
                                     "trainer.n_gpus_per_node=4"], recipe="cpu_tiny_grpo"))
    text = str(err.value)
    assert text.startswith("invalid configuration (3 problems):")
    assert set(err.value.keys) == {"data.max_prompt_length", "algorithm.gamma", "data.train_batch_size"}
    assert "must split evenly over the 4 inference replicas" in text  # verl V1 colocate_async's split, before Ray
    with pytest.raises(ConfigError) as err:  # one problem: the problem alone
        validate_config(load_config(["algorithm.gamma=2"], recipe="cpu_tiny_grpo"))
    assert str(err.value) == "algorithm.gamma: must be in [0, 1], got 2.0" and err.value.keys == ("algorithm.gamma",)


def test_the_fully_async_rollouters_budget_is_checked_against_the_prompts():
    from meshrl.trainer.trainer_modes import rollout_budget

    cfg = load_config(["trainer.async_mode=fully_async", "algorithm.rollout_correction.bypass_mode=True",
                       "async_training.require_batches=2", "trainer.total_training_steps=3",
                       "rollout.total_rollout_steps=10"], recipe="cpu_tiny_grpo")
    prompts = cfg.actor_rollout_ref.actor.ppo_mini_batch_size * 2  # one step's
    (problem,) = rollout_budget(Checked(cfg, train_data=range(100)))
    assert problem.startswith(f"trainer.total_training_steps: 3 steps of {prompts} prompts") and "starts 10" in problem
    cfg.rollout.total_rollout_steps = 3 * prompts
    assert rollout_budget(Checked(cfg, train_data=range(100))) == []
    cfg.trainer.async_mode = None  # the synchronous trainer has no rollouter
    assert rollout_budget(Checked(cfg, train_data=range(1))) == []


def test_refusal_needs_a_known_stage():
    with pytest.raises(ValueError, match="unknown stage 'configs'"):
        refusal("configs", "data")


def test_meshrl_refusals_finds_the_rules_about_a_key(capsys):
    assert cli(["refusals", "actor_rollout_ref.model.lora.rank"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("actor_rollout_ref.model.lora.rank: read by meshrl\n")
    assert "meshrl.parallel.lora_limits.lora_on_this_model" in out and "model: the configuration against" in out
    assert "meshrl.trainer.early_checks.run_folder" not in out
    assert cli(["refusals"]) == 0
    assert capsys.readouterr().out.count("\n    keys: ") == len(catalogue())
    assert cli(["refusals", "no_such.key"]) == 1
    assert capsys.readouterr().out.startswith("no_such.key: not a key of verl's or meshrl's schema")
    cli(["refusals", "data.image_patch_size"])  # the key policy's own word first
    assert capsys.readouterr().out.startswith("data.image_patch_size: refused when set away from its default: "
                                              "not built for meshrl's vision-language models yet")
