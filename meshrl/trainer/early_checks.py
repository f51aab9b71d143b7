"""What a run reads and writes besides its config, checked before Ray or any worker starts.

Refusal rules (``meshrl.config.refusals``) of the ``files`` stage (run folder, devices, weights, converted
checkpoints), which ``meshrl.trainer.main.preflight`` enforces, and of the ``data`` stage (a full batch, the
checkpoint the run resumes from), which ``load_inputs`` enforces once the prompts are loaded (a resume must find
them as it left them). Each problem names the key or the file and what to do; the command prints it and exits 2
(``meshrl.trainer.main``).
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

from meshrl.config.refusals import Checked, refusal


@refusal("files", "trainer.default_local_dir")
def run_folder(c: Checked) -> list[str]:
    """``trainer.default_local_dir`` must be a folder this process can write (or create): ``run_folder_problem``."""
    return _listed(run_folder_problem(c.cfg.trainer.default_local_dir))


@refusal("files", "trainer.device", "trainer.n_gpus_per_node")
def devices(c: Checked) -> list[str]:
    """The GPUs the run asks for must be visible on this machine: ``device_problem``."""
    return _listed(device_problem(c.cfg))


@refusal("files", "actor_rollout_ref.model.path")
def model_weights(c: Checked) -> list[str]:
    """The policy's HF folder must hold safetensors weights (unless it starts from a converted checkpoint):
    ``model_weights_problem``."""
    from meshrl.models.resolve import resolve_model_path

    if c.cfg.actor_rollout_ref.actor.megatron.use_dist_checkpointing:
        return []
    return _listed(model_weights_problem("actor_rollout_ref.model.path",
                                         resolve_model_path(c.cfg.actor_rollout_ref.model.path)))


@refusal("files", "actor_rollout_ref.actor.megatron.dist_checkpointing_path", "critic.megatron.dist_checkpointing_path")
def converted_checkpoints(c: Checked) -> list[str]:
    """Each role started from a converted checkpoint must find one of its model there: ``dist_checkpoint_problems``."""
    return dist_checkpoint_problems(c.cfg, c.plan.use_reference, c.plan.use_critic, c.hf_config)


@refusal("launch", "MESHRL_MALLOC_MMAP_THRESHOLD")
def allocator_setting(c: Checked) -> list[str]:
    """The workers' allocator setting ``MESHRL_MALLOC_MMAP_THRESHOLD`` must be ``dynamic`` or a byte count glibc
    takes (``meshrl.process_memory.mmap_threshold_setting``; that module imports nothing of meshrl's, so it is here)."""
    from meshrl.process_memory import mmap_threshold_setting

    try:
        mmap_threshold_setting()
    except ValueError as error:
        return [str(error)]
    return []


def _listed(problem: str | None) -> list[str]:
    return [problem] if problem else []


def run_folder_problem(folder: str) -> str | None:
    """Why ``trainer.default_local_dir`` cannot hold the run (a file, or a place this process cannot write), or None.

    The folder is not created here: a run refused by a later check leaves nothing behind. A probe file is written
    and removed in the folder, or in its nearest existing parent when it does not exist yet.
    """
    path = Path(folder).expanduser()
    existing = path
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        what = "is a file" if existing == path else f"is inside {existing}, which is a file"
        return (f"trainer.default_local_dir={folder} {what}; the run writes its checkpoints, metrics and logs "
                "into a folder: point it at a new or an existing folder")
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as exc:
        return (f"trainer.default_local_dir={folder}: cannot write in {existing} ({exc.strerror}); point it at a "
                "folder you can write, e.g. trainer.default_local_dir=~/meshrl-runs/<name>")
    return None


def device_problem(cfg) -> str | None:
    """Why ``trainer.device`` / ``trainer.n_gpus_per_node`` cannot run on this machine's GPUs, or None.

    Only a run on this one machine is checked: with ``trainer.nnodes > 1``, ``RAY_ADDRESS`` or a Ray the caller
    already runs, the GPUs are (also) elsewhere, and Ray's placement says whether they are there. On CPU,
    ``n_gpus_per_node`` counts training processes, which share the cores (``meshrl.workers.dispatch``): more
    processes than cores run, slower, and are used so (tests run 2 or 4 ranks on 2 cores).
    """
    trainer = cfg.trainer
    ray = sys.modules.get("ray")
    if (trainer.device == "cpu" or trainer.nnodes > 1 or os.environ.get("RAY_ADDRESS")
            or (ray is not None and ray.is_initialized())):
        return None
    import torch

    count = torch.cuda.device_count()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    seen = f"CUDA_VISIBLE_DEVICES={visible!r}" if visible is not None else "torch"
    if count == 0:
        if trainer.device != "cuda":  # auto: a CPU run
            return None
        return (f"trainer.device=cuda, but {seen} sees no GPU on this machine; set trainer.device=cpu (or auto: the "
                "GPUs when there are some), or run where a GPU is visible")
    if trainer.n_gpus_per_node > count:
        return (f"trainer.n_gpus_per_node={trainer.n_gpus_per_node}, but {seen} sees {count} GPU(s) on this machine; "
                f"set trainer.n_gpus_per_node={count} or less (with parallel sizes that divide it), or join a Ray "
                "cluster that has them (RAY_ADDRESS, trainer.nnodes)")
    return None


def model_weights_problem(key: str, folder: Path) -> str | None:
    """Why the Hugging Face folder ``folder`` (given by ``key``) has no weights meshrl loads, or None: meshrl reads
    ``model.safetensors`` or the shards ``model.safetensors.index.json`` names (``meshrl.parallel.hf_conversion``)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        import json

        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            return f"{key}: {index} is not a safetensors index (a 'weight_map' of tensor -> file): {exc}"
        missing = [name for name in shards if not (folder / name).is_file()]
        if missing:
            return (f"{key}: {index} names {len(missing)} shard(s) the folder lacks ({', '.join(missing[:3])}"
                    f"{' …' if len(missing) > 3 else ''}); download the model's files again")
        return None
    if (folder / "model.safetensors").is_file():
        return None
    others = sorted(p.name for p in folder.glob("*.bin")) + sorted(p.name for p in folder.glob("*.pt"))
    found = (f"; it has {', '.join(others[:3])}: meshrl reads safetensors only, so load the model in transformers and "
             "save it with save_pretrained(folder, safe_serialization=True)") if others else \
        "; download the model's weight files into it"
    return f"{key}: {folder} has no weights (no model.safetensors or model.safetensors.index.json){found}"


def dist_checkpoint_problems(cfg, use_reference: bool, use_critic: bool, hf_config) -> list[str]:
    """Why a role's ``megatron.dist_checkpointing_path`` (with ``use_dist_checkpointing``) holds no checkpoint that
    role can start from, one line per role, each naming the command that makes one: the folder has no meshrl
    checkpoint, holds another model's (its spec against the role's HF config; ``hf_config``: the policy's), or a
    critic's for the policy. One language model's checkpoint serves the policy, the reference and the critic (whose
    value head then starts at zero: ``meshrl.parallel.checkpoint.load_checkpoint``), as verl's scripts point them at
    one."""
    from omegaconf import OmegaConf

    from meshrl.models.families import model_spec
    from meshrl.models.hf_config import load_model_config
    from meshrl.models.resolve import resolve_model_path
    from meshrl.parallel.checkpoint import checkpoint_folder, checkpoint_metadata
    from meshrl.parallel.model_builder import ModelSpec

    roles = {"actor_rollout_ref.actor": False, "actor_rollout_ref.ref": False, "critic": True}
    policy_model = cfg.actor_rollout_ref.model.path
    lines = []
    for role, critic in roles.items():
        megatron = OmegaConf.select(cfg, f"{role}.megatron")
        if (not megatron.use_dist_checkpointing or (role == "critic" and not use_critic)
                or (role == "actor_rollout_ref.ref" and not use_reference)):
            continue
        key, path = f"{role}.megatron.dist_checkpointing_path", megatron.dist_checkpointing_path
        model = (cfg.critic.model.path or policy_model) if critic else policy_model
        make = f"make one with `meshrl convert hf-to-mcore --hf {resolve_model_path(model)} --out {path}`"
        try:
            folder = checkpoint_folder(path)
        except RuntimeError as exc:  # a 'latest' naming an incomplete folder
            lines.append(f"{key}={path}: {exc}; {make}")
            continue
        if folder is None:
            lines.append(f"{key}={path}: no meshrl checkpoint there (no meshrl.json, no 'latest'); {make}")
            continue
        meta = checkpoint_metadata(folder)
        config = hf_config if model == policy_model else load_model_config(resolve_model_path(model))
        mismatches = ModelSpec(**meta["model_spec"]).mismatches(model_spec(config))
        if mismatches:
            lines.append(f"{key}={path}: {folder} is another model's checkpoint than {model} (checkpoint vs model: "
                         f"{'; '.join(mismatches)}); {make}")
        elif meta["critic"] and not critic:
            lines.append(f"{key}={path}: {folder} is a critic's checkpoint (a value head, no output layer); the "
                         f"policy starts from the language model's: {make} (without --critic)")
    return lines


@refusal("data", "data.train_batch_size")
def full_batch(c: Checked) -> list[str]:
    """The training prompts (after ``max_prompt_length`` filtering and ``train_max_samples``) must fill one batch."""
    data, cfg = c.train_data, c.cfg
    batch, available = cfg.data.train_batch_size, len(data)
    if available >= batch:
        return []
    why = [f"{data.num_filtered} longer than data.max_prompt_length={cfg.data.max_prompt_length} dropped"
           ] if data.num_filtered else []
    why += [f"data.train_max_samples={cfg.data.train_max_samples}"] if cfg.data.train_max_samples > 0 else []
    return [f"data.train_batch_size: {batch} prompts per step, but data.train_files holds only {available}"
            f"{' (' + '; '.join(why) + ')' if why else ''}: no full batch exists. Set data.train_batch_size={available}"
            " or less, or add prompts"]


@refusal("data", "trainer.resume_mode", "trainer.resume_from_path", "trainer.async_mode", "trainer.v1.trainer_mode")
def resume_checkpoint(c: Checked) -> list[str]:
    """The checkpoint the run would resume from (``trainer.resume_mode``), checked as the trainer will load it:
    it exists and is complete, its files are as its save wrote them (``checkpoint.damaged_files``), its driver
    state loads, it was saved by the trainer this config runs (synchronous, fully async / one-step-off, or verl V1's
    colocate_async: each keeps its own queue), and the prompt sampler finds the prompts it left. Each problem names
    the key or the damaged file, and the checkpoint to resume from instead."""
    from meshrl.data.sampler import PromptSampler
    from meshrl.trainer.checkpoint import (CheckpointError, complete_checkpoints, damaged_files, read_driver_state,
                                           resolve_checkpoint)

    cfg, trainer = c.cfg, c.cfg.trainer
    root = Path(trainer.default_local_dir).expanduser()
    key = "trainer.resume_from_path" if trainer.resume_mode == "resume_path" else "trainer.resume_mode"
    try:
        path = resolve_checkpoint(root, trainer.resume_mode, trainer.resume_from_path)
    except (CheckpointError, ValueError) as exc:
        there = Path(trainer.resume_from_path or root).expanduser().parent
        found = [p.name for p in complete_checkpoints(there)] if there.is_dir() else []
        listed = f" ({there} holds {', '.join(found)})" if found else ""
        return [f"{key}: {exc}{listed}"]
    if path is None or len(c.train_data) < cfg.data.train_batch_size:  # no batch: full_batch says so
        return []
    chosen = (f"trainer.resume_mode=auto resumes from {path}, the latest checkpoint in trainer.default_local_dir"
              if trainer.resume_mode == "auto" else f"trainer.resume_from_path={path}")
    damaged = damaged_files(path)
    if not damaged:  # a checkpoint saved before COMPLETE listed the sizes: its driver state is read instead
        try:
            state = read_driver_state(path)
        except CheckpointError as exc:
            damaged = [str(exc).removeprefix("cannot load the driver state ")]
    if damaged:
        return [f"{chosen}, but the checkpoint is damaged: {'; '.join(damaged)}. {_instead(path)}"]
    if problem := _trainer_problem(cfg, state, path):
        return [problem]
    sampler = PromptSampler(len(c.train_data), cfg.data.train_batch_size, shuffle=cfg.data.shuffle,
                            seed=cfg.data.seed)
    try:
        sampler.load_state_dict(state["sampler"])
    except ValueError as exc:
        return [f"{chosen}: {exc}"]
    return []


def _trainer_problem(cfg, state: dict, path: Path) -> str | None:
    """Why the trainer ``cfg`` runs (``trainer_modes.trainer_class``) cannot resume the driver ``state`` saved at
    ``path``, or None: each asynchronous trainer saves its queue under its own ``STATE_KEY``, which another trainer
    would drop."""
    from meshrl.trainer.async_trainer import AsyncRLTrainer
    from meshrl.trainer.colocate_async_trainer import ColocateAsyncTrainer
    from meshrl.trainer.trainer_modes import trainer_class

    runs = trainer_class(cfg).STATE_KEY
    saved = next((key for key in (AsyncRLTrainer.STATE_KEY, ColocateAsyncTrainer.STATE_KEY) if key in state), None)
    if saved == runs:
        return None
    if runs is None:
        return (f"trainer.async_mode: {path} was saved by an asynchronous trainer (trainer.async_mode, or "
                "trainer.v1.trainer_mode=colocate_async), whose prompts generated but not trained yet this trainer "
                "would skip: resume it with the config that saved it")
    if runs == AsyncRLTrainer.STATE_KEY:
        return (f"trainer.async_mode: {path} was saved by another trainer: it holds no rollouter state to resume "
                f"trainer.async_mode={cfg.trainer.async_mode} from; resume it with the config that saved it, or start "
                "this run afresh in another trainer.default_local_dir")
    return (f"trainer.v1.trainer_mode: {path} was not saved by verl V1's colocate_async trainer: it holds none of its "
            "prompt groups to resume from; resume it with the config that saved it, or start this run afresh in "
            "another trainer.default_local_dir")


def _instead(damaged: Path) -> str:
    """What to resume from instead of checkpoint ``damaged``: the newest whole one before it, by verl's keys (the
    same command would pick the damaged one again)."""
    from meshrl.trainer.checkpoint import complete_checkpoints, damaged_files, pruned_parts, step_of

    earlier = [p for p in complete_checkpoints(damaged.parent) if step_of(p) < step_of(damaged) and not pruned_parts(p)
               and not damaged_files(p)]
    if earlier:
        return (f"Resume from the one before it: trainer.resume_mode=resume_path "
                f"trainer.resume_from_path={earlier[-1]}")
    return ("No whole checkpoint before it is left: start over with trainer.resume_mode=disable (or another "
            "trainer.default_local_dir)")
