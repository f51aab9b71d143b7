"""Extract the trainer arguments of verl's example launch scripts into ``arguments.json``.

    python tests/verl_scripts/extract.py [--mirror NAME=GIT_DIR ...] [--out FILE]

For every ``.sh`` under the algorithm folders of ``examples/`` (``FOLDERS``) and the asynchronous trainers' ``shell/``
folders (``ASYNC_SHELLS``) in each verl mirror, the script runs under bash in a sandbox that records the argv of every
call of a verl trainer module (``MODULE_PREFIXES``),
so the arguments are exactly what bash hands verl after variable substitution, arrays and branches.
The sandbox's environment is the representative one a user launches in:

- every ``${VAR:-default}`` keeps the script's default (model paths, data paths, sizes), and ``HOME``
  is ``/home/user``, so ``$HOME/data/...`` paths read as they would on a user's machine; the few
  variables a script needs without a default get the values in ``REQUIRED_ENV``;
- a GPU machine (``python3 -c 'import torch_npu'`` fails, so ``DEVICE`` resolves to gpu);
- ``VERL_USE_UV=0``: the uv branch launches verl's own ``uv.lock`` extras from verl's repo root,
  while a meshrl run starts from meshrl's virtualenv (the scripts then set
  ``ray_kwargs.ray_init.runtime_env.py_executable=null``).

Nothing the scripts call runs: the PATH holds only text tools (awk, sed, ...) and a fixed ``date``;
any other command (python, downloads, mkdir, ray) is a no-op, with ``python -c`` failing.
The output lists, per script, its mirror, path and each recorded call's module and arguments, and under ``files``
the text of the config files of verl's repository a call reads (``VERL_ROOT``: its ``--config-path`` folder's
``--config-name`` config, a tool config it names), which the tests lay out again (``classify.verl_files``); the
mirrors' commits are recorded so a refresh is reproducible.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
MIRRORS = {
    "volcengine/verl": "/work/.mirror/volcengine+verl/repo",  # early 2026
    "verl-project/verl": "/work/.mirror/verl-project+verl/repo",  # today
}
FOLDERS = ("remax_trainer", "gpg_trainer", "grpo_trainer", "ppo_trainer", "rloo_trainer",
           "reinforce_plus_plus_trainer", "cispo_trainer", "dppo_trainer", "gdpo_trainer", "gmpo_trainer",
           "gspo_trainer", "otb_trainer", "sapo_trainer", "rollout_correction")
# verl's scripts outside those folders that an issue names: router replay and LoRA on experts (the MoE issue's),
# LoRA on a vision-language model and the Geometry3K multi-turn tool scripts (the vision-language issue's)
NAMED_SCRIPTS = ("examples/router_replay/run_qwen3_30b_a3b_megatron.sh",
                 "examples/tuning/lora/run_qwen3_30b_a3b_megatron.sh", "examples/tuning/lora/run_qwen2_5_vl_7b_fsdp.sh",
                 "examples/sglang_multiturn/geo3k/run_qwen2.5-3b_geo3k_multiturn.sh",
                 "examples/sglang_multiturn/geo3k/run_qwen2.5-3b_geo3k_multiturn_4xgpu.sh",
                 "examples/sglang_multiturn/geo3k/run_qwen2.5-3b_megatron_geo3k_multiturn.sh")
# the asynchronous trainers' scripts (each folder's shell/*.sh)
ASYNC_SHELLS = ("verl/experimental/one_step_off_policy/shell/", "verl/experimental/fully_async_policy/shell/")
# verl's trainer entry modules (main_ppo*: the synchronous trainer; then the one-step-off and fully async ones)
MODULE_PREFIXES = ("verl.trainer.main_ppo", "verl.experimental.one_step_off_policy.main_ppo",
                   "verl.experimental.fully_async_policy.fully_async_main")
HOME = "/home/user"
VERL_ROOT = "/verl"  # the sandbox's verl checkout, as the recorded arguments name it
CONFIG_SUFFIXES = (".yaml", ".yml", ".json")
FIXED_DATE = "20260101"
# Variables some scripts read without a default (they exit otherwise): where the user keeps things.
REQUIRED_ENV = {
    "DATA_ROOT": f"{HOME}/data",
    "HDFS_ROOT": HOME,
    "INFER_BACKEND": "vllm",  # the scripts' own default, read before they set it in one of them
    "KIMI_K2_6_MODEL_PATH": f"{HOME}/models/Kimi-K2.6",
    "MLITE_ROOT": f"{HOME}/Megatron-LM",
    "MODEL_VARIANT": "kimi_k2_6",
    "RAY_DATA_HOME": f"{HOME}/verl",
    # the sbatch scripts: what Slurm sets for a one-node job of eight GPUs (sbatch --gpus-per-node=8)
    "SLURM_JOB_NUM_NODES": "1",
    "SLURM_GPUS_PER_NODE": "8",
}
# Real tools a script may use to compute values; none of them starts a process or writes outside cwd.
TEXT_TOOLS = ("awk", "basename", "cat", "cut", "dirname", "expr", "grep", "head", "readlink", "realpath",
              "sed", "seq", "sort", "tail", "tr", "uniq", "wc")

# Sourced by bash before the script (BASH_ENV). Records calls of verl's trainer module (NUL-separated
# argv, one file per call, numbered in call order); every other missing command succeeds silently,
# except `python -c ...` which fails like a probe for an absent package. A stub reading a pipe
# (`... | tee LOG`) drains it, so the writer is not killed by SIGPIPE before it records. `ulimit` above this
# machine's hard limit (a script raising its open-files limit, which a user's machine allows) does not stop it.
PRELUDE = r"""
command_not_found_handle() {
    local arg
    for arg in "$@"; do
        if MODULE_TEST; then
            local calls=("$CALLS_DIR"/*)
            [[ -e "${calls[0]}" ]] || calls=()
            printf '%s\0' "$@" > "$CALLS_DIR/$(printf '%04d' "${#calls[@]}")"
            return 0
        fi
    done
    if [[ -p /dev/stdin ]]; then
        cat > /dev/null
    fi
    if [[ "$1" == python* && "$2" == -c ]]; then
        return 1
    fi
    return 0
}
source() {
    if [[ -f "$1" ]]; then builtin source "$@"; fi
}
ulimit() {
    builtin ulimit "$@" 2>/dev/null || true
}
""".replace("MODULE_TEST", " || ".join(f'[[ "$arg" == {prefix}* ]]' for prefix in MODULE_PREFIXES))


def list_scripts(git_dir: str) -> list[str]:
    names = subprocess.run(["git", "-C", git_dir, "ls-tree", "-r", "--name-only", "HEAD", "examples/",
                            *ASYNC_SHELLS], check=True, capture_output=True, text=True).stdout.split()
    return sorted(n for n in names if n.endswith(".sh") and (n.split("/")[1] in FOLDERS or n.startswith(ASYNC_SHELLS)
                                                              or n in NAMED_SCRIPTS))


def run_script(text: str, rel_path: str, sandbox: Path) -> list[dict]:
    """Run one script in ``sandbox`` and return its recorded calls: ``{"module", "args"}`` each."""
    root = sandbox / "verl"
    calls_dir = sandbox / "calls"
    for folder in (root, calls_dir):
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir()
    script = root / rel_path
    script.parent.mkdir(parents=True)
    script.write_text(text)
    env = {"PATH": str(sandbox / "bin"), "HOME": HOME, "BASH_ENV": str(sandbox / "prelude.sh"),
           "CALLS_DIR": str(calls_dir), "VERL_USE_UV": "0", "LANG": "C.UTF-8", **REQUIRED_ENV}
    subprocess.run(["/bin/bash", rel_path], cwd=root, env=env, capture_output=True, timeout=60)
    calls = []
    for path in sorted(calls_dir.iterdir()):
        argv = path.read_bytes().decode().split("\0")[:-1]
        # Paths a script derives from its own location point into the sandbox: name verl's root instead.
        argv = [a.replace(str(root), VERL_ROOT) for a in argv]
        start = next(i for i, a in enumerate(argv) if a.startswith(MODULE_PREFIXES))
        calls.append({"module": argv[start], "args": argv[start + 1:]})
    return calls


def verl_files_read(args: list[str], git_dir: str) -> dict[str, str]:
    """Path under ``VERL_ROOT`` -> text of each config file of verl's repository (at the mirror's HEAD) that ``args``
    name: a value ``VERL_ROOT/...`` ending in one of ``CONFIG_SUFFIXES``, and the ``--config-name`` config in a
    ``--config-path`` under ``VERL_ROOT``. Code files (a reward function in verl's tree) are not read: the tests swap
    them for their own (``classify.PATH_SWAPS``)."""
    named = {"--config-path": None, "--config-name": None}
    values = []
    for arg in args:
        key, sep, value = arg.partition("=")
        if key in named and sep:
            named[key] = value
        elif sep:
            values.append(value)
    if named["--config-path"] and named["--config-name"]:
        name = named["--config-name"]
        values.append(f"{named['--config-path']}/{name}{'' if name.endswith('.yaml') else '.yaml'}")
    files = {}
    for value in values:
        if not value.startswith(VERL_ROOT + "/") or not value.endswith(CONFIG_SUFFIXES):
            continue
        shown = subprocess.run(["git", "-C", git_dir, "show", f"HEAD:{value[len(VERL_ROOT) + 1:]}"],
                               capture_output=True, text=True)
        if shown.returncode == 0:
            files[value] = shown.stdout
    return files


def make_sandbox(sandbox: Path) -> None:
    (sandbox / "prelude.sh").write_text(PRELUDE)
    bin_dir = sandbox / "bin"
    bin_dir.mkdir()
    for tool in TEXT_TOOLS:
        found = shutil.which(tool)
        if found:
            (bin_dir / tool).symlink_to(found)
    date = bin_dir / "date"
    date.write_text(f"#!/bin/bash\necho {FIXED_DATE}\n")
    date.chmod(0o755)


def extract(mirrors: dict[str, str]) -> dict:
    out: dict = {"mirrors": {}, "scripts": []}
    with tempfile.TemporaryDirectory() as tmp:
        sandbox = Path(tmp)
        make_sandbox(sandbox)
        for name, git_dir in mirrors.items():
            commit, date = subprocess.run(["git", "-C", git_dir, "log", "-1", "--format=%H %cs", "HEAD"], check=True,
                                          capture_output=True, text=True).stdout.split()
            out["mirrors"][name] = {"commit": commit, "date": date}
            for rel_path in list_scripts(git_dir):
                text = subprocess.run(["git", "-C", git_dir, "show", f"HEAD:{rel_path}"], check=True,
                                      capture_output=True, text=True).stdout
                calls = run_script(text, rel_path, sandbox)
                files = {k: v for call in calls for k, v in verl_files_read(call["args"], git_dir).items()}
                out["scripts"].append({"mirror": name, "path": rel_path, "calls": calls, **({"files": files} if files
                                                                                           else {})})
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mirror", action="append", default=[], metavar="NAME=GIT_DIR",
                        help="a verl git directory to read (default: the two mirrors in MIRRORS)")
    parser.add_argument("--out", type=Path, default=HERE / "arguments.json")
    args = parser.parse_args(argv)
    mirrors = dict(m.split("=", 1) for m in args.mirror) or MIRRORS
    data = extract(mirrors)
    args.out.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")
    empty = [f"{s['mirror']}:{s['path']}" for s in data["scripts"] if not s["calls"]]
    print(f"wrote {args.out}: {len(data['scripts'])} scripts, {len(empty)} without a trainer call"
          + (f" ({', '.join(empty)})" if empty else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
