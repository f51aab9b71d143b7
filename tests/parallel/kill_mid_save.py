"""Crash a checkpoint save with SIGKILL, then check the previous checkpoint still loads (test_parallel_multiproc.py).

    python tests/parallel/kill_mid_save.py save ROOT   # saves step 1, then dies inside the save of step 2
    python tests/parallel/kill_mid_save.py load ROOT   # loads ROOT (latest) and compares with step 1

``save`` writes the step-1 weights to ROOT/../step1.safetensors before crashing; the kill happens
after every shard of step 2 is written and before its rename, the moment a non-atomic save would
leave a half-valid ``latest``. ``load`` prints a JSON line with its findings.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from meshrl.models.tiny import TinySpec, tiny_model_dir  # noqa: E402
from meshrl.parallel import checkpoint, hf_conversion, model_builder, optimizer, state  # noqa: E402


def _model():
    from transformers import AutoConfig

    path = tiny_model_dir(TinySpec())
    config = AutoConfig.from_pretrained(path)
    chunks = model_builder.build_model(config)
    hf_conversion.load_hf_weights(chunks, path)
    opt, sched = optimizer.build_optimizer(chunks, optimizer.OptimizerConfig(lr=1e-3))
    return config, chunks, opt, sched


def save(root: Path) -> None:
    from safetensors.torch import save_file

    config, chunks, opt, sched = _model()
    checkpoint.save_checkpoint(root, 1, chunks, opt, sched)
    save_file(dict(hf_conversion.iter_hf_weights(chunks, config)), str(root.parent / "step1.safetensors"))
    with torch.no_grad():
        for param in chunks[0].parameters():
            param.add_(1.0)

    def die(*_args, **_kwargs):
        os.kill(os.getpid(), signal.SIGKILL)

    checkpoint.publish_dir = die
    checkpoint.save_checkpoint(root, 2, chunks, opt, sched)
    raise AssertionError("unreachable: the save of step 2 should have been killed")


def load(root: Path) -> None:
    from safetensors.torch import load_file

    config, chunks, opt, sched = _model()
    with torch.no_grad():
        for param in chunks[0].parameters():
            param.zero_()
    result = checkpoint.load_checkpoint(root, chunks, opt, sched)
    reference = load_file(str(root.parent / "step1.safetensors"))
    weights = dict(hf_conversion.iter_hf_weights(chunks, config))
    print(json.dumps({"step": result["step"], "latest": (root / checkpoint.LATEST).read_text(),
                      "leftover_tmp": (root / ".step_00000002.tmp").exists(),
                      "max_diff": max(float((weights[k] - reference[k]).abs().max()) for k in reference)}))


if __name__ == "__main__":
    torch.set_num_threads(1)
    state.initialize(state.ParallelConfig())
    {"save": save, "load": load}[sys.argv[1]](Path(sys.argv[2]))
    state.destroy()
