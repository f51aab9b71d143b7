"""The PPO critic: a Megatron GPTModel with a scalar value head (HF ``*ForTokenClassification`` layout),
initialised from the policy's checkpoint (value head at zero), trained on the GAE returns.

``values[b, t]`` is the value of the state that emits response token t (see ``meshrl.parallel.forward``).
``CriticGroup`` is the driver-side handle.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from meshrl.protocol import Batch
from meshrl.workers.actor_rollout_ref import optimizer_config, recompute_overrides
from meshrl.workers.dispatch import DispatchGroup
from meshrl.workers.objectives import CriticObjective, sum_metrics
from meshrl.workers.rank import RankWorker
from meshrl.workers.sequences import gather_response_outputs, response_part, split_micro_batches


class CriticWorker(RankWorker):
    def setup(self, address: tuple[str, int]) -> dict[str, Any]:
        from omegaconf import OmegaConf
        from transformers import AutoConfig, AutoTokenizer

        from meshrl.parallel.forward import OutputRequest
        from meshrl.parallel.hf_conversion import load_hf_weights
        from meshrl.parallel.model_builder import build_model, packed_sequences, param_dtype
        from meshrl.parallel.optimizer import build_optimizer

        megatron = OmegaConf.create(self.cfg_dict).critic.megatron
        self._init_distributed(address, megatron, int(os.environ.get("MESHRL_THREADS", "1")))
        critic = self.cfg.critic
        self.hf_config = AutoConfig.from_pretrained(self.model_dir)
        tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.model = build_model(self.hf_config, critic=True, dtype=param_dtype(megatron.dtype),
                                 use_distributed_optimizer=megatron.use_distributed_optimizer,
                                 **recompute_overrides(critic.model))
        load_hf_weights(self.model, self.model_dir, self.hf_config)
        self.optimizer, self.scheduler = build_optimizer(
            self.model, optimizer_config(critic.optim, critic.grad_clip, megatron.use_distributed_optimizer))
        self.objective = CriticObjective.from_config(self.cfg)
        # Packed THD micro-batches (no compute on padding) unless critic.model.use_remove_padding says no
        # or the device has no fast variable-length attention (model_builder.packed_sequences).
        self.request = OutputRequest(remove_padding=packed_sequences(critic.model.use_remove_padding))
        self.response_length = self.cfg.data.max_response_length
        return {**self.layout_dict(), "num_replicas": self.layout.dp_size}

    def _batching(self, phase: str):
        """Micro-batching of ``critic_values`` / ``critic_update`` (``meshrl.config.micro_batching``)."""
        from meshrl.config.micro_batching import micro_batching

        return micro_batching(self.cfg, phase, self.layout.dp_size)

    def compute_values(self, shard: Batch) -> Batch | None:
        from meshrl.parallel import state
        from meshrl.parallel.schedule import forward_only

        plan, rows, micros = split_micro_batches(shard, self._batching("critic_values"), state.dp_group(),
                                                 self.pad_id, min_micro=self.cfg.critic.megatron.pipeline_model_parallel_size)
        outputs = forward_only(self.model, micros, self.request)
        parts = [response_part(o["values"], m) for o, m in zip(outputs, micros)]
        values = gather_response_outputs(parts, plan, rows, self.response_length)
        return Batch(tensors={"values": values}) if self.layout.collect else None

    def update(self, updates: list[tuple[Batch, Any]]) -> dict[str, float]:
        import torch.distributed as dist

        from meshrl.parallel import state
        from meshrl.parallel.optimizer import train_step

        per_step = []
        for shard, norm in updates:
            plan, _, micros = split_micro_batches(shard, self._batching("critic_update"), state.dp_group(),
                                                  self.pad_id, response_fields=("values", "returns"),
                                                  min_micro=self.cfg.critic.megatron.pipeline_model_parallel_size)

            def loss_fn(outputs, micro, norm=norm):
                return self.objective(response_part(outputs["values"], micro), micro, norm)

            result = train_step(self.model, self.optimizer, self.scheduler, micros, loss_fn, self.request)
            shares = sum_metrics(result["metrics"])
            values = torch.tensor(list(shares.values()), dtype=torch.float64,
                                  device=state.collective_device(state.dp_group()))
            dist.all_reduce(values, group=state.dp_group())
            metrics = dict(zip(shares, values.tolist()))
            metrics.update({"critic/lr": result["lr"],
                            "critic/grad_norm": result["grad_norm"] if result["grad_norm"] is not None else float("nan")})
            per_step.append(metrics)
        return {key: float(np.mean([m[key] for m in per_step])) for key in per_step[0]}

    def save_checkpoint(self, folder: str, step: int) -> None:
        from meshrl.parallel.checkpoint import save_checkpoint

        save_checkpoint(Path(folder) / "critic", step, self.model, self.optimizer, self.scheduler)

    def load_checkpoint(self, folder: str) -> None:
        from meshrl.parallel.checkpoint import load_checkpoint

        load_checkpoint(Path(folder) / "critic", self.model, self.optimizer, self.scheduler)


class CriticGroup(DispatchGroup):
    def __init__(self, cfg, model_dir) -> None:
        super().__init__(CriticWorker, cfg, model_dir, name="critic")

    def compute_values(self, batch: Batch) -> Batch:
        needed = batch.select(["prompt_ids", "responses", "response_mask"])
        return batch.union(self.dispatch("compute_values", needed))

    def update(self, updates: list[tuple[Batch, Any]]) -> dict[str, float]:
        per_dp: list[list[tuple[Batch, Any]]] = [[] for _ in range(self.dp_size)]
        for mini, norm in updates:
            mini = mini.select(["prompt_ids", "responses", "response_mask", "values", "returns"])
            for dp_rank, rows in enumerate(self.split(mini, self.dp_size, balance=True)):
                per_dp[dp_rank].append((mini.take(rows), norm))
        return self.group.call_per_rank("update", self.per_dp_rank(per_dp))[0]

    def save_checkpoint(self, folder: Path, step: int) -> None:
        self.group.call("save_checkpoint", str(folder), step)

    def load_checkpoint(self, folder: Path) -> None:
        self.group.call("load_checkpoint", str(folder))
