"""Write the keys of verl's generated and asynchronous trainer configs to ``tests/data/verl_config_keys.json``.

    python scripts/verl_config_keys.py [--mirror NAME=GIT_DIR@COMMIT ...] [--out FILE]

For each verl snapshot (``MIRRORS``: a git mirror without a work tree, read with ``git show``) and each of its configs
in ``FILES`` that the commit has, the file's dotted leaf keys, sorted. The test that reads the file
(``tests/foundation/test_verl_generated_keys.py``) checks that meshrl knows every one, so it runs where the mirrors
are absent (CI clones); the commits are recorded so that a refresh is reproducible, and the test compares the file
with the mirrors where they are present. What counts as a key:

- a leaf is a key whose value is not a non-empty mapping (a scalar, a list, ``{}``, null); a non-empty mapping is a
  section, whose leaves are keys;
- ``_target_`` leaves are left out: they name the class verl's Hydra instantiates a section as, not a setting;
- a leaf whose value interpolates another key (``${oc.select:...}``) is kept: a script may set it like any other;
- the asynchronous configs' ``defaults`` and ``hydra`` sections are left out: they compose configs (the loader
  reads them as a recipe's), they are not keys.

Source commits of the file as generated: volcengine/verl b178a3cd56f58b2d502255daba591e92833930a7 (2026-01-29),
verl-project/verl 1dda039b9c6311889a9c9a26040677e1254814f9 (2026-08-22).
"""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

import yaml

OUT = Path(__file__).resolve().parents[1] / "tests" / "data" / "verl_config_keys.json"
MIRRORS = {
    "volcengine/verl": "/work/.mirror/volcengine+verl/repo@b178a3cd56f58b2d502255daba591e92833930a7",
    "verl-project/verl": "/work/.mirror/verl-project+verl/repo@1dda039b9c6311889a9c9a26040677e1254814f9",
}
FILES = ("verl/trainer/config/_generated_ppo_trainer.yaml",
         "verl/trainer/config/_generated_ppo_megatron_trainer.yaml",
         "verl/experimental/one_step_off_policy/config/one_step_off_ppo_trainer.yaml",
         "verl/experimental/one_step_off_policy/config/one_step_off_ppo_megatron_trainer.yaml",
         "verl/experimental/fully_async_policy/config/fully_async_ppo_trainer.yaml",
         "verl/experimental/fully_async_policy/config/fully_async_ppo_megatron_trainer.yaml")
COMPOSITION = ("defaults", "hydra")  # an asynchronous config's composition of other configs, not keys


def leaf_keys(tree: dict, prefix: str = "") -> list[str]:
    """The dotted leaf keys of a YAML mapping (see the module docstring)."""
    keys = []
    for key, value in tree.items():
        if key == "_target_" or (not prefix and key in COMPOSITION):
            continue
        if isinstance(value, dict) and value:
            keys += leaf_keys(value, f"{prefix}{key}.")
        else:
            keys.append(f"{prefix}{key}")
    return keys


def snapshot_keys(git_dir: str, commit: str) -> dict[str, list[str]]:
    """path -> the sorted keys of each of ``FILES`` present at ``commit``."""
    present = set(subprocess.run(["git", "-C", git_dir, "ls-tree", "-r", "--name-only", commit], check=True,
                                 capture_output=True, text=True).stdout.split())
    return {path: sorted(leaf_keys(yaml.safe_load(subprocess.run(
        ["git", "-C", git_dir, "show", f"{commit}:{path}"], check=True, capture_output=True, text=True).stdout)))
        for path in FILES if path in present}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mirror", action="append", default=[], help="NAME=GIT_DIR@COMMIT (default: MIRRORS)")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    mirrors = dict(m.split("=", 1) for m in args.mirror) or MIRRORS
    out = {}
    for name, source in mirrors.items():
        git_dir, _, commit = source.partition("@")
        commit = subprocess.run(["git", "-C", git_dir, "rev-parse", commit or "HEAD"], check=True, capture_output=True,
                                text=True).stdout.strip()
        out[name] = {"commit": commit, "files": snapshot_keys(git_dir, commit)}
    args.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
