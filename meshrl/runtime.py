"""Process-wide runtime settings: the project cache folder and the environment of the engines.

Every cache meshrl or its engines write (model conversions, vLLM, torch inductor, Ray temp files,
Hugging Face) lives under one folder, ``cache_dir()``, never scattered in the home directory:

    $MESHRL_CACHE_DIR                          if set
    <repo>/.cache                              for an editable install (the repo holds setup.py)
    $XDG_CACHE_HOME/meshrl or ~/.cache/meshrl  otherwise

``configure_environment()`` must run before vLLM, Ray or transformers are imported; entry points call
it first. It only sets variables the user has not set, so a user's choice always wins.
"""

from __future__ import annotations

import os
from pathlib import Path

_PACKAGE_DIR = Path(__file__).resolve().parent


def cache_dir() -> Path:
    """The project cache folder (created on first use)."""
    env = os.environ.get("MESHRL_CACHE_DIR")
    if env:
        path = Path(env)
    elif (_PACKAGE_DIR.parent / "setup.py").is_file():
        path = _PACKAGE_DIR.parent / ".cache"
    else:
        base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        path = Path(base) / "meshrl"
    path.mkdir(parents=True, exist_ok=True)
    return path


def has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def configure_environment() -> None:
    """Point every engine's caches at ``cache_dir()`` and keep a single machine offline and on loopback."""
    root = cache_dir()
    defaults = {
        # No hub is reachable: fail fast instead of retrying network calls.
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_HOME": str(root / "huggingface"),
        "VLLM_CACHE_ROOT": str(root / "vllm"),
        "TORCHINDUCTOR_CACHE_DIR": str(root / "inductor"),
        "TRITON_CACHE_DIR": str(root / "triton"),
        "RAY_TMPDIR": str(root / "ray"),
        # Ray: no token auth file in $HOME, no telemetry, and stay on 127.0.0.1 on one node.
        "RAY_AUTH_MODE": "disabled",
        "RAY_USAGE_STATS_ENABLED": "0",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "MPLCONFIGDIR": str(root / "matplotlib"),
    }
    if not os.environ.get("RAY_ADDRESS"):
        # Single node: keep Ray on 127.0.0.1. Not on a cluster: children inherit it, and `ray start
        # --address` then refuses to join.
        defaults["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    for key, value in defaults.items():
        os.environ.setdefault(key, value)
    # Ray expects its temp dir to exist.
    Path(os.environ["RAY_TMPDIR"]).mkdir(parents=True, exist_ok=True)
