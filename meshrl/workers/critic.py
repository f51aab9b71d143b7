"""The PPO critic: a Megatron GPTModel with a scalar value head (HF ``*ForTokenClassification`` layout),
initialised from the policy's checkpoint (value head at zero), trained on the GAE returns.

With ``critic.megatron.param_offload`` / ``grad_offload`` / ``optimizer_offload`` (or ``fsdp_config``'s
twins) the critic's state sits in host memory outside its own phases — the rollout engine and the policy
have the device meanwhile: its parameters come back for the values pass, everything for the update and
checkpoints. On a CPU-only machine the state is in host memory already and nothing moves.

``values[b, t]`` is the value of the state that emits response token t (see ``meshrl.parallel.forward``).
``CriticGroup`` is the driver-side handle.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

from meshrl.process_memory import trims_heap
from meshrl.protocol import Batch
from meshrl.workers.model_setup import load_initial_weights, optimizer_config, transformer_overrides
from meshrl.workers.dispatch import DispatchGroup
from meshrl.workers.engine import NonFinitePolicy, TrainingEngine
from meshrl.workers.objectives import CriticObjective
from meshrl.workers.rank import RankWorker
from meshrl.workers.sequences import response_part, sequence_fields


class CriticWorker(RankWorker):
    SECTION = "critic"

    def setup(self, address: tuple[str, int]) -> dict[str, Any]:
        from transformers import AutoConfig, AutoTokenizer

        from meshrl.parallel.forward import OutputRequest
        from meshrl.parallel.model_builder import build_model, packed_sequences, param_dtype
        from meshrl.parallel.optimizer import build_optimizer

        critic = self.section
        megatron = critic.megatron
        self._init_distributed(address, self.plan.critic_layout, megatron.seed,
                               int(os.environ.get("MESHRL_THREADS", "1")))
        trust = {"trust_remote_code": critic.model.trust_remote_code}
        self.hf_config = AutoConfig.from_pretrained(self.model_dir, **trust)
        tokenizer = AutoTokenizer.from_pretrained(critic.model.tokenizer_path or self.model_dir, **trust)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.model = build_model(self.hf_config, critic=True, dtype=param_dtype(megatron.dtype),
                                 use_distributed_optimizer=megatron.use_distributed_optimizer,
                                 **transformer_overrides(critic.model, megatron))
        load_initial_weights(self.model, megatron, self.model_dir, self.hf_config)
        self.optimizer, self.scheduler = build_optimizer(
            self.model, optimizer_config(critic.optim, megatron.use_distributed_optimizer))
        self.objective = CriticObjective.from_config(critic, self.plan)
        # Packed THD micro-batches (no compute on padding) unless critic.model.use_remove_padding says no
        # or the device has no fast variable-length attention (model_builder.packed_sequences).
        self.request = OutputRequest(remove_padding=packed_sequences(critic.model.use_remove_padding))
        self.response_length = self.plan.response_length
        self.train_engine = TrainingEngine("critic", self.model, self.optimizer, self.scheduler, self.pad_id,
                                           min_micro=megatron.pipeline_model_parallel_size,
                                           nonfinite=NonFinitePolicy.from_settings(self.plan.workers),
                                           hint="check the rewards and returns, or lower critic.optim.lr")
        self._init_offload()
        return {**self.layout_dict(), "num_replicas": self.layout.dp_size}

    # ---------------------------------------------------------------------------------- offload
    def _init_offload(self) -> None:
        from meshrl.parallel.offload import HostBuffers

        mg, critic = self.section.megatron, self.section
        fsdp = (critic.fsdp_config, critic.model.fsdp_config, critic.fsdp)  # verl's three places of the section
        self.offload_params = mg.param_offload or any(f.param_offload for f in fsdp)
        self.offload_training = {"grads": mg.grad_offload,
                                 "optimizer_state": mg.optimizer_offload or any(f.optimizer_offload for f in fsdp)}
        self.host_buffers = HostBuffers()  # pinned once, reused every step (pinning is the slow part)
        self.offloaded: dict[str, Any] = {}
        self._offload(training=True)

    def _offload(self, training: bool) -> None:
        from meshrl.parallel.offload import offload

        if self.offload_params:
            self.offloaded["params"] = offload(self.model, params=True, grads=False, optimizer_state=False,
                                               buffers=self.host_buffers)
        if training and any(self.offload_training.values()):
            self.offloaded["training"] = offload(self.model, self.optimizer, params=False, buffers=self.host_buffers,
                                                 **self.offload_training)

    @contextlib.contextmanager
    def _on_device(self, training: bool):
        """The block runs with the parameters (and, ``training``, gradients and optimizer state) on the device."""
        parts = ("params", "training") if training else ("params",)
        for part in parts:
            if part in self.offloaded:
                self.offloaded.pop(part).restore()
        try:
            yield
        finally:
            self._offload(training)

    # ---------------------------------------------------------------------------------- phases
    @trims_heap
    def compute_values(self, shard: Batch) -> Batch | None:
        with self._on_device(training=False):
            values = self.train_engine.forward(shard, self.plan.micro_batching["critic_values"], self.request,
                                               "values", self.response_length)
        return Batch(tensors={"values": values}) if self.layout.collect else None

    @trims_heap
    def update(self, updates: list[tuple[Batch, Any]]) -> dict[str, float]:
        """One optimizer step per (mini-batch shard, its normaliser) of ``critic``'s own schedule, one
        LR-schedule step per call (``meshrl.workers.engine``)."""
        def loss_fn(outputs, micro, norm):
            return self.objective(response_part(outputs["values"], micro), micro, norm)

        with self._on_device(training=True):
            metrics, _ = self.train_engine.train(updates, self.plan.micro_batching["critic_update"], self.request,
                                                 loss_fn, ("values", "returns"))
        return metrics

    def save_checkpoint(self, folder: str, step: int) -> None:
        from meshrl.parallel.checkpoint import save_checkpoint

        with self._on_device(training=True):
            save_checkpoint(Path(folder) / "critic", step, self.model, self.optimizer, self.scheduler)

    def load_checkpoint(self, folder: str) -> None:
        from meshrl.parallel.checkpoint import load_checkpoint

        with self._on_device(training=True):
            load_checkpoint(Path(folder) / "critic", self.model, self.optimizer, self.scheduler)

    def export_hf(self, out_dir: str) -> None:
        from meshrl.parallel.hf_conversion import save_hf_checkpoint

        with self._on_device(training=False):
            if self.layout.writer:  # the replicas hold the same weights; two writers would race on the folder
                save_hf_checkpoint(self.model, self.hf_config, out_dir, tokenizer_dir=self.model_dir)


class CriticGroup(DispatchGroup):
    def __init__(self, cfg, plan, model_dir) -> None:
        super().__init__(CriticWorker, cfg, plan, model_dir)

    def compute_values(self, batch: Batch) -> Batch:
        needed = batch.select(sequence_fields(batch))
        return batch.union(self.dispatch("compute_values", needed))

    def update(self, updates: list[tuple[Batch, Any]]) -> dict[str, float]:
        per_dp: list[list[tuple[Batch, Any]]] = [[] for _ in range(self.dp_size)]
        for mini, norm in updates:
            mini = mini.select([*sequence_fields(mini), "values", "returns"])
            for dp_rank, rows in enumerate(self.split(mini, self.dp_size, balance=True)):
                per_dp[dp_rank].append((mini.take(rows), norm))
        return self.group.call_per_rank("update", self.per_dp_rank(per_dp))[0]

    def save_checkpoint(self, folder: Path, step: int) -> None:
        self.group.call("save_checkpoint", str(folder), step)

    def load_checkpoint(self, folder: Path) -> None:
        self.group.call("load_checkpoint", str(folder))

    def export_hf(self, out_dir: Path) -> None:
        """The critic as an HF ``*ForTokenClassification`` folder (value head ``score``), as verl exports it."""
        self.group.call("export_hf", str(out_dir))
