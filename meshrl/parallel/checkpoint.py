"""Distributed checkpoints (megatron ``dist_checkpointing``, ``torch_dist``): model, optimizer, LR schedule.

Layout under a root folder (which every rank must see, e.g. one machine or a shared filesystem)::

    root/step_00000042/     megatron checkpoint + meshrl.json (step, model spec, layout at save time)
    root/latest             "step_00000042"

Checkpoints are layout-independent: saved at TP2 they load at TP1, TP1xPP2, TP2xPP2, ... with
optimizer state (non-distributed or distributed optimizer) and the LR schedule.

Saving is atomic (``meshrl.atomic_io``): ranks write into ``root/.step_00000042.tmp``; rank 0 then
publishes it as ``step_00000042`` (fsync, rename) and only then replaces ``latest`` the same way. A
crash at any point leaves ``latest`` naming the previous complete checkpoint; leftovers are removed by
the next save.

A checkpoint holds finite numbers only: before anything is written every rank checks its weights and
optimizer state (main parameters, Adam moments), and a NaN or inf anywhere makes every rank raise
``NonFiniteCheckpointError`` naming the tensors, with ``latest`` untouched. Loading checks the same, so a
diverged checkpoint written before this check existed is named at resume rather than failing later.

Entry scripts must be guarded by ``if __name__ == "__main__":``: the first save starts a helper
process that re-imports ``__main__``.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from meshrl.atomic_io import publish_dir, write_text_atomically
from meshrl.parallel import state
from meshrl.parallel.model_builder import unwrap
from meshrl.parallel.offload import _optimizer_tensors
from meshrl.parallel.optimizer import initialize_state
from meshrl.runtime import forks_die_with_this_process

LATEST = "latest"
_META = "meshrl.json"
# A critic's value head (model_builder.ValueHead) sits where a language model's output layer does.
VALUE_HEAD_PREFIX = "output_layer."
# The DistributedOptimizer's only format in megatron-core 0.16 that reshards across TP/PP; the
# memory-efficient variant gathers a replica's state on its DP rank 0 over gloo, in host memory (and
# avoids a CUDA-only path). Other optimizers ignore these keys.
_OPTIMIZER_FORMAT = {"distrib_optim_sharding_type": "fully_reshardable",
                     "distrib_optim_fully_reshardable_mem_efficient": True}


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


class NonFiniteCheckpointError(FloatingPointError):
    """Weights or optimizer state hold NaN or inf: the checkpoint is refused (saving) or unusable (loading)."""


def _nonfinite_tensors(chunks: list[torch.nn.Module], optimizer) -> list[str]:
    """Names of the weights, then optimizer tensors, holding NaN or inf on any rank; the same list on every rank."""
    named = [((f"chunk{index}." if len(chunks) > 1 else "") + name, param)
             for index, chunk in enumerate(chunks) for name, param in unwrap(chunk).named_parameters()]
    weights = {id(param) for _, param in named}
    if optimizer is not None:
        # fp32 training steps the weights themselves: those main parameters are checked once.
        named += [("optimizer state", t) for t in _optimizer_tensors(optimizer) if id(t) not in weights]
    named = [(name, t.detach()) for name, t in named if t.numel()]
    # min and max propagate NaN: no tensor-sized temporary, and one device sync for all tensors.
    flags = torch.stack([torch.isfinite(torch.stack(t.aminmax())).all() for _, t in named]).tolist() if named else []
    local = [name for (name, _), ok in zip(named, flags) if not ok]
    per_rank: list[list[str]] = [[] for _ in range(dist.get_world_size())]
    dist.all_gather_object(per_rank, local)
    return [f"{name} (rank {rank})" for rank, names in enumerate(per_rank) for name in names]


def _describe_nonfinite(names: list[str]) -> str:
    weights = [n for n in names if not n.startswith("optimizer state")]
    shown = ", ".join(weights[:4]) + (f" and {len(weights) - 4} more" if len(weights) > 4 else "")
    state = len(names) - len(weights)
    return ", ".join(part for part in ((f"{len(weights)} weight tensor(s): {shown}" if weights else ""),
                                       (f"{state} optimizer state tensor(s)" if state else "")) if part)


def _sharded_state(chunks: list[torch.nn.Module], optimizer, scheduler, extra: Any, is_loading: bool) -> dict:
    model = {f"chunk{index}": unwrap(chunk).sharded_state_dict() for index, chunk in enumerate(chunks)}
    sharded: dict[str, Any] = {"model": model}
    if optimizer is not None:
        # megatron maps each parameter to its sharded tensor by walking this nested dict's values.
        sharded["optimizer"] = optimizer.sharded_state_dict(model, is_loading=is_loading, metadata=_OPTIMIZER_FORMAT)
    if scheduler is not None:
        sharded["scheduler"] = scheduler.state_dict()
    if extra is not None:
        sharded["extra"] = extra
    return sharded


def _uses_distributed_optimizer(chunks: list[torch.nn.Module]) -> bool:
    ddp_config = getattr(chunks[0], "ddp_config", None)
    return bool(ddp_config is not None and ddp_config.use_distributed_optimizer)


def save_checkpoint(root: str | os.PathLike, step: int, chunks: list[torch.nn.Module], optimizer=None,
                    scheduler=None, extra: Any = None, keep_last: int | None = None) -> Path:
    """Save ``chunks`` (and optimizer, scheduler, picklable ``extra``) as ``root/step_{step}``; collective.

    ``keep_last`` deletes older ``step_*`` folders beyond the newest ``keep_last`` after the save.
    Returns the checkpoint folder.

    Raises:
        NonFiniteCheckpointError: on every rank, before anything is written, when a weight or optimizer
            tensor on any rank holds NaN or inf.
    """
    from megatron.core import dist_checkpointing

    root = Path(root)
    bad = _nonfinite_tensors(chunks, optimizer)
    if bad:
        raise NonFiniteCheckpointError(
            f"refusing to save step {step} of the {root.name}: {_describe_nonfinite(bad)} hold NaN or inf, so "
            "the training diverged. Nothing was written and the previous checkpoint stays the latest; resume "
            "from it with a lower learning rate (or check the rewards).")
    final = root / step_dir_name(step)
    tmp = root / f".{final.name}.tmp"
    rank0 = dist.get_rank() == 0
    if rank0:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob(".step_*.tmp"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir()
    dist.barrier()
    if optimizer is not None:
        # An optimizer that has not stepped yet has no state; zero moments and step 0 behave the same
        # and give every checkpoint the same format.
        initialize_state(optimizer)
    sharded = _sharded_state(chunks, optimizer, scheduler, extra, is_loading=False)
    with forks_die_with_this_process():  # megatron's writers: orphaned, they would wait forever
        dist_checkpointing.save(sharded, str(tmp))
    dist.barrier()
    if rank0:
        gpt = unwrap(chunks[0])
        meta = {"step": step, "critic": bool(getattr(gpt, "meshrl_critic", False)),
                "model_spec": gpt.meshrl_spec.to_dict(), "parallel_at_save": vars(state.current()),
                "has_optimizer": optimizer is not None,
                "distributed_optimizer": optimizer is not None and _uses_distributed_optimizer(chunks),
                "optimizer_parts": _optimizer_parts(optimizer)}
        (tmp / _META).write_text(json.dumps(meta, indent=1, default=str))
        # The aside name matches the clean-up glob above, so an interrupted replace is removed too.
        publish_dir(tmp, final, aside=root / f".{final.name}.replaced.tmp")
        write_text_atomically(root / LATEST, final.name, tmp=root / f".{LATEST}.tmp")
        if keep_last is not None:
            for old in sorted(root.glob("step_*"))[:-keep_last]:
                if old != final:
                    shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


def _optimizer_parts(optimizer) -> int | None:
    """How many optimizers megatron chains in ``optimizer`` (the dense parameters' and, at EP > 1, the experts'); None
    without one."""
    return None if optimizer is None else len(getattr(optimizer, "chained_optimizers", [optimizer]))


def _saved_optimizer_parts(meta: dict[str, Any]) -> int:
    """``_optimizer_parts`` of a checkpoint's optimizer; for a checkpoint saved before meshrl recorded it, megatron's
    rule: a mixture of experts at EP > 1 has two."""
    if "optimizer_parts" in meta:
        return meta["optimizer_parts"]
    moe = bool(meta["model_spec"].get("num_experts"))
    return 2 if moe and meta["parallel_at_save"].get("expert_parallel", 1) > 1 else 1


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    """The folder ``root/latest`` names, or None when there is no complete checkpoint yet."""
    pointer = Path(root) / LATEST
    if not pointer.is_file():
        return None
    folder = Path(root) / pointer.read_text().strip()
    if not (folder / _META).is_file():
        raise RuntimeError(f"{pointer} names {folder.name}, which is not a complete meshrl checkpoint")
    return folder


def checkpoint_folder(path: str | os.PathLike) -> Path | None:
    """The checkpoint folder ``path`` names: itself when it holds one, else the one its ``latest`` names; None when
    there is none (``latest_checkpoint`` raises for a ``latest`` naming an incomplete folder)."""
    path = Path(path)
    return path if (path / _META).is_file() else latest_checkpoint(path)


def checkpoint_metadata(folder: str | os.PathLike) -> dict[str, Any]:
    return json.loads((Path(folder) / _META).read_text())


def load_checkpoint(path: str | os.PathLike, chunks: list[torch.nn.Module], optimizer=None,
                    scheduler=None) -> dict[str, Any]:
    """Load a checkpoint into ``chunks`` (and optimizer / scheduler when given); collective.

    ``path`` is a checkpoint root (its ``latest`` is used) or a ``step_*`` folder. The model spec saved
    with the checkpoint must equal the chunks' (else ``ValueError`` naming the fields). A critic's weights (no
    ``optimizer``) may come from a language model's checkpoint of the same spec, as verl's scripts point the critic
    at the policy's converted checkpoint: its decoder, and the zero value head a critic built from an HF causal LM
    gets (``hf_conversion.load_hf_weights``). Returns ``{"step": int, "extra": ...}``.
    """
    from megatron.core import dist_checkpointing

    from meshrl.parallel.model_builder import ModelSpec

    folder = checkpoint_folder(path)
    if folder is None:
        raise FileNotFoundError(f"no checkpoint in {path}")
    meta = checkpoint_metadata(folder)
    gpt = unwrap(chunks[0])
    saved = ModelSpec(**meta["model_spec"])
    mismatches = saved.mismatches(gpt.meshrl_spec)
    critic = bool(getattr(gpt, "meshrl_critic", False))
    language_model_into_critic = critic and not meta["critic"] and optimizer is None
    if mismatches or (meta["critic"] != critic and not language_model_into_critic):
        detail = mismatches + ([f"critic: {meta['critic']} vs {critic}"] if meta["critic"] != critic else [])
        raise ValueError(f"checkpoint {folder} does not match the model (checkpoint vs model): " + "; ".join(detail))
    if optimizer is not None and not meta["has_optimizer"]:
        raise ValueError(f"checkpoint {folder} has no optimizer state")
    if optimizer is not None and meta["distributed_optimizer"] != _uses_distributed_optimizer(chunks):
        raise ValueError(f"checkpoint {folder} was saved with use_distributed_optimizer="
                         f"{meta['distributed_optimizer']}; build the optimizer the same way to load it")
    if optimizer is not None and (saved_parts := _saved_optimizer_parts(meta)) != _optimizer_parts(optimizer):
        saved_ep = meta["parallel_at_save"].get("expert_parallel", 1)
        raise ValueError(
            f"checkpoint {folder}: its optimizer state is {saved_parts} megatron optimizer(s) (saved at "
            f"expert_model_parallel_size={saved_ep}) and this layout builds {_optimizer_parts(optimizer)} "
            f"(expert_model_parallel_size={state.current().expert_parallel}): at EP > 1 megatron steps the experts "
            "with an optimizer of their own, and megatron-core 0.16.1 maps neither state onto the other. Resume at "
            f"an expert-parallel size {'> 1' if saved_ep > 1 else 'of 1'} (the checkpoint loads at any of those, "
            "with any TP / PP), or start a new run from its weights (HF export, or dist_checkpointing_path) with a "
            "fresh optimizer")
    if optimizer is not None:
        initialize_state(optimizer)
    sharded = _sharded_state(chunks, optimizer, scheduler, extra=None, is_loading=True)
    if language_model_into_critic:  # the value head stays as built: not asked of the checkpoint
        for chunk_state in sharded["model"].values():
            for key in [key for key in chunk_state if key.startswith(VALUE_HEAD_PREFIX)]:
                del chunk_state[key]
    loaded = dist_checkpointing.load(sharded, str(folder))
    for index, chunk in enumerate(chunks):
        missing, unexpected = unwrap(chunk).load_state_dict(loaded["model"][f"chunk{index}"],
                                                            strict=not language_model_into_critic)
        if [key for key in missing if not key.startswith(VALUE_HEAD_PREFIX)] or unexpected:
            raise ValueError(f"checkpoint {folder}: chunk {index} missing {missing}, unexpected {unexpected}")
    if optimizer is not None:
        optimizer.load_state_dict(loaded["optimizer"])
    bad = _nonfinite_tensors(chunks, optimizer)
    if bad:
        raise NonFiniteCheckpointError(
            f"checkpoint {folder} holds NaN or inf ({_describe_nonfinite(bad)}): it was saved after the training "
            "diverged. Resume from an earlier checkpoint (trainer.resume_mode=resume_path).")
    if scheduler is not None:
        scheduler.load_state_dict(loaded["scheduler"])
    return {"step": meta["step"], "extra": loaded.get("extra")}
