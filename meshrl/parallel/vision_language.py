"""Vision-language models on the Megatron path: the vision tower (``meshrl.parallel.vision``) lives in the first
pipeline stage's ``GPTModel`` as ``vision_tower``, and its merged patch features replace the input embeddings of
the image pad tokens, in order (transformers' ``masked_scatter``: the k-th pad token of the micro-batch, counted
row by row, takes the k-th feature row). Qwen3-VL's deepstack (``ModelSpec.deepstack_layers``): the tower's
deepstack feature ``i`` is added at the same pad tokens to the output of decoder layer ``i``, so those layers run in
the tower's chunk (``model_builder.layout_problems`` refuses other pipeline layouts).

Parallelism of the tower: it is replicated on every tensor-parallel rank of the first stage, not split. It is a
small part of the model (Qwen2.5-VL-7B: 0.68B of 8.29B parameters, ``vision.tower_parameters`` of the released
config), its sequence is an image's patches, and splitting
its 32 blocks over TP would add two all-reduces per block to save a TP-th of those weights. The gradients stay exact:
without sequence parallelism every TP rank receives the whole gradient of the embeddings (the first layer's
column-parallel input all-reduces it; the next layer's does for a deepstack layer's output), so the replicas compute
the same tower gradient; with it, each rank writes features into its own slice of the sequence only, so its tower
gradient is a partial sum, and the tower's parameters are marked ``sequence_parallel`` so that megatron sums them
over the TP group as it does the norms'. Data-parallel replicas reduce them through megatron's DDP like every other
parameter; the checkpoint stores them replicated.

A training run carries each prompt's images (``MULTI_MODAL_INPUTS``) and its tokens' 3-D positions
(``MROPE_POSITIONS``) into every micro-batch; what it does not do yet is refused at load (``vision_language_runs``).
Context parallelism is refused for these models (``model_builder.layout_problems``): a CP rank holds chunks of each
sequence, and which feature a pad token takes depends on the pad tokens before it in the whole micro-batch.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Iterator

import torch

from meshrl.config.refusals import Checked, refusal
from meshrl.models.families import Piece, model_spec


# Micro-batch keys of a vision-language batch: per row, the processor's outputs for the row's images (verl's
# ``multi_modal_inputs``: a dict with ``pixel_values`` and ``image_grid_thw``, or None for a row without images), and
# each token's (temporal, height, width) position (``[b, 3, s]``, ``meshrl.data.mrope_positions``).
MULTI_MODAL_INPUTS = "multi_modal_inputs"
MROPE_POSITIONS = "mrope_position_ids"


@dataclass(frozen=True)
class ImageInputs:
    """The images of one micro-batch, in the order their pad tokens appear (row by row): the processor's
    ``pixel_values`` (``[patches, channels * temporal_patch * patch * patch]``) and ``image_grid_thw``
    (``[images, 3]``: each image's patch grid, temporal x height x width)."""

    pixel_values: torch.Tensor
    image_grid_thw: torch.Tensor


def micro_batch_images(micro_batch: dict, device: torch.device) -> ImageInputs | None:
    """The images of ``micro_batch``'s rows, concatenated in row order (the order of their pad tokens in every layout
    ``meshrl.parallel.forward`` builds: rows keep their order and their tokens' order); None without any."""
    rows = [row for row in micro_batch.get(MULTI_MODAL_INPUTS) or () if row is not None and len(row)]
    if not rows:
        return None
    return ImageInputs(torch.cat([row["pixel_values"] for row in rows]).to(device),
                       torch.cat([torch.as_tensor(row["image_grid_thw"]).reshape(-1, 3) for row in rows]).to(device))


def model_positions(model: torch.nn.Module, inputs, micro_batch: dict) -> torch.Tensor:
    """The ``position_ids`` ``model`` (a bare ``GPTModel``) runs ``inputs`` (``forward.ModelInputs``) with: its own
    ``[r, n]`` positions, or under M-RoPE the micro-batch's 3-D positions (``[b, 3, s]``) moved to the model's layout,
    ``[3, r, n]`` (padding positions 0; nothing reads their outputs). A micro-batch without them is text only, whose
    three positions are the 1-D one (as transformers' ``get_rope_index`` gives text); one with image pad tokens and
    no 3-D positions is refused."""
    if getattr(model, "position_embedding_type", "rope") != "mrope":
        return inputs.position_ids
    given = micro_batch.get(MROPE_POSITIONS)
    if given is None:
        image_token = getattr(model, "meshrl_image_token_id", None)
        if image_token is not None and bool((micro_batch["input_ids"] == image_token).any()):
            raise ValueError(f"the micro-batch has image pad tokens but no {MROPE_POSITIONS}: a vision-language "
                             "model needs each token's (temporal, height, width) position")
        return inputs.position_ids.unsqueeze(0).expand(3, -1, -1)
    rows, width = inputs.input_ids.shape
    flat = torch.zeros(3, rows * width, dtype=torch.long, device=inputs.input_ids.device)
    flat[:, inputs.packed_index] = given.transpose(0, 1).reshape(3, -1)[:, inputs.source_index].to(flat.device)
    return flat.view(3, rows, width)


def attach_vision_tower(model: torch.nn.Module, hf_config, dtype: torch.dtype, sequence_parallel: bool) -> None:
    """Give the first stage's ``model`` (a bare ``GPTModel``) the vision tower of ``hf_config`` as ``vision_tower``,
    with megatron's random initialisation replaced by the HF weights at load (``hf_conversion.load_hf_weights``)."""
    from meshrl.parallel.vision import build_vision_tower

    device = next(model.parameters()).device
    model.vision_tower = build_vision_tower(hf_config, dtype=dtype, device=device)
    model.meshrl_image_token_id = hf_config.image_token_id
    for param in model.vision_tower.parameters():
        # read by megatron's finalize_model_grads under sequence parallelism: summed over the TP group
        param.sequence_parallel = sequence_parallel


def vision_pieces(hf_config) -> list[Piece]:
    """The vision tower's tensors as conversion-table pieces: held whole (no TP split) by the first stage's first
    chunk as ``vision_tower.<name>``, named as the HF checkpoint names them (the tower's ``hf_names``)."""
    from meshrl.parallel.vision import build_vision_tower

    tower = build_vision_tower(hf_config, device="meta")
    shapes = dict(tower.named_parameters())
    return [Piece(hf_name, "embed", None, f"vision_tower.{name}", None, None, tuple(shapes[name].shape),
                  "vision_config") for name, hf_name in tower.hf_names().items()]


def _features_at_pads(input_ids: torch.Tensor, features: torch.Tensor, dtype: torch.dtype, image_token_id: int,
                      sequence_shard: tuple[int, int] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(``mask`` ``[s, b, 1]``, ``taken`` ``[s, b, h]``) in megatron's sequence-first layout (this TP rank's
    ``[s / tp, b]`` rows under sequence parallelism: ``sequence_shard`` = (rank, size)): where ``input_ids``
    (``[b, s]``) holds the image pad token, and there the row of ``features`` (cast to ``dtype``) it takes (the k-th
    pad counted row by row takes row k; elsewhere a row of no meaning). ``ValueError`` when the micro-batch has other
    than one pad per feature row."""
    mask = input_ids == image_token_id
    pads, count = int(mask.sum()), features.shape[0]
    if pads != count:
        raise ValueError(f"the micro-batch has {pads} image pad tokens but its images give {count} "
                         "features: the prompts' image placeholders and the images carried with them disagree")
    order = (mask.reshape(-1).cumsum(0) - 1).view(mask.shape)
    # megatron's sequence-first layout, in memory too: a result takes its strides from these (torch.where), and a
    # pipeline stage sends its output contiguous or not at all
    mask, order = mask.t().contiguous(), order.t().contiguous()
    if sequence_shard is not None:
        rank, size = sequence_shard
        rows = mask.shape[0] // size
        mask, order = mask[rank * rows:(rank + 1) * rows], order[rank * rows:(rank + 1) * rows]
    return mask.unsqueeze(-1), features.to(dtype)[order.clamp(min=0)]


def scatter_image_features(embeddings: torch.Tensor, input_ids: torch.Tensor, features: torch.Tensor,
                           image_token_id: int, sequence_shard: tuple[int, int] | None = None) -> torch.Tensor:
    """``embeddings`` (megatron's ``[s, b, h]``, or this TP rank's ``[s / tp, b, h]`` slice under sequence
    parallelism: ``sequence_shard`` = (rank, size)) with the rows of the image pad tokens of ``input_ids``
    (``[b, s]``) replaced by ``features`` (``[pads, h]``), the k-th pad counted row by row taking row k
    (transformers' ``masked_scatter``).

    Raises ``ValueError`` when the micro-batch's pad tokens and its images' features differ in number (the
    processor's expansion and the images carried with the batch disagree)."""
    mask, taken = _features_at_pads(input_ids, features, embeddings.dtype, image_token_id, sequence_shard)
    return torch.where(mask, taken, embeddings)


def add_image_features(hidden: torch.Tensor, input_ids: torch.Tensor, features: torch.Tensor, image_token_id: int,
                       sequence_shard: tuple[int, int] | None = None) -> torch.Tensor:
    """``hidden`` (laid out as ``scatter_image_features``' ``embeddings``) plus ``features`` at the image pad tokens,
    the k-th pad adding row k, unchanged elsewhere: transformers' ``Qwen3VLTextModel._deepstack_process``
    (``h[pads] = h[pads] + f``, ``f`` cast to ``h``'s dtype). ``ValueError`` as ``scatter_image_features``."""
    mask, taken = _features_at_pads(input_ids, features, hidden.dtype, image_token_id, sequence_shard)
    return torch.where(mask, hidden + taken, hidden)


def _deepstack_layers(model: torch.nn.Module, count: int) -> list[torch.nn.Module]:
    """Decoder layers 0 .. ``count - 1`` (the model's numbering) of ``model``, the chunk holding the tower;
    ``ValueError`` when one of them is in another chunk (``model_builder.layout_problems`` refuses such layouts)."""
    layers = {layer.layer_number - 1: layer for layer in model.decoder.layers}  # megatron numbers them from 1
    missing = [i for i in range(count) if i not in layers]
    if missing:
        raise ValueError(f"decoder layers {missing} take deepstack features but are not in the vision tower's "
                         "pipeline chunk: the first deepstack_layers layers must be on the first stage's first chunk")
    return [layers[i] for i in range(count)]


@contextlib.contextmanager
def images_in_embeddings(model: torch.nn.Module, images: ImageInputs | None) -> Iterator[None]:
    """While ``model`` (a bare ``GPTModel``) runs, its embedding output carries the vision tower's features of
    ``images`` at the image pad tokens (``scatter_image_features``), and with deepstack (Qwen3-VL,
    ``ModelSpec.deepstack_layers``) the output of decoder layer ``i`` has the tower's deepstack feature ``i`` added
    there (``add_image_features``). The tower runs once, inside the forward (in the embedding's hook, whose input ids
    the layers' hooks reuse), so the backward reaches it through the embeddings and every deepstack addition. A chunk
    without the tower (a later pipeline stage) or a micro-batch without images runs as it is.

    Sequence parallelism: the embedding's output and each layer's are this TP rank's shard of the sequence, and the
    rank writes into its own rows only (the tower's gradient is then a partial sum, summed over TP as its parameters
    are marked: ``attach_vision_tower``). Without it every TP rank holds the whole sequence and receives its whole
    gradient. Megatron's full-layer recompute would re-run the layers without these hooks: a training forward of a
    recomputing decoder (``recompute_deepstack_layers``) takes the features from here and adds them itself."""
    tower = getattr(model, "vision_tower", None)
    if tower is None or images is None:
        yield
        return
    from megatron.core import parallel_state

    config = model.config
    shard = ((parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size())
             if config.sequence_parallel else None)
    spec = getattr(model, "meshrl_spec", None)
    deepstack_layers = _deepstack_layers(model, spec.deepstack_layers) if spec is not None else []
    # a training forward of a recomputing decoder adds the deepstack features itself, as arguments of its checkpoints
    # (megatron runs its plain layer loop in eval mode: the layers' hooks add them there)
    recomputed = getattr(model.decoder, DEEPSTACK_INPUTS, None) if model.decoder.training else None
    # what the embedding's hook hands the layers' hooks (or the recomputing decoder) within this forward
    ran: dict = {} if recomputed is None else recomputed

    def scatter(module, args, kwargs, output):
        input_ids = kwargs["input_ids"] if "input_ids" in kwargs else args[0]
        vision = tower(images.pixel_values, images.image_grid_thw)
        if len(vision.deepstack) != len(deepstack_layers):
            raise ValueError(f"the vision tower gives {len(vision.deepstack)} deepstack features but the model adds "
                             f"{len(deepstack_layers)} (ModelSpec.deepstack_layers)")
        ran.update(input_ids=input_ids, deepstack=vision.deepstack, shard=shard)
        return scatter_image_features(output, input_ids, vision.embeds, model.meshrl_image_token_id, shard)

    def add_deepstack(index: int, module, args, output):
        hidden, context = output  # megatron's TransformerLayer returns (hidden_states, context)
        return add_image_features(hidden, ran["input_ids"], ran["deepstack"][index], model.meshrl_image_token_id,
                                  shard), context

    handles = [model.embedding.register_forward_hook(scatter, with_kwargs=True)]
    if recomputed is None:
        handles += [layer.register_forward_hook(functools.partial(add_deepstack, index))
                    for index, layer in enumerate(deepstack_layers)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        if recomputed is not None:
            recomputed.clear()


# A recomputing deepstack decoder's dict (recompute_deepstack_layers), in which images_in_embeddings hands it the
# micro-batch's input ids, deepstack features and sequence shard; empty between micro-batches.
DEEPSTACK_INPUTS = "meshrl_deepstack_inputs"


def recompute_deepstack_layers(model: torch.nn.Module) -> None:
    """Megatron's full-layer recompute (``recompute_method="uniform"``, ``recompute_num_layers`` layers per
    checkpoint: what ``model.enable_gradient_checkpointing`` means) for a decoder whose first layers take deepstack
    features. megatron's own recompute reruns a checkpoint's layers in the backward from its saved inputs; features
    added by hooks around the forward would be missing there, and with them their gradient (the tower's). Here each
    checkpoint takes the features its layers add as arguments, so the rerun adds them again and returns their
    gradient, as Megatron-Bridge's Qwen3-VL block does; the rest is megatron's uniform loop (other methods are refused
    by ``model_builder.transformer_config``)."""
    from megatron.core import tensor_parallel

    block = model.decoder
    config = block.config
    image_token = model.meshrl_image_token_id

    def checkpointed_forward(hidden_states, attention_mask, context, context_mask, rotary_pos_emb, attention_bias,
                             packed_seq_params, use_inner_quantization_context, padding_mask=None):
        given = getattr(block, DEEPSTACK_INPUTS)
        input_ids, features, shard = given.get("input_ids"), given.get("deepstack", ()), given.get("shard")

        def run(start: int, end: int):
            def forward(hidden, mask, ctx, ctx_mask, rope, *added):
                for index in range(start, end):
                    hidden, ctx = block._get_layer(index)(
                        hidden_states=hidden, attention_mask=mask, context=ctx, context_mask=ctx_mask,
                        rotary_pos_emb=rope, attention_bias=attention_bias, inference_context=None,
                        packed_seq_params=packed_seq_params, padding_mask=padding_mask)
                    number = block._get_layer(index).layer_number - 1  # the model's numbering
                    if number < len(added):
                        hidden = add_image_features(hidden, input_ids, added[number], image_token, shard)
                return hidden, ctx
            return forward

        step = config.recompute_num_layers
        for start in range(0, block.num_layers_per_pipeline_rank, step):
            end = min(start + step, block.num_layers_per_pipeline_rank)
            numbers = [block._get_layer(i).layer_number - 1 for i in range(start, end)]
            added = tuple(features[: max(numbers) + 1]) if features and min(numbers) < len(features) else ()
            hidden_states, context = tensor_parallel.checkpoint(
                run(start, end), config.distribute_saved_activations, hidden_states, attention_mask, context,
                context_mask, rotary_pos_emb, *added)
        return hidden_states

    block._checkpointed_forward = checkpointed_forward
    setattr(block, DEEPSTACK_INPUTS, {})


@refusal("model", "actor_rollout_ref.model.path", "actor_rollout_ref.rollout.name",
         "actor_rollout_ref.actor.freeze_vision_tower", "trainer.use_v1", "trainer.v1.trainer_mode", "critic.enable")
def vision_language_runs(c: Checked) -> list[str]:
    """What a run on a vision-language model does not do yet, refused rather than run on the text alone or failing
    in the workers: a rollout engine other than the HF one on GPU (meshrl does not hand vLLM images yet; on CPU the
    HF engine stands in for vLLM, ``serving_limits.engine_fallback``), verl V1's asynchronous modes (their partial
    rollout drives vLLM request by request) and a critic (no value model of a vision-language model). And
    ``freeze_vision_tower`` on a model without one. LoRA runs: on the language model's linears, the tower frozen (as
    verl's ``exclude_modules='.*visual.*'``), merged into the HF engine's weights. Multi-turn rollouts run: every turn
    is generated with the prompt's images (``meshrl.rollout.agent_loop``). The one-step-off and fully async trainers
    run: their rollouter takes the prompts' images as the synchronous trainer does (``rl_trainer.prompts_batch``), on
    the HF engine, whose generation a parameter sync waits for (no partial rollout)."""
    arr, model_type = c.cfg.actor_rollout_ref, c.hf_config.model_type
    if not model_spec(c.hf_config).vision:
        return [f"actor_rollout_ref.actor.freeze_vision_tower: {model_type} has no vision tower to freeze; set it to "
                "false"] if arr.actor.freeze_vision_tower else []
    why = f"not built for a vision-language model ({model_type}) yet"
    problems = []
    if arr.rollout.name != "hf":  # on CPU the HF engine stands in, named (serving_limits.engine_fallback)
        problems.append(f"actor_rollout_ref.rollout.name: {arr.rollout.name} {why}: meshrl does not hand vLLM the "
                        "images yet; set rollout.name=hf (transformers' generate with the images)")
    if c.cfg.trainer.use_v1 and c.cfg.trainer.v1.trainer_mode != "sync" and not c.cfg.trainer.async_mode:
        problems.append(f"trainer.v1.trainer_mode={c.cfg.trainer.v1.trainer_mode}: verl V1's asynchronous modes are "
                        f"{why} (their partial rollout drives vLLM request by request, and vLLM is not handed images "
                        "yet); run the one-step-off or fully async trainer (verl's fully_async_policy scripts), or "
                        "trainer.v1.trainer_mode=sync")
    if c.plan.use_critic:
        problems.append(f"critic.enable: a critic is {why} (transformers has no value-head class of it); use a "
                        "critic-free estimator (grpo, rloo, reinforce_plus_plus, ...)")
    return problems
