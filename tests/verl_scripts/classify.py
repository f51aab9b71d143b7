"""Does meshrl load verl's example scripts? Classify every call in ``arguments.json``.

    python tests/verl_scripts/classify.py     # rewrite classification.json from the current meshrl

Each call's arguments go through what ``python -m meshrl.trainer.main`` does before training
(``parse_args``, ``load_config``, ``preflight``), with the model/data paths (the Megatron checkpoint
folders too: the scripts name them by environment variables) and hardware sizes swapped to CPU-sized
values (``cpu_swaps()``, appended as a user's own overrides are; ``PATH_SWAPS`` where a script sets them). The outcome:

- ``ok``: loads and validates;
- ``load``: ``load_config`` refuses ``keys`` (unknown keys, wrong types, an engine meshrl lacks);
- ``invalid``: loads, but ``preflight`` (config checks, rollout engine settings, the Ray start) names ``keys``
  (values meshrl does not support);
- ``no call``: the script launches no trainer (it only points elsewhere).

``classification.json`` keeps the outcome of every script; under ``features``, the keys that block a
load grouped by the verl feature they belong to (``FEATURES``, first match wins), each key with the
number of scripts it blocks; under ``invalid_features``, likewise the keys that validation refuses.
``tests/foundation/test_verl_invocation.py`` checks the table.
"""

from __future__ import annotations

import json
import re
import tempfile
import warnings
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
ARGUMENTS = HERE / "arguments.json"
CLASSIFICATION = HERE / "classification.json"

PARALLEL = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
            "expert_model_parallel_size")
CPU_SWAPS = [
    "actor_rollout_ref.model.path=tiny:llama",
    "critic.model.path=tiny:llama",
    "reward_model.model.path=tiny-rm:llama",
    "reward.reward_model.model_path=tiny-rm:llama",
    "data.train_files=embedded:gsm8k/train",
    "data.val_files=embedded:gsm8k/test",
    # a script's SandboxFusion deployment cannot be reached from here: null starts meshrl's local sandbox
    "reward_model.sandbox_fusion.url=null",
    "trainer.nnodes=1",
    "trainer.n_gpus_per_node=2",
    "trainer.device=cpu",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
    # the rollout's expert parallelism follows its TP (1 here); TensorRT-LLM's MoE TP size too
    "actor_rollout_ref.rollout.expert_parallel_size=1",
    "actor_rollout_ref.rollout.moe_tensor_parallel_size=1",
    # lengths within the tiny model's 2,048 positions (vLLM serves no further: a length check of preflight)
    "data.max_prompt_length=256",
    "data.max_response_length=64",
    "actor_rollout_ref.rollout.prompt_length=256",
    "actor_rollout_ref.rollout.response_length=64",
    "actor_rollout_ref.rollout.max_model_len=320",
    *(f"{section}.megatron.{size}=1" for section in ("actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic",
                                                     "reward_model") for size in PARALLEL),
    *(f"{section}.megatron.virtual_pipeline_model_parallel_size=null"
      for section in ("actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic")),
]


def cpu_swaps() -> list[str]:
    """``CPU_SWAPS``, and the Megatron checkpoint folders the scripts name pointed at tiny:llama's converted one
    (``converted_checkpoint``: preflight checks that a role's folder holds its model's checkpoint)."""
    checkpoint = converted_checkpoint()
    return [*CPU_SWAPS, *(f"{section}.megatron.dist_checkpointing_path={checkpoint}"
                          for section in ("actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic"))]


def converted_checkpoint(folder: Path | None = None) -> Path:
    """The HF ``folder`` (tiny:llama's by default) as ``meshrl convert hf-to-mcore`` writes it (the scripts' step 1),
    built once into meshrl's cache."""
    import subprocess
    import sys

    from meshrl.atomic_io import cached_dir
    from meshrl.models.tiny import tiny_model_dir, tiny_spec
    from meshrl.runtime import cache_dir

    folder = folder or tiny_model_dir(tiny_spec("llama"))

    def build(tmp: Path) -> None:
        subprocess.run([sys.executable, "-m", "meshrl.parallel.convert_cli", "hf-to-mcore", "--hf", str(folder),
                        "--out", str(tmp)], check=True, capture_output=True)

    return cached_dir(cache_dir() / "models" / f"{folder.name}-mcore", "latest", build)
# Paths a script sets only where it uses the feature, swapped (appended as CPU_SWAPS are) where it sets them: a reward
# file of verl's repository scores verl's data; meshrl's test reward (GSM8K rows in verl's dict form, with GDPO's
# components accuracy_reward and format_reward beside the score) stands in for it, as the data's paths are swapped.
PATH_SWAPS = {r"(reward\.)?custom_reward_function\.path": str(HERE / "gdpo_reward.py")}
# The asynchronous trainers' rollout pool, sized like the training processes where a script sets it.
SIZE_SWAPS = {r"rollout\.nnodes": "1", r"rollout\.n_gpus_per_node": "1"}
# verl's entry module -> meshrl's config without --config-name (meshrl.trainer.one_step_off_main, fully_async_main)
ENTRY_CONFIGS = {"verl.trainer.main_ppo": None,
                 "verl.experimental.one_step_off_policy.main_ppo": "one_step_off_ppo_trainer",
                 "verl.experimental.fully_async_policy.fully_async_main": "fully_async_ppo_trainer"}
# The verl feature a key that meshrl refuses belongs to: (feature, pattern searched in the key).
FEATURES = [
    ("other training engines (VeOmni, Megatron Lite, Hydra config groups)",
     r"\.veomni\.|\.engine\.|^hydra\.|@|^model_engine$"),
    ("Megatron FSDP", r"megatron_fsdp"),
    ("FSDP-only settings", r"fsdp_config\.|\.fsdp\."),
    ("LoRA", r"lora|target_modules|exclude_modules"),
    ("sandbox execution", r"sandbox"),
    ("reward model / reward loop",
     r"^reward_model\.(enable|rollout|model|use_reward_loop|micro_batch|max_length)|^reward\.reward_model\."),
    ("reward manager settings (DAPO overlong buffer; verl's new reward.* section)", r"^reward_model\.|^reward\."),
    ("multi-turn rollout", r"multi_turn"),
    ("multi-modal data (images, video)", r"image|mm_|vision"),
    ("custom dataset classes", r"custom_cls"),
    ("MoE / expert parallelism", r"expert|moe_|router|routing"),
    ("Megatron transformer overrides (recompute, fusions, stage layout)", r"override_transformer_config"),
    ("Megatron optimizer CPU offload", r"override_optimizer_config|optim\.optimizer$"),
    ("Megatron distributed checkpoints", r"dist_checkpointing"),
    ("fused kernels", r"fused_kernel"),
    ("Ulysses sequence parallelism", r"ulysses"),
    ("profiling", r"profiler"),
    ("rollout correction, PF-PPO", r"rollout_correction|pf_ppo"),
    ("rollout engine settings", r"^actor_rollout_ref\.rollout\."),
    ("entropy memory savers", r"entropy_"),
    ("other keys", r""),
]
# A validation problem is listed as "  - KEY: message" (meshrl.config.validate), a refused feature's as
# "  - KEY=VALUE, KEY=VALUE: message" (meshrl.config.key_policy).
_PROBLEM_KEY = re.compile(r"^\s*- ([\w.]+):", re.MULTILINE)
_REFUSED_KEY = re.compile(r"(?:^\s*- |, )((?:\w+\.)+\w+)=", re.MULTILINE)


def script_id(script: dict) -> str:
    return f"{script['mirror']}:{script['path']}"


def path_swaps(args: list[str]) -> list[str]:
    """``PATH_SWAPS`` and ``SIZE_SWAPS`` for the keys ``args`` set, as overrides."""
    keys = [arg.lstrip("+").partition("=")[0] for arg in args]
    return [f"{key}={value}" for key in keys for pattern, value in {**PATH_SWAPS, **SIZE_SWAPS}.items()
            if re.fullmatch(pattern, key)]


def with_verl_files(args: list[str], files: dict[str, str], folder: Path) -> list[str]:
    """``args`` with verl's checkout (``/verl``, as ``arguments.json`` names it) moved to ``folder``, where the
    script's recorded ``files`` (its verl config files, ``extract.verl_files_read``) are written: the path swap a user
    makes who keeps verl's example configs elsewhere."""
    for path, text in files.items():
        target = folder / path.removeprefix("/verl/")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
    return [re.sub(r"(^|=)/verl/", lambda m: f"{m.group(1)}{folder}/", arg) for arg in args]


def entry_config(module: str) -> str | None:
    """The config a call of verl's entry ``module`` loads without --config-name (``ENTRY_CONFIGS``)."""
    return ENTRY_CONFIGS[next(m for m in ENTRY_CONFIGS if module.startswith(m))]


def classify(args: list[str], module: str = "verl.trainer.main_ppo") -> dict:
    """The outcome of one call of ``module`` with ``args`` (module docstring): ``{"outcome": ..., "keys": [...]}``."""
    from meshrl.config import ConfigError, load_config
    from meshrl.trainer.main import parse_args, preflight

    recipe, overrides = parse_args([*args, *cpu_swaps(), *path_swaps(args)], entry_config(module))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # model_engine=dp's note, expected for verl's FSDP scripts
            cfg = load_config(overrides, recipe=recipe)
    except ConfigError as exc:
        return {"outcome": "load", "keys": sorted(set(exc.keys))}
    try:
        preflight(cfg)
    except ConfigError as exc:
        found = _PROBLEM_KEY.findall(str(exc)) + _REFUSED_KEY.findall(str(exc))
        return {"outcome": "invalid", "keys": sorted(set(found) | set(exc.keys))}
    return {"outcome": "ok", "keys": []}


def classify_script(script: dict) -> dict:
    if not script["calls"]:
        return {"outcome": "no call", "keys": []}
    # Every script in the folders makes one trainer call (extract.py records them all).
    (call,) = script["calls"]
    with tempfile.TemporaryDirectory() as folder:
        return classify(with_verl_files(call["args"], script.get("files", {}), Path(folder)), call["module"])


def feature_of(key: str) -> str:
    return next(name for name, pattern in FEATURES if re.search(pattern, key))


def classification(arguments: dict) -> dict:
    scripts = {script_id(s): classify_script(s) for s in arguments["scripts"]}
    counts: dict[str, int] = defaultdict(int)
    for result in scripts.values():
        counts[result["outcome"]] += 1
    return {"summary": dict(sorted(counts.items())), "scripts": scripts,
            "features": _by_feature(scripts, "load"), "invalid_features": _by_feature(scripts, "invalid")}


def _by_feature(scripts: dict[str, dict], outcome: str) -> dict[str, dict[str, int]]:
    """The keys named by the scripts of ``outcome``, grouped by feature, each with its number of scripts."""
    blocked: dict[str, list[str]] = defaultdict(list)
    for name, result in scripts.items():
        if result["outcome"] == outcome:
            for key in result["keys"]:
                blocked[key].append(name)
    features: dict[str, dict[str, int]] = {name: {} for name, _ in FEATURES}
    for key in sorted(blocked, key=lambda k: (-len(blocked[k]), k)):
        features[feature_of(key)][key] = len(blocked[key])
    return {name: keys for name, keys in features.items() if keys}


def main() -> int:
    table = classification(json.loads(ARGUMENTS.read_text()))
    CLASSIFICATION.write_text(json.dumps(table, indent=1) + "\n")
    print(f"wrote {CLASSIFICATION}: {table['summary']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
