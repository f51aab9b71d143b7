"""Vision-language parity checks run inside mp_worker.py's launches (issue 40): a tiny vision-language model built by
meshrl (megatron language model with M-RoPE, meshrl's vision tower on the first stage; Qwen3-VL's interleaved M-RoPE
and deepstack features) against its transformers class (the family's ``policy_class``:
``Qwen2_5_VLForConditionalGeneration``, ``Qwen3VLForConditionalGeneration``) on image prompts: per-token log-probs
and the gradients of every tensor (language model and vision tower, by checkpoint name) of a weighted log-prob loss,
in the row layout and packed.

The inputs: three samples (one image; text only; two images of different sizes with text between), each a chat
prompt rendered by meshrl's processor plus a response, in two micro-batches with right and left padding. meshrl
positions them with ``meshrl.data.mrope_positions``; transformers computes its own (``get_rope_index``) from the ids
and image grids, each sample alone and unpadded.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import torch

from meshrl.data import vision
from meshrl.data.mrope_positions import continue_positions, positions_for_config
from meshrl.parallel import hf_conversion, model_builder, schedule
from meshrl.parallel.forward import OutputRequest
from meshrl.parallel.vision_language import MROPE_POSITIONS, MULTI_MODAL_INPUTS

RESPONSE = 6  # generated tokens after each prompt
# (image sizes, text) of each sample; sizes chosen so that one image spans more than one of the tower's windows
SAMPLES = [((56, 84),), (), ((28, 56), (84, 112))]


def _image(height: int, width: int, seed: int):
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 255, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return Image.open(io.BytesIO(buffer.getvalue()))


def samples(path: Path) -> list[dict]:
    """Each sample's unpadded ids, 3-D positions, images and loss weights."""
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(path)
    processor = vision.load_processor(path, AutoTokenizer.from_pretrained(path), config.model_type)
    positions_of = positions_for_config(config)
    g = torch.Generator().manual_seed(7)
    out = []
    for index, sizes in enumerate(SAMPLES):
        text = "".join("<image>Look. " for _ in sizes) + f"What is shown in case {index}?"
        messages, images = vision.prompt_messages([{"role": "user", "content": text}],
                                                  [_image(h, w, 10 * index + k) for k, (h, w) in enumerate(sizes)])
        prompt, inputs = vision.encode_prompt(processor, messages, images)
        response = torch.randint(10, 1000, (RESPONSE,), generator=g)
        ids = torch.cat([torch.tensor(prompt), response])
        grid = inputs.get("image_grid_thw")
        positions = continue_positions(positions_of(torch.tensor(prompt), grid), RESPONSE)
        out.append({"ids": ids, "positions": positions, "images": inputs or None,
                    "weights": torch.rand(len(ids), generator=g)})
    return out


def micro_batches(items: list[dict]) -> list[dict]:
    """Samples 0-1 right-padded together, sample 2 alone left-padded by three columns."""
    batches = []
    for group, left in (([0, 1], False), ([2], True)):
        width = max(len(items[i]["ids"]) for i in group) + (3 if left else 0)
        ids = torch.zeros(len(group), width, dtype=torch.long)
        mask, weights = torch.zeros_like(ids), torch.zeros(len(group), width)
        positions = torch.zeros(len(group), 3, width, dtype=torch.long)
        for row, i in enumerate(group):
            n = len(items[i]["ids"])
            cols = slice(width - n, width) if left else slice(0, n)
            ids[row, cols], mask[row, cols], weights[row, cols] = items[i]["ids"], 1, items[i]["weights"]
            positions[row, :, cols] = items[i]["positions"]
        batches.append({"input_ids": ids, "attention_mask": mask, "weights": weights, MROPE_POSITIONS: positions,
                        MULTI_MODAL_INPUTS: [items[i]["images"] for i in group]})
    return batches


def _loss(outputs: dict, mb: dict):
    loss = (outputs["log_probs"] * mb["weights"] * mb["attention_mask"]).sum()
    return loss, {}


def hf_reference(path: Path, items: list[dict]) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """transformers' per-sample log-probs, from its own 3-D positions (position t: log p(token t | tokens < t); 0 at
    t = 0), and the gradients of ``sum(weights * log_probs)`` by checkpoint name."""
    import transformers
    from transformers.core_model_loading import revert_weight_conversion

    from meshrl.models.families import family

    config = transformers.AutoConfig.from_pretrained(path)
    model_class = getattr(transformers, family(config.model_type).policy_class)
    model = model_class.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    log_probs = []
    for item in items:
        lp = hf_log_probs(model, item)
        (lp * item["weights"]).sum().backward()
        log_probs.append(lp.detach())
    # transformers 5's parameter names -> the checkpoint's (Qwen2.5-VL's released naming, which its loader converts
    # from; Qwen3-VL's are the same)
    grads = revert_weight_conversion(model, {n: p.grad.detach().clone() for n, p in model.named_parameters()
                                             if p.grad is not None})
    return log_probs, grads


def hf_log_probs(model, item: dict) -> torch.Tensor:
    """transformers' log-probs of one sample (``samples``) from its own 3-D positions: position t holds
    log p(token t | tokens < t), 0 at t = 0."""
    images = item["images"] or {}
    # transformers 5 tells image pads by mm_token_type_ids (1) when it computes the 3-D positions itself
    kinds = (item["ids"] == model.config.image_token_id).long()[None]
    logits = model(input_ids=item["ids"][None], mm_token_type_ids=kinds, **images).logits[0]
    lp = torch.log_softmax(logits[:-1].float(), -1).gather(1, item["ids"][1:, None])[:, 0]
    return torch.cat([lp.new_zeros(1), lp])


def sample_log_probs(batches: list[dict], outputs: list[dict]) -> list[torch.Tensor]:
    """meshrl's per-sample log-probs (the real tokens of each row, in ``samples``' order) from its micro-batches'
    outputs."""
    return [out["log_probs"][row][mb["attention_mask"][row].bool()]
            for mb, out in zip(batches, outputs) for row in range(mb["input_ids"].shape[0])]


REFERENCE: dict[str, tuple] = {}
VISUAL = ("visual.", "model.visual.")  # the tower's checkpoint names: Qwen2.5-VL's, Qwen3-VL's


def check_vision_language(path: Path, **build_kwargs) -> dict:
    """Max differences to transformers, in the row layout and packed: log-probs, gradients relative to each tensor's
    largest gradient; the tensors named by one side only, and the number of vision-tower tensors compared."""
    from transformers import AutoConfig

    items = samples(path)
    if str(path) not in REFERENCE:
        REFERENCE[str(path)] = hf_reference(path, items)
    ref_lp, ref_grads = REFERENCE[str(path)]
    batches = micro_batches(items)
    config = AutoConfig.from_pretrained(path)
    result = {}
    for packed in (False, True):
        chunks = model_builder.build_model(config, **build_kwargs)
        hf_conversion.load_hf_weights(chunks, path)
        for chunk in chunks:
            chunk.zero_grad_buffer()
        request = OutputRequest(remove_padding=packed)
        schedule.forward_backward(chunks, batches, _loss, request)
        outputs = schedule.forward_only(chunks, batches, request)
        lp_diff = max(float((got - ref).abs().max()) for got, ref in zip(sample_log_probs(batches, outputs), ref_lp))
        grads = {name: t.cpu() for name, t in hf_conversion.iter_hf_weights(chunks, config, grads=True)}
        rel = max(float((grads[n] - ref_grads[n]).abs().max()) / max(float(ref_grads[n].abs().max()), 1e-6)
                  for n in ref_grads if n in grads)
        tag = "packed" if packed else "rows"
        result.update({f"{tag}.log_probs": lp_diff, f"{tag}.grads_rel": rel,
                       f"{tag}.names_mismatch": len(set(ref_grads) ^ set(grads)),
                       f"{tag}.vision_tensors": sum(n.startswith(VISUAL) for n in grads)})
    return result
