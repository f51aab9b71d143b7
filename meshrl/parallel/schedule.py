"""Forward-only and training passes over a list of micro-batches through megatron's pipeline schedules.

A micro-batch is a dict with at least ``input_ids`` and ``attention_mask`` (``[b, s]``, any padding
layout; see ``meshrl.parallel.forward``), optionally ``output_mask`` (outputs wanted for those tokens
only, the rest are 0), plus whatever tensors the loss function reads. Micro-batches
may differ in batch size and length. Every rank of a model-parallel group passes the same
micro-batches; data-parallel ranks pass their own.

Loss contract (training): ``loss_fn(outputs, micro_batch) -> (loss, metrics)`` where ``outputs`` holds
the requested ``[b, s]`` tensors (``log_probs`` / ``entropy`` for a policy, ``values`` for a critic) and
``loss`` is a scalar that is *already normalised by global quantities* (e.g. divided by the number of
loss tokens in the whole mini-batch across all DP ranks). The parallel layer adds nothing: the
accumulated gradient equals the gradient of

    sum over DP ranks and micro-batches of loss

because the model config sets ``calculate_per_token_loss=True`` (megatron's schedule then neither
divides by the number of micro-batches nor, in DDP, by the DP size) and the installed grad-finalise
function skips the per-token rescaling (see ``model_builder``). ``metrics`` values may be floats or
scalar tensors; they come back per micro-batch, identical on every rank of the model-parallel group.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
import torch.distributed as dist

from meshrl.parallel import router_replay, vision_language
from meshrl.parallel.forward import (LossFn, MicroBatch, OutputRequest, compute_outputs, model_inputs,
                                     select_hidden)
from meshrl.parallel.fused_output import projection_skipped
from meshrl.parallel.layers import MOE_LOSS_SCALE
from meshrl.parallel.model_builder import model_config, unwrap
from meshrl.parallel.shared_prefix import PROMPT_END, rope_positions


@dataclass
class TrainPassResult:
    """``loss``: sum of the micro-batch losses over all micro-batches and DP ranks (the global loss).
    ``metrics``: this DP rank's per-micro-batch metrics from ``loss_fn``."""

    loss: float
    metrics: list[dict[str, Any]] = field(default_factory=list)


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _to_device(micro_batch: MicroBatch, device: torch.device) -> MicroBatch:
    # Asynchronous copies only towards the GPU: a non-blocking device-to-host copy may be read early.
    return {key: value.to(device, non_blocking=device.type == "cuda") if isinstance(value, torch.Tensor) else value
            for key, value in micro_batch.items()}


def _scalar(value: Any) -> Any:
    return value.detach().float().item() if isinstance(value, torch.Tensor) and value.numel() == 1 else value


def _make_forward_step(request: OutputRequest, critic: bool, loss_fn: LossFn | None, sequence_parallel: bool):
    device = _device()
    zero_tokens = torch.zeros((), dtype=torch.int, device=device)

    def forward_step(data_iterator: Iterator[MicroBatch], model: torch.nn.Module):
        micro_batch = _to_device(next(data_iterator), device)
        # the shared-prompt layout, where the micro-batch says where its prompts end; not with replayed routes, which
        # give each row's copy of a prompt routes of its own
        shared = request.shared_prompts and PROMPT_END in micro_batch and router_replay.ROUTES not in micro_batch
        inputs = model_inputs(micro_batch["input_ids"], micro_batch["attention_mask"], request.remove_padding,
                              micro_batch.get("output_mask"), sequence_parallel,
                              shared_prefix_columns=int(micro_batch[PROMPT_END]) if shared else None)
        # A fused pass: the last stage returns hidden states, and head projects them in compute_outputs.
        fused = projection_skipped(unwrap(model)) if request.fused_chunk_size and not critic \
            else contextlib.nullcontext()
        positions = rope_positions(unwrap(model), inputs.position_ids) if shared else contextlib.nullcontext()
        images = vision_language.images_in_embeddings(unwrap(model),
                                                      vision_language.micro_batch_images(micro_batch, device))
        with fused as head, _output_layer_on(model, inputs.selected), positions, images, \
                router_replay.routing(model, micro_batch, inputs):
            output = model(input_ids=inputs.input_ids,
                           position_ids=vision_language.model_positions(unwrap(model), inputs, micro_batch),
                           attention_mask=None, packed_seq_params=inputs.packed_seq_params)

        def loss_func(output_tensor: torch.Tensor):
            outputs = compute_outputs(output_tensor, inputs, request, critic, head)
            if loss_fn is None:
                return (torch.zeros((), device=device), zero_tokens,
                        {key: value.detach() for key, value in outputs.items()})
            loss, metrics = loss_fn(outputs, micro_batch)
            if loss.dim() != 0:
                raise ValueError(f"loss_fn must return a scalar loss, got shape {tuple(loss.shape)}")
            # The schedule may rescale the returned tensor in place: report a copy.
            report = {"loss": loss.detach().clone(), "metrics": {k: _scalar(v) for k, v in metrics.items()}}
            return loss, zero_tokens, report

        return output, loss_func

    return forward_step


@contextlib.contextmanager
def _output_layer_on(model: torch.nn.Module, positions: torch.Tensor | None) -> Iterator[None]:
    """While the model runs, its output layer (last stage only) sees the hidden states of the whole sequence at
    ``positions`` (all of them when None).

    Under sequence parallelism the final hidden states are this TP rank's sequence shard: they are all-gathered
    first, and the layer runs as it does without sequence parallelism (its ``sequence_parallel`` flag is off
    meanwhile, as megatron's own inference path does it): the vocabulary projection copies its input to the TP
    region, whose backward all-reduces the input gradient; the value head and the fused output layer get the
    replicated input they take. The gather's backward then keeps this rank's shard of that full gradient
    (``tensor_parallel_output_grad=False``). So positions select from the real sequence, every head computes
    exactly what it computes without sequence parallelism, and its weight gradient is the same sum."""
    from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

    gpt = unwrap(model)
    head = getattr(gpt, "output_layer", None)
    sharded = gpt.config.sequence_parallel
    if head is None or (positions is None and not sharded):
        yield
        return

    def whole_sequence(module, args):
        hidden = args[0]
        if sharded:
            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)
        return (hidden if positions is None else select_hidden(hidden, positions), *args[1:])

    handle = head.register_forward_pre_hook(whole_sequence)
    own_flag = head.sequence_parallel
    head.sequence_parallel = False
    try:
        yield
    finally:
        head.sequence_parallel = own_flag
        handle.remove()


def _interleaving_group_size(num_microbatches: int, pp: int) -> int:
    """Smallest group N in [PP, M] the interleaved schedule accepts: M % N == 0 or M % N >= PP."""
    for size in range(pp, num_microbatches + 1):
        if num_microbatches % size == 0 or num_microbatches % size >= pp:
            return size
    raise ValueError(f"the interleaved (virtual) pipeline needs at least PP={pp} micro-batches, "
                     f"got {num_microbatches}")


def _run(chunks: list[torch.nn.Module], micro_batches: list[MicroBatch], request: OutputRequest,
         loss_fn: LossFn | None, forward_only: bool) -> list[Any]:
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    if not micro_batches:
        raise ValueError("no micro-batches")
    critic = bool(getattr(unwrap(chunks[0]), "meshrl_critic", False))
    config = model_config(chunks)
    # MoE load-balancing / z-losses enter as their mean over micro-batches and DP ranks (layers' router)
    setattr(config, MOE_LOSS_SCALE, 1.0 / (len(micro_batches) * parallel_state.get_data_parallel_world_size()))
    # megatron sizes p2p buffers from these only without variable_seq_lengths, which is on whenever PP > 1
    # (each micro-batch's shape, padded or packed [T, 1, h], travels with it); they are unused otherwise.
    seq_length = max(int(mb["input_ids"].shape[1]) for mb in micro_batches)
    batch_size = max(int(mb["input_ids"].shape[0]) for mb in micro_batches)
    iterators: Any = [iter(micro_batches) for _ in chunks] if len(chunks) > 1 else iter(micro_batches)
    if len(chunks) > 1:
        config.microbatch_group_size_per_vp_stage = _interleaving_group_size(
            len(micro_batches), config.pipeline_model_parallel_size)
    forward_backward = get_forward_backward_func()
    store = forward_backward(
        forward_step_func=_make_forward_step(request, critic, loss_fn, config.sequence_parallel),
        data_iterator=iterators,
        model=chunks if len(chunks) > 1 else chunks[0],
        num_microbatches=len(micro_batches),
        seq_length=seq_length,
        micro_batch_size=batch_size,
        forward_only=forward_only,
    )
    # Results exist on the last pipeline stage; share them with the other stages of this pipeline.
    if config.pipeline_model_parallel_size > 1:
        group = parallel_state.get_pipeline_model_parallel_group()
        last = dist.get_process_group_ranks(group)[-1]
        box = [[_to_device(item, torch.device("cpu")) for item in store] if dist.get_rank() == last else None]
        dist.broadcast_object_list(box, src=last, group=group)
        store = box[0]
    return store


def forward_only(chunks: list[torch.nn.Module], micro_batches: list[MicroBatch],
                 request: OutputRequest = OutputRequest()) -> list[dict[str, torch.Tensor]]:
    """Per-micro-batch outputs (``log_probs`` / ``entropy``, or ``values`` for a critic), ``[b, s]`` each.

    Runs without autograd; the fp32 CPU tensors are returned on every rank of the model-parallel group.
    """
    for chunk in chunks:
        chunk.eval()
    with torch.no_grad():
        store = _run(chunks, micro_batches, request, None, forward_only=True)
    return [_to_device(item, torch.device("cpu")) for item in store]


def forward_backward(chunks: list[torch.nn.Module], micro_batches: list[MicroBatch], loss_fn: LossFn,
                     request: OutputRequest = OutputRequest()) -> TrainPassResult:
    """Accumulate gradients of ``sum(loss_fn(...))`` into the DDP grad buffers (see the module docstring).

    Does not zero gradients or step the optimizer: see ``meshrl.parallel.optimizer.train_step``.
    """
    from megatron.core import parallel_state

    for chunk in chunks:
        chunk.train()
    store = _run(chunks, micro_batches, request, loss_fn, forward_only=False)
    local = torch.tensor(sum(float(item["loss"]) for item in store), dtype=torch.float64, device=_device())
    dist.all_reduce(local, group=parallel_state.get_data_parallel_group())
    return TrainPassResult(loss=float(local), metrics=[item["metrics"] for item in store])
