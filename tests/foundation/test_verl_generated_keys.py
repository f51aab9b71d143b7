"""No key of verl's configs is unknown to meshrl (``meshrl.config.key_policy.key_status``).

The keys are those of verl's generated trainer configs (``_generated_ppo_trainer.yaml`` and
``_generated_ppo_megatron_trainer.yaml``: every key its Hydra tree composes, FSDP's and Megatron's) and of its
one-step-off and fully async trainers' configs, at two snapshots: volcengine/verl (early 2026) and verl-project/verl
(later). ``scripts/verl_config_keys.py`` vendors them in ``tests/data/verl_config_keys.json`` with their commits, so
this check runs where verl's git mirrors are absent (CI clones); it says what counts as a key: every leaf, but the
``_target_`` class paths verl's Hydra instantiates sections with and the asynchronous configs' ``defaults`` /
``hydra`` composition; a leaf whose value interpolates another key is kept, since a script may set it. Where the
mirrors are present, the vendored keys are compared with theirs at the recorded commits.

Each key must be read, refused as a missing feature, FSDP-only or inert (the last two named in a start-up warning:
``tests/foundation/test_key_policy.py`` checks each kind's behaviour): anything but unknown, which the loader refuses
as a key meshrl has never heard of.
"""

import importlib.util
import json
import subprocess
from pathlib import Path

import pytest

from meshrl.config import ConfigError, load_config
from meshrl.config.key_policy import key_status

ROOT = Path(__file__).resolve().parents[2]
VENDORED = ROOT / "tests" / "data" / "verl_config_keys.json"
GENERATED = ("verl/trainer/config/_generated_ppo_trainer.yaml",
             "verl/trainer/config/_generated_ppo_megatron_trainer.yaml")


def _generator():
    """``scripts/verl_config_keys.py`` (not a package), for its mirrors and its reading of them."""
    spec = importlib.util.spec_from_file_location("verl_config_keys", ROOT / "scripts" / "verl_config_keys.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def vendored() -> dict:
    return json.loads(VENDORED.read_text())


@pytest.fixture(scope="module")
def mirrored(vendored) -> dict:
    """Each snapshot's keys read from its git mirror at the vendored commit (``git show``, once per session)."""
    generator = _generator()
    out = {}
    for name, snapshot in vendored.items():
        git_dir = generator.MIRRORS[name].partition("@")[0]
        has_commit = Path(git_dir).is_dir() and subprocess.run(
            ["git", "-C", git_dir, "cat-file", "-e", f"{snapshot['commit']}^{{commit}}"],
            capture_output=True).returncode == 0
        if not has_commit:
            pytest.skip(f"verl's git mirror {git_dir} (or its commit {snapshot['commit']}) is absent, as in CI clones: "
                        "the vendored keys are checked without it")
        out[name] = generator.snapshot_keys(git_dir, snapshot["commit"])
    return out


def test_every_key_of_verls_configs_is_known(vendored):
    for name, snapshot in vendored.items():  # an empty file would pass the check below with nothing checked
        assert set(GENERATED) <= set(snapshot["files"]), f"{name}: the generated configs are missing from {VENDORED}"
    unknown = sorted({f"{key} ({name}: {Path(path).name})" for name, snapshot in vendored.items()
                      for path, keys in snapshot["files"].items() for key in keys if key_status(key) == "unknown"})
    assert not unknown, ("verl keys that meshrl's loader refuses as unknown: give each a schema field, read it or name "
                         "it in meshrl.config.key_policy's tables: " + ", ".join(unknown))


def test_the_loader_refuses_what_key_status_calls_unknown():
    key = "actor_rollout_ref.rollout.no_such_key"
    assert key_status(key) == "unknown"
    with pytest.raises(ConfigError, match=f"unknown config key '{key}'"):
        load_config([f"{key}=1"])
    assert key_status("actor_rollout_ref.rollout.n") == "read"


def test_the_vendored_keys_are_the_mirrors(vendored, mirrored):
    for name, files in mirrored.items():
        assert files == vendored[name]["files"], (f"{VENDORED} is not what scripts/verl_config_keys.py reads from "
                                                  f"{name} at {vendored[name]['commit']}: run the script again")
