"""The policy worker: one process per device holding the policy's Megatron shard and optimizer, the
reference model's shard (only when a KL term is used; forward-only: no gradient buffer, and with
``ref.megatron.param_offload`` in host memory except while its log-probs are computed), and a
colocated rollout engine.

Per step the driver calls, in order: ``generate`` (engine), ``compute_log_probs`` (reference and
policy, forward-only), ``update`` (``ppo_epochs`` × mini-batches, one optimizer step each),
``sync_weights`` (Megatron shard → engine, in place, through the resharding layer).
``ActorRolloutRefGroup`` is the driver-side handle that dispatches those calls.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

from meshrl.parallel import router_replay
from meshrl.parallel.router_replay import ROUTES
from meshrl.parallel.vision_language import MULTI_MODAL_INPUTS
from meshrl.process_memory import trims_heap
from meshrl.protocol import Batch
from meshrl.workers.dispatch import DispatchGroup
from meshrl.workers.engine import MICRO_INDEX, NonFinitePolicy, TrainingEngine
from meshrl.workers.memory_metrics import update_memory
from meshrl.workers.model_setup import load_initial_weights, optimizer_config, transformer_overrides, with_lora
from meshrl.workers.objectives import ActorObjective
from meshrl.workers.rank import RankWorker
from meshrl.workers.routes import routes_in_row_order
from meshrl.workers.sequences import response_part, responses_batch, sequence_fields


LORA_ADAPTER_DIR = "lora_adapter"


def actor_offload(actor) -> tuple[bool, bool, bool]:
    """Which of the actor's parameters, optimizer state and gradients go to host memory while the engine generates
    (``actor_rollout_ref.actor``'s ``*_offload`` keys: Megatron's, or verl's FSDP spelling of the first two)."""
    return (bool(actor.megatron.param_offload or actor.fsdp_config.param_offload),
            bool(actor.megatron.optimizer_offload or actor.fsdp_config.optimizer_offload),
            bool(actor.megatron.grad_offload))


class ActorRolloutRefWorker(RankWorker):
    SECTION = "actor_rollout_ref"
    _background = None  # the generation start_generate began (a Future), until finish_generate
    _generation_thread = None  # its one thread, made on first use
    _stream = None  # the partial rollout across steps (verl V1 colocate_async), made on first stream_submit
    _stop = None  # what stream_finish sets to stop the stream_start run early (a threading.Event)

    # ---------------------------------------------------------------------------------- set-up
    def setup(self, address: tuple[str, int], start_engine: bool = True) -> dict[str, Any]:
        """Join the process group, build the policy (and reference) and, unless ``start_engine`` is False (then
        ``start_engine()`` does, later), the rollout engine; returns the rank's layout, with ``startup``: seconds
        spent on the imports below, the models and the engine."""
        started = time.monotonic()  # before the imports: the libraries' import is most of a start on CPU
        from transformers import AutoTokenizer

        from meshrl.data.chat_template import use_chat_template
        from meshrl.models.hf_config import load_model_config
        from meshrl.parallel.model_builder import (build_forward_only_model, build_model, packed_sequences,
                                                    param_dtype, shared_prompts_unsupported)
        from meshrl.parallel.compiled import compile_elementwise
        from meshrl.parallel.offload import HostBuffers, offload
        from meshrl.parallel.optimizer import build_optimizer

        arr = self.section
        actor = arr.actor
        threads = int(os.environ.get("MESHRL_THREADS", "1"))
        imported = time.monotonic()
        self._init_distributed(address, self.plan.actor_layout, actor.megatron.seed, threads)
        trust = {"trust_remote_code": arr.model.trust_remote_code}
        self.hf_config = load_model_config(self.model_dir, arr.model.override_config, **trust)
        # the driver rendered the prompts with the same template (meshrl.data.chat_template); the multi-turn loop
        # renders the tool and user turns with it
        self.tokenizer = use_chat_template(AutoTokenizer.from_pretrained(arr.model.tokenizer_path or self.model_dir,
                                                                         **trust), arr.model.custom_chat_template)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None \
            else self.tokenizer.eos_token_id
        distributed_opt = actor.megatron.use_distributed_optimizer
        self.policy = build_model(self.hf_config, dtype=param_dtype(actor.megatron.dtype),
                                  use_distributed_optimizer=distributed_opt,
                                  freeze_vision_tower=actor.freeze_vision_tower,
                                  **transformer_overrides(arr.model, actor.megatron))
        load_initial_weights(self.policy, actor.megatron, self.model_dir, self.hf_config)
        if self.plan.lora is not None:  # the optimizer then holds the adapters only
            self.policy = with_lora(self.policy, self.plan.lora)
        if "policy" in self.plan.torch_compile:
            compile_elementwise(self.policy)
        # router_replay.mode=R2: the old-log-prob pass records each token's experts, the update replays them
        self.replay_routes = actor.megatron.router_replay.mode == "R2"
        if self.replay_routes:
            router_replay.install(self.policy)
        self.optimizer, self.scheduler = build_optimizer(
            self.policy, optimizer_config(actor.optim, distributed_opt))
        self.train_engine = TrainingEngine(
            "actor", self.policy, self.optimizer, self.scheduler, self.pad_id,
            min_micro=actor.megatron.pipeline_model_parallel_size,
            nonfinite=NonFinitePolicy.from_settings(self.plan.workers),
            hint="check the rewards and advantages, or lower actor_rollout_ref.actor.optim.lr")
        self.ref = self.ref_offloaded = None
        # Pinned host memory for offloads, allocated once and reused every step (pinning is the slow part).
        self.host_buffers = HostBuffers()
        self._version_weights: list | None = None  # keep_version_weights' copy (the fully async trainer's)
        if self.plan.use_reference and self.plan.lora is None:  # with LoRA: the policy's base, adapters off
            # Forward passes only: no DDP gradient buffer (as large as the fp32 weights) for it.
            ref_dtype = arr.ref.megatron.dtype if arr.ref.megatron.dtype != "auto" else actor.megatron.dtype
            ref_overrides = transformer_overrides(arr.model, arr.ref.megatron)
            if actor.megatron.sequence_parallel:  # the reference shares the actor's layout (config.validate)
                ref_overrides["sequence_parallel"] = True
            self.ref = build_forward_only_model(self.hf_config, dtype=param_dtype(ref_dtype), **ref_overrides)
            load_initial_weights(self.ref, arr.ref.megatron, self.model_dir, self.hf_config)
            if "reference" in self.plan.torch_compile:
                compile_elementwise(self.ref)
            if arr.ref.megatron.param_offload or arr.ref.fsdp_config.param_offload:
                self.ref_offloaded = offload(self.ref, params=True, grads=False, optimizer_state=False,
                                            buffers=self.host_buffers)
        self.objective = ActorObjective.from_config(actor, self.plan)
        # Policy and reference run packed THD micro-batches (no compute on padding) unless the key says no
        # or the device has no fast variable-length attention (model_builder.packed_sequences).
        self.remove_padding = packed_sequences(arr.model.use_remove_padding)
        # actor.use_prefix_grouper: a group's prompt computed once for its responses, in the update and the
        # old-log-prob and reference passes, where the models run the layout
        # (model_builder.shared_prompts_unsupported); unset, where the passes are packed (on CUDA without
        # Transformer Engine per-slot attention is launch-bound)
        self.shared_prompts_off = None if self.plan.shared_prompts is False else shared_prompts_unsupported(
            self.policy + (self.ref or []))
        self.shared_prompts = self.shared_prompts_off is None and (
            self.plan.shared_prompts or (self.plan.shared_prompts is None and self.remove_padding))
        self.response_length = self.plan.response_length
        # LoRA: the engine serves the adapters (vLLM's adapter path) or is sent merged weights
        self.adapter_sync = self.plan.lora is not None and not self.plan.lora.merge
        self.replica = self.rank // self.plan.rollout_tensor_parallel
        startup = {"imports": imported - started, "models": time.monotonic() - imported}
        if start_engine:
            startup.update(self.start_engine())
        return {**self.layout_dict(), "replica": self.replica,
                "replica_leader": self.rank % self.plan.rollout_tensor_parallel == 0,
                "num_replicas": self.world_size // self.plan.rollout_tensor_parallel, "startup": startup,
                "shared_prompts_off": self.shared_prompts_off}

    def start_engine(self) -> dict[str, float]:
        """The rollout engine, after ``setup(start_engine=False)``: a run starts it once every group has loaded its
        models, as verl starts its rollout last, so that a GPU engine sizes its cache on the memory they left
        (``meshrl.trainer.worker_start``). Returns ``{"engine": seconds}``."""
        from meshrl.models.families import implicit_fields
        from meshrl.models.hf_config import model_overrides
        from meshrl.rollout.agent_loop import agent_loop_for
        from meshrl.rollout.async_engine import async_engine_for
        from meshrl.rollout.base import EngineConfig, SamplingConfig
        from meshrl.rollout.engines import create_engine

        started = time.monotonic()
        arr, rollout = self.section, self.section.rollout
        threads = int(os.environ.get("MESHRL_THREADS", "1"))
        # verl's sleep level 2 (vLLM >= 0.8.5: drop the weights while training; the policy's come back at the next
        # sync), but 1 (keep them) when only adapters are synced: verl resends the base with the adapters after a
        # level-2 sleep, meshrl keeps the base and sends the adapters alone.
        engine_cfg = EngineConfig.from_rollout(
            rollout, max_model_len=self.plan.prompt_length + self.response_length,
            generation_threads=threads, max_lora_rank=self.plan.lora.rank if self.adapter_sync else 0,
            sleep_level=1 if self.adapter_sync else 2,
            # the family's fields vLLM would read otherwise when absent, then the run's own overrides
            hf_overrides={**implicit_fields(self.hf_config), **model_overrides(arr.model.override_config)})
        self.engine = create_engine(self.model_dir, engine_cfg, dp_rank=self.replica)
        self.bucket_bytes = engine_cfg.bucket_bytes
        if not self.engine.weights_complete:  # rollout.load_format=dummy: random weights until the policy's arrive
            self.sync_weights()
        train = SamplingConfig.from_rollout(rollout, max_response_length=self.response_length)
        self.sampling = {"train": train, "greedy": train.as_greedy(),
                         "val": SamplingConfig.from_rollout(rollout, max_response_length=self.response_length,
                                                            validation=True)}
        # rollout.mode=async: one request per sample (one coroutine per conversation) on this engine's core.
        self.async_engine = async_engine_for(rollout, self.engine)
        # rollout.multi_turn: conversations with tools, turn by turn on this engine (None: single-turn).
        self.agent_loop = agent_loop_for(rollout, self.engine, self.tokenizer, self.response_length,
                                         self.async_engine)
        # The engine sleeps between rollouts (releases its GPU memory; on CPU its KV cache, and at level 2 its weights).
        self.engine.sleep()
        return {"engine": time.monotonic() - started}

    # ---------------------------------------------------------------------------------- rollout
    @trims_heap
    def generate(self, prompts: Batch, mode: str) -> Batch | None:
        """``rollout.n`` responses per prompt (``mode``: train | greedy | val); rows prompt-major. With
        ``rollout.multi_turn.enable`` each is a conversation with tools (and interactions, which read the prompts'
        ``raw_prompt``) and the rows carry its ``agent_stats``."""
        from meshrl.rollout.agent_loop import AGENT_STATS
        from meshrl.rollout.weight_sync import colocated_rollout

        sampling = self.sampling[mode]
        if self.engine.weights_dropped:  # a level-2 sleep with no update since (start-up, validation): sync first
            self.sync_weights()
        offload, onload = self._offload_hooks()
        with colocated_rollout(self.engine, offload_trainer=offload, onload_trainer=onload):
            # a vision-language model's prompts carry their images (only engines that take them get any)
            images = {"images": list(prompts[MULTI_MODAL_INPUTS])} if MULTI_MODAL_INPUTS in prompts else {}
            if self.agent_loop is None:
                completions = (self.async_engine or self.engine).generate([list(p) for p in prompts["prompt_ids"]],
                                                                          sampling, **images)
            else:
                completions, stats = self.agent_loop.generate(
                    [list(p) for p in prompts["prompt_ids"]], sampling, list(prompts["extra_info"]),
                    list(prompts["raw_prompt"]) if "raw_prompt" in prompts else None, **images)
        out = responses_batch(prompts, completions, sampling.n, self.response_length, self.pad_id)
        if self.agent_loop is not None:
            out.set(AGENT_STATS, stats)
        return out if self.rank % self.plan.rollout_tensor_parallel == 0 else None

    def start_generate(self, prompts: Batch, mode: str) -> None:
        """``generate`` on a thread of this worker, while its next calls (log-prob passes, the update) run: the
        asynchronous trainers' rollouter overlapping the trainer (``meshrl.trainer.async_trainer``). Only where the
        two share nothing: an inference replica of one rank (no collective in generation) and no trainer state
        offloaded while the engine generates; ``finish_generate`` returns the result, and nothing may touch the
        engine (a weight sync) before it."""
        if self._background is not None:
            raise RuntimeError("start_generate() while a generation is in flight: finish_generate() first")
        if self.plan.rollout_tensor_parallel != 1 or any(actor_offload(self.section.actor)):
            raise RuntimeError("overlapped generation needs rollout.tensor_model_parallel_size=1 and no trainer "
                               "offload (meshrl.trainer.async_trainer.why_serial decides before calling)")
        if self._generation_thread is None:
            self._generation_thread = ThreadPoolExecutor(1, thread_name_prefix="meshrl-rollouter")
        self._background = self._generation_thread.submit(self.generate, prompts, mode)

    def finish_generate(self) -> Batch | None:
        """The result of the generation ``start_generate`` began (waiting for it); its error if it failed."""
        if self._background is None:
            raise RuntimeError("finish_generate() without a generation in flight")
        future, self._background = self._background, None
        return future.result()

    # ------------------------------------------------ partial rollout across steps (verl V1 colocate_async)
    def stream_submit(self, prompts: Batch, keys: list[int]) -> None:
        """Queue one group of ``rollout.n`` samples per prompt on this rank's ``RolloutStream`` (generated by the
        next ``stream_run``)."""
        from meshrl.rollout.rollout_stream import RolloutStream

        if not keys:  # nothing for this replica: no engine call index taken
            return
        if self.engine.weights_dropped:  # a level-2 sleep with no update since: the engine takes no request
            self.sync_weights()
        if self._stream is None:
            self._stream = RolloutStream(self.engine)
        self._stream.submit(keys, [list(p) for p in prompts["prompt_ids"]], self.sampling["train"])

    @trims_heap
    def stream_run(self, until: int | None, version: int, wait_for: list[int],
                   stop: threading.Event | None = None) -> list[int]:
        """Generate on the engine's weights (policy ``version``) until ``until`` groups are finished and every
        group of ``wait_for`` is (``None``: every group), or ``stop`` is set, then abort the rest (kept for the next
        run); the finished groups' keys."""
        from meshrl.rollout.weight_sync import colocated_rollout

        if self.engine.weights_dropped:
            self.sync_weights()
        offload, onload = self._offload_hooks()
        with colocated_rollout(self.engine, offload_trainer=offload, onload_trainer=onload):
            return self._stream.run(until, version, wait_for=wait_for, stop=stop) if self._stream is not None else []

    def stream_start(self, version: int) -> None:
        """``stream_run`` of every submitted group on this worker's generation thread (as ``start_generate``), while
        the worker trains: verl's fully async rollouter with ``partial_rollout``. ``stream_finish`` ends it."""
        if self._background is not None:
            raise RuntimeError("stream_start() while a generation is in flight: stream_finish() first")
        if self._generation_thread is None:
            self._generation_thread = ThreadPoolExecutor(1, thread_name_prefix="meshrl-rollouter")
        self._stop = threading.Event()
        self._background = self._generation_thread.submit(self.stream_run, None, version, [], self._stop)

    def stream_finish(self, stop: bool) -> list[int]:
        """The keys of the groups finished by the run ``stream_start`` began: waiting until every group is finished,
        or with ``stop`` at once (after the engine step in progress; the unfinished keep their tokens for the next
        run, on the weights of then)."""
        if self._background is None:
            return []
        if stop:
            self._stop.set()
        return self.finish_generate()

    def stream_take(self, prompts: Batch, keys: list[int]) -> Batch | None:
        """The finished groups ``keys`` (prompts: their rows, in that order) as ``generate``'s rows, each token's
        policy version in ``rollout_policy_version``; removed from the stream. None for no keys."""
        if not keys:  # a replica with nothing finished (or never given a group)
            return None
        completions = [c for group in self._stream.take(keys) for c in group]
        return responses_batch(prompts, completions, self.sampling["train"].n, self.response_length, self.pad_id)

    def stream_drop(self, keys: list[int]) -> None:
        self._stream.drop(keys)

    def _offload_hooks(self):
        """Trainer state to move to host memory while the engine generates (``*_offload`` keys)."""
        from meshrl.parallel.offload import offload

        params, optimizer_state, grads = actor_offload(self.section.actor)
        if not (params or optimizer_state or grads):
            return None, None
        held = []
        return (lambda: held.append(offload(self.policy, self.optimizer, params=params, grads=grads,
                                            optimizer_state=optimizer_state, buffers=self.host_buffers)),
                lambda: held.pop().restore())

    # ---------------------------------------------------------------------------------- log-probs
    @trims_heap
    def compute_log_probs(self, shard: Batch, model: str) -> Batch | None:
        """Per-token log-probs of the responses under the policy (``old_log_probs``), under the policy's weights kept
        at its version's start (``model="version"``: ``keep_version_weights``; ``old_log_probs`` too) or under the
        reference (``ref_log_probs``); forward-only, micro-batches of the ``rollout.log_prob_*`` / ``ref.log_prob_*``
        keys (``meshrl.config.micro_batching``). The policy's pass also gives ``sum_pi_squared`` (each token's
        Σ_v π_v²) with ``actor.calculate_sum_pi_squared`` (``run_plan``)."""
        from meshrl.parallel.forward import OutputRequest
        from meshrl.parallel.lora import adapters_disabled

        base_of_policy = model == "ref" and self.plan.lora is not None
        chunks, phase, field = {
            "actor": (self.policy, "actor_log_prob", "old_log_probs"),
            "version": (self.policy, "actor_log_prob", "old_log_probs"),
            "ref": (self.policy if base_of_policy else self.ref, "ref_log_prob", "ref_log_probs"),
        }[model]
        if chunks is None:
            raise RuntimeError("compute_log_probs(model='ref') without a reference model: "
                               "enable algorithm.use_kl_in_reward or actor.use_kl_loss")
        # The samples came from softmax(logits / T): the reference and the policy are evaluated at T too (verl).
        squares = model != "ref" and self.plan.sum_pi_squared
        request = OutputRequest(log_probs=True, temperature=self.plan.temperature, remove_padding=self.remove_padding,
                                fused_chunk_size=self.plan.fused_chunk_size, sum_pi_squared=squares,
                                shared_prompts=self.shared_prompts)
        out = {}
        with self._reference_on_device() if model == "ref" else contextlib.nullcontext(), \
                self._version_weights_in() if model == "version" else contextlib.nullcontext(), \
                adapters_disabled(chunks) if base_of_policy else contextlib.nullcontext(), \
                self._recording_routes(model, out):
            got = self.train_engine.forward_outputs(
                shard, self.plan.micro_batching[phase], request,
                ("log_probs", "sum_pi_squared") if squares else ("log_probs",), self.response_length, chunks=chunks,
                on_split=out.get("on_split"))
        out = {ROUTES: out[ROUTES]} if ROUTES in out else {}
        if squares:
            out["sum_pi_squared"] = got["sum_pi_squared"]
        return Batch(tensors={field: got["log_probs"], **out}) if self.layout.collect else None

    @contextlib.contextmanager
    def _recording_routes(self, model: str, out: dict):
        """Router replay (R2): around the policy's old-log-prob pass, record the experts of every token;
        ``out[ROUTES]`` then holds them in row order (``meshrl.workers.routes``). The reference routes natively."""
        if model == "ref" or not self.replay_routes:
            yield
            return
        with router_replay.recording(self.policy) as record:
            def on_split(split):
                out[ROUTES] = routes_in_row_order(record.gather(split.micros), split, self.plan.prompt_length,
                                                  self.response_length)

            out["on_split"] = on_split
            yield

    def keep_version_weights(self) -> None:
        """Keep a host copy of the policy's trainable weights: the fully async trainer calls this at a version's
        first local step (the weights the engine was just given), and its later local steps' old-log-prob passes run
        on the copy (``compute_log_probs(..., model="version")``), as verl's fully async trainer saves and restores
        the model (``save_model_to_cpu(1)``) with ``rollout_correction.bypass_mode=False``. Frozen weights (a LoRA
        run's base) do not change within a version and are not copied."""
        self._version_weights = [p.detach().to("cpu", copy=True) for p in self._trainable_weights()]

    def _trainable_weights(self) -> list:
        return [p for chunk in self.policy for p in chunk.parameters() if p.requires_grad]

    @contextlib.contextmanager
    def _version_weights_in(self):
        """The policy holds the weights ``keep_version_weights`` kept inside the block, its own again after."""
        import torch

        if self._version_weights is None:
            raise RuntimeError("compute_log_probs(model='version') before keep_version_weights()")
        weights = self._trainable_weights()
        current = [p.detach().to("cpu", copy=True) for p in weights]
        with torch.no_grad():
            for param, kept in zip(weights, self._version_weights, strict=True):
                param.copy_(kept)
        try:
            yield
        finally:
            with torch.no_grad():
                for param, own in zip(weights, current, strict=True):
                    param.copy_(own)

    @contextlib.contextmanager
    def _reference_on_device(self):
        """An offloaded reference (``ref.*.param_offload``) is on the device inside the block only: its
        one forward pass per step is all that reads it (what ``meshrl plan`` counts)."""
        if self.ref_offloaded is None:
            yield
            return
        from meshrl.parallel.offload import offload

        self.ref_offloaded.restore()
        try:
            yield
        finally:
            self.ref_offloaded = offload(self.ref, params=True, grads=False, optimizer_state=False,
                                         buffers=self.host_buffers)

    # ---------------------------------------------------------------------------------- update
    @trims_heap
    def update(self, updates: list[tuple[Batch, Any]], on_policy: bool = False
               ) -> tuple[dict[str, float], Batch | None]:
        """One optimizer step per (mini-batch shard, its global normaliser), one LR-schedule step per call
        (``meshrl.workers.engine``); metrics averaged over the optimizer steps.

        ``on_policy`` (one update whose policy is the one that sampled the batch, see
        ``run_plan.on_policy_update``): the shards carry no ``old_log_probs``; the loss takes
        logπ_θ.detach() in their place (ratio exactly 1, the gradient of the recompute), and the
        collecting ranks also return those log-probs as this shard's ``old_log_probs`` (row order).
        Returns (metrics, that batch or None).
        """
        from meshrl.parallel.forward import OutputRequest

        if on_policy and len(updates) != 1:
            raise ValueError(f"an on-policy update is one optimizer step, got {len(updates)} mini-batches")
        fields = ("advantages",) + (() if on_policy else ("old_log_probs",)) \
            + (("ref_log_probs",) if self.plan.kl_loss is not None else ()) \
            + (("rollout_is_weights",) if "rollout_is_weights" in updates[0][0] else ())  # rollout_correction
        request = OutputRequest(log_probs=True, entropy=self.objective.needs_entropy, temperature=self.plan.temperature,
                                remove_padding=self.remove_padding, fused_chunk_size=self.plan.fused_chunk_size,
                                shared_prompts=self.shared_prompts)
        seen = {}

        def loss_fn(outputs, micro, norm):
            log_probs = response_part(outputs["log_probs"], micro)
            if on_policy:
                seen[micro[MICRO_INDEX]] = log_probs.detach()
                micro = {**micro, "old_log_probs": log_probs.detach()}
            entropy = response_part(outputs["entropy"], micro) if request.entropy else None
            return self.objective(log_probs, entropy, micro, norm)

        memory: dict[str, float] = {}
        with update_memory(memory):
            metrics, splits = self.train_engine.train(updates, self.plan.micro_batching["actor_update"], request,
                                                      loss_fn, fields)
        metrics.update(memory)
        if self.replay_routes:
            metrics.update(self._replay_metrics())
        if not (on_policy and self.layout.collect):
            return metrics, None
        # The last pipeline stage (where collecting ranks sit) ran loss_fn on every micro-batch.
        parts = [seen[index].cpu() for index in range(len(splits[0].micros))]
        return metrics, Batch(tensors={"old_log_probs": splits[0].gather(parts, self.response_length)})

    def _replay_metrics(self) -> dict[str, float]:
        """``actor/replayed_route_changes``: of the update's replayed token routes (a token at an MoE layer), the share
        whose recorded experts are not those the policy being updated would choose (0 while its weights are the old
        ones); every rank's routers count their own tokens. Absent when nothing was replayed (an on-policy update:
        no old-log-prob pass recorded any)."""
        import torch
        import torch.distributed as dist

        from meshrl.collectives import collective_device

        counts = torch.tensor(router_replay.take_replay_counts(self.policy), dtype=torch.float64,
                              device=collective_device())
        dist.all_reduce(counts)
        replayed, changed = counts.tolist()
        return {"actor/replayed_route_changes": changed / replayed} if replayed else {}

    # ---------------------------------------------------------------------------------- weights
    @trims_heap
    def sync_weights(self) -> dict[str, float]:
        """Stream the policy's weights into the engine (resharding layer); every MP rank takes part. With LoRA
        (``RunPlan.lora.merge``) either the adapters alone (vLLM's adapter path; the frozen base first if the
        engine lacks it: a dummy start, a failed sync) or the merged weights W + scaling·B·A."""
        from meshrl.parallel import peft_io
        from meshrl.parallel.hf_conversion import iter_hf_weights

        if self.adapter_sync:
            seconds = gigabytes = buckets = 0.0
            if not self.engine.weights_complete:
                base = self.engine.load_weights(iter_hf_weights(self.policy, self.hf_config),
                                                bucket_bytes=self.bucket_bytes)
                seconds, gigabytes, buckets = base.seconds, base.bytes / 1e9, float(base.buckets)
            stats = self.engine.load_adapter(peft_io.iter_adapter_weights(self.policy),
                                             peft_io.adapter_config(peft_io.settings_of(self.policy), self.model_dir))
            return {"sync/seconds": seconds + stats.seconds, "sync/gigabytes": gigabytes + stats.bytes / 1e9,
                    "sync/buckets": buckets + stats.buckets}
        stats = self.engine.load_weights(self.hf_weights(), bucket_bytes=self.bucket_bytes)
        return {"sync/seconds": stats.seconds, "sync/gigabytes": stats.bytes / 1e9,
                "sync/buckets": float(stats.buckets)}

    def save_checkpoint(self, folder: str, step: int) -> None:
        from meshrl.parallel.checkpoint import save_checkpoint

        save_checkpoint(Path(folder) / "actor", step, self.policy, self.optimizer, self.scheduler,
                        extra={"engine": self.engine.state_dict()})
        if self.plan.lora is not None and self.layout.writer:
            from meshrl.parallel.peft_io import save_adapter

            # verl's place for it: PeftModel.from_pretrained(base, global_step_N/actor/lora_adapter)
            save_adapter(self.policy, Path(folder) / "actor" / LORA_ADAPTER_DIR, base_model=self.model_dir)

    def load_checkpoint(self, folder: str) -> None:
        from meshrl.parallel.checkpoint import load_checkpoint

        loaded = load_checkpoint(Path(folder) / "actor", self.policy, self.optimizer, self.scheduler)
        self.engine.load_state_dict(loaded["extra"]["engine"])
        self.sync_weights()  # the engine must serve the resumed policy, not the initial one

    def hf_weights(self):
        """The policy as the HF model it computes: its HF-named tensors, with LoRA each adapted weight merged
        (``W + scaling·B·A``); what the merged sync sends and the HF export writes."""
        from meshrl.parallel import peft_io
        from meshrl.parallel.hf_conversion import iter_hf_weights

        return (iter_hf_weights if self.plan.lora is None else peft_io.iter_merged_weights)(self.policy, self.hf_config)

    def export_hf(self, out_dir: str) -> None:
        from meshrl.parallel.hf_conversion import save_hf_checkpoint

        if self.layout.writer:  # the replicas hold the same weights; two writers would race on the folder
            save_hf_checkpoint(self.policy, self.hf_config, out_dir, tokenizer_dir=self.model_dir,
                               weights=self.hf_weights())

    def shutdown_engine(self) -> None:
        self.engine.shutdown()

    def _release_role(self) -> bool:
        """The engine shut down and the rollouter's thread ended; not with a generation in flight, nor a multi-turn
        agent loop (its tools' and interactions' threads and clients are the tools' own)."""
        if self._background is not None or getattr(self, "agent_loop", None) is not None:
            return False
        if self._generation_thread is not None:
            self._generation_thread.shutdown(wait=True)
        if getattr(self, "engine", None) is not None:
            self.engine.shutdown()
        return True


class ActorRolloutRefGroup(DispatchGroup):
    """Driver-side handle: the calls of ``RLTrainer.train_step`` on the policy workers."""

    def __init__(self, cfg, plan, model_dir, start_engine: bool = True) -> None:
        super().__init__(ActorRolloutRefWorker, cfg, plan, model_dir, {"start_engine": start_engine})
        why = self.layouts[0].get("shared_prompts_off")
        if plan.shared_prompts and why:  # asked for by the key, and the model cannot: said, not dropped quietly
            print(f"meshrl: note: actor_rollout_ref.actor.use_prefix_grouper=True: each response is computed with "
                  f"its own copy of its prompt ({why})", file=sys.stderr)

    def start_engine(self) -> None:
        """The engines of a group made with ``start_engine=False``; rank 0's seconds join ``startup``."""
        self.startup.update(self.group.call("start_engine")[0])

    def generate(self, prompts: Batch, mode: str) -> Batch:
        return self.dispatch("generate", prompts, by="replica", mode=mode)

    def start_generate(self, prompts: Batch, mode: str) -> Callable[[], Batch]:
        """``generate`` begun on each rank's generation thread (``ActorRolloutRefWorker.start_generate``) while the
        driver goes on calling the workers; the returned function waits for it and gives what ``generate`` gives."""
        parts, args = self.scatter(prompts, by="replica")
        self.group.call_per_rank("start_generate", args, mode=mode)
        return lambda: self.gathered(parts, self.group.call("finish_generate"), by="replica")

    # The partial rollout across steps (verl V1 colocate_async): one RolloutStream per inference replica (TP 1: per
    # rank); the driver says which replica each prompt group lives on (arguments and results per replica).
    def stream_submit(self, prompts: list[Batch], keys: list[list[int]]) -> None:
        self._per_replica("stream_submit", prompts, keys)

    def stream_run(self, until: list[int], version: int, wait_for: list[list[int]]) -> list[list[int]]:
        return self._per_replica("stream_run", until, [version] * len(until), wait_for)

    def stream_start(self, version: int) -> None:
        self.group.call("stream_start", version)

    def stream_finish(self, stop: bool) -> list[list[int]]:
        return self._per_replica("stream_finish", [stop] * self.num_replicas)

    def stream_take(self, prompts: list[Batch], keys: list[list[int]]) -> list[Batch]:
        return self._per_replica("stream_take", prompts, keys)

    def stream_drop(self, keys: list[list[int]]) -> None:
        self._per_replica("stream_drop", keys)

    def _per_replica(self, method: str, *per_replica: list) -> list:
        results = self.group.call_per_rank(method, [tuple(arg[lay["replica"]] for arg in per_replica)
                                                    for lay in self.layouts])
        by_replica = {lay["replica"]: out for lay, out in zip(self.layouts, results) if lay["replica_leader"]}
        return [by_replica[r] for r in range(self.num_replicas)]

    def compute_log_probs(self, batch: Batch, model: str) -> Batch:
        needed = batch.select(sequence_fields(batch))
        return batch.union(self.dispatch("compute_log_probs", needed, model=model))

    def update(self, updates: list[tuple[Batch, Any]], on_policy: bool = False
               ) -> tuple[dict[str, float], Batch | None]:
        """Metrics of the actor update, and for an ``on_policy`` one (a single mini-batch, which is the
        whole batch in row order) the ``old_log_probs`` its forward pass saw, in row order."""
        fields = [*sequence_fields(updates[0][0]), "advantages"]
        if not on_policy:
            fields.append("old_log_probs")
        if ROUTES in updates[0][0]:  # router replay: the experts the old-log-prob pass chose
            fields.append(ROUTES)
        if self.plan.kl_loss is not None:
            fields.append("ref_log_probs")
        if "rollout_is_weights" in updates[0][0]:  # algorithm.rollout_correction.rollout_is
            fields.append("rollout_is_weights")
        per_dp: list[list[tuple[Batch, Any]]] = [[] for _ in range(self.dp_size)]
        splits = []
        for mini, norm in updates:
            mini = mini.select(fields)
            splits.append(self.split(mini, self.dp_size, balance=True))
            for dp_rank, rows in enumerate(splits[-1]):
                per_dp[dp_rank].append((mini.take(rows), norm))
        results = self.group.call_per_rank("update", self.per_dp_rank(per_dp), on_policy=on_policy)
        metrics = results[0][0]
        if not on_policy:
            return metrics, None
        return metrics, self.in_row_order(splits[0], [log_probs for _, log_probs in results], coord="dp_rank",
                                          collect="collect")

    def sync_weights(self) -> dict[str, float]:
        return self.group.call("sync_weights")[0]

    def keep_version_weights(self) -> None:
        self.group.call("keep_version_weights")

    def save_checkpoint(self, folder: Path, step: int) -> None:
        self.group.call("save_checkpoint", str(folder), step)

    def load_checkpoint(self, folder: Path) -> None:
        self.group.call("load_checkpoint", str(folder))

    def export_hf(self, out_dir: Path) -> None:
        self.group.call("export_hf", str(out_dir))
