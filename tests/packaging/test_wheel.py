"""A wheel built from the tracked tree, installed into a fresh virtualenv outside the checkout, is a working meshrl.

The wheel is built from a copy of what the checkout tracks (setup.py, README.md, LICENSE, meshrl/, recipes/: nothing
untracked can leak in) and installed without its dependencies into a new virtualenv, whose only view of the
dependencies is a path line to this environment's site-packages (no ``.pth`` of it runs: not the editable install of
this checkout). Commands run from a folder outside the checkout, through the ``meshrl`` console script's entry point
as the installed metadata declares it.
"""

from __future__ import annotations

import json
import shutil
import site
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TRACKED = ("setup.py", "README.md", "LICENSE", "meshrl", "recipes")
# Runs the console script "meshrl" as the installed dist-info declares it.
ENTRY = ("import sys, importlib.metadata as m; (ep,) = [e for e in m.entry_points(group='console_scripts') "
         "if e.name == 'meshrl']; sys.argv[0] = 'meshrl'; sys.exit(ep.load()(sys.argv[1:]))")


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple[Path, Path]:
    """(the fresh virtualenv's python, a working folder outside the checkout)."""
    root = tmp_path_factory.mktemp("wheel")
    src = root / "src"
    src.mkdir()
    tracked = subprocess.run(["git", "ls-files", *TRACKED], cwd=REPO, capture_output=True, text=True, check=True)
    for name in tracked.stdout.splitlines():
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, src / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(root / "dist")], cwd=src, check=True)
    (wheel,) = (root / "dist").glob("meshrl-*.whl")
    env = root / "venv"
    venv.create(env, with_pip=False)
    python = env / "bin" / "python"
    target = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                 capture_output=True, text=True, check=True).stdout.strip())
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
                   check=True)
    (target / "dependencies.pth").write_text("".join(f"{p}\n" for p in site.getsitepackages()))
    work = root / "elsewhere"
    work.mkdir()
    return python, work


def meshrl(installed, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    python, work = installed
    return subprocess.run([str(python), "-c", ENTRY, *args], cwd=work, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.slow
def test_the_installed_wheel_runs_from_outside_the_checkout_with_its_packaged_recipes(installed):
    python, work = installed
    where = subprocess.run([str(python), "-c", "import meshrl, meshrl.config.loader as l; "
                            "print(meshrl.__file__); print(l.RECIPES_DIR)"], cwd=work, capture_output=True,
                           text=True, check=True).stdout.split()
    assert not where[0].startswith(str(REPO)) and not where[1].startswith(str(REPO)), where
    assert Path(where[1], "cpu_tiny_grpo.yaml").is_file()
    help_text = meshrl(installed, "train", "--help")
    assert help_text.returncode == 0 and "meshrl train" in help_text.stdout, help_text.stderr[-2000:]
    # a packaged recipe by name, and its verl async configs (package data too), validate before any worker starts
    for recipe in ("cpu_tiny_grpo", "fully_async_ppo_trainer"):
        done = subprocess.run([str(python), "-c", "from meshrl.config import load_config; "
                               "from meshrl.config.validate import validate_config; "
                               f"validate_config(load_config(['trainer.device=cpu'], recipe={recipe!r}))"],
                              cwd=work, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-2000:]
    missing = meshrl(installed, "train", "no_such_recipe")
    assert missing.returncode == 2 and "cpu_tiny_grpo" in missing.stderr, missing.stderr[-2000:]
    with zipfile.ZipFile(next((Path(python).parents[2] / "dist").glob("meshrl-*.whl"))) as wheel:
        names = wheel.namelist()
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)


@pytest.mark.e2e
@pytest.mark.extended  # the installed package's commands and recipes: the test above
def test_the_installed_wheel_trains_one_step_on_a_packaged_recipe(installed, tmp_path):
    run_dir = tmp_path / "run"
    done = meshrl(installed, "train", "cpu_tiny_grpo", "trainer.total_training_steps=1", "trainer.test_freq=-1",
                  "trainer.val_before_train=False", "data.train_max_samples=16", f"trainer.default_local_dir={run_dir}",
                  timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # (the tiny random model scores 0 on GSM8K: zero advantages, a zero gradient; the update ran)
    assert steps[-1]["step"] == 1 and steps[-1]["actor/optimizer_steps"] >= 1 and "actor/pg_loss" in steps[-1]
