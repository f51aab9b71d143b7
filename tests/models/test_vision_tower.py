"""meshrl's vision towers (``meshrl.parallel.vision``) against transformers' on the tiny Qwen2.5-VL and Qwen3-VL
checkpoints: the image features the language model reads (and Qwen3-VL's deepstack features), their gradients with
respect to every parameter, the checkpoint-name table, and the refusals."""

from __future__ import annotations

import math
import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors import safe_open

from meshrl.data import vision
from meshrl.models.tiny_vision import tiny_vl_model_dir
from meshrl.parallel.vision import TOWERS, build_vision_tower

# model_type -> (transformers' model class, image sizes (height, width) in pixels): images of different grids, the
# first large enough to span several Qwen2.5-VL windows (tiny window_size 56 px = 2 x 2 merged patches)
CASES = {
    "qwen2_5_vl": ("Qwen2_5_VLForConditionalGeneration", [(112, 84), (40, 60), (70, 100)]),
    "qwen3_vl": ("Qwen3VLForConditionalGeneration", [(96, 64), (40, 60), (64, 128)]),
}


def _image(height: int, width: int, seed: int):
    from PIL import Image

    return Image.fromarray(np.random.default_rng(seed).integers(0, 255, (height, width, 3), dtype=np.uint8))


@pytest.fixture(scope="module", params=list(CASES))
def case(request):
    """The tiny model's transformers reference, meshrl's tower loaded from the same safetensors, and the inputs:
    the processor's patches of the images of ``CASES`` plus a two-frame clip (two more images of the first one's
    size, their patches frame after frame: how a video's frames arrive)."""
    import transformers
    from transformers import AutoConfig, AutoTokenizer

    model_type = request.param
    model_class, sizes = CASES[model_type]
    folder = tiny_vl_model_dir(model_type)
    processor = vision.load_processor(folder, AutoTokenizer.from_pretrained(folder), model_type)
    images = vision.image_inputs(processor, [_image(h, w, seed) for seed, (h, w) in enumerate(sizes)])
    frames = vision.image_inputs(processor, [_image(*sizes[0], seed=10 + i) for i in range(2)])
    (t, h, w), second = frames["image_grid_thw"].tolist()
    assert t == 1 and second == [t, h, w]
    pixel_values = torch.cat([images["pixel_values"], frames["pixel_values"]])
    grid_thw = torch.cat([images["image_grid_thw"], torch.tensor([[2, h, w]])])
    reference = getattr(transformers, model_class).from_pretrained(folder, dtype=torch.float32).eval()
    config = AutoConfig.from_pretrained(folder)
    tower = build_vision_tower(config)
    assert isinstance(tower, TOWERS[model_type])
    with safe_open(str(folder / "model.safetensors"), "pt") as checkpoint:
        tower.load_hf(checkpoint.get_tensor)
        keys = list(checkpoint.keys())
    return SimpleNamespace(model_type=model_type, folder=folder, config=config, reference=reference, tower=tower,
                           pixel_values=pixel_values, grid_thw=grid_thw, keys=keys)


def _reference_features(case) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(image features, deepstack features) as transformers' model feeds them to its language model: the per-image
    splits of ``get_image_features`` concatenated in order."""
    out = case.reference.model.get_image_features(case.pixel_values, case.grid_thw)
    deepstack = [torch.cat(feature) for feature in getattr(out, "deepstack_features", None) or []]
    return torch.cat(out.pooler_output), deepstack


def test_the_inputs_cover_what_the_towers_handle(case):
    grids = [tuple(g) for g in case.grid_thw.tolist()]
    assert len(set(grids)) == len(grids) and any(t > 1 for t, _, _ in grids)  # distinct grids and a clip
    vc = case.config.vision_config
    if case.model_type == "qwen2_5_vl":  # windows: a window split, the last window column a narrower one
        units, merge = vc.window_size // vc.spatial_merge_size // vc.patch_size, vc.spatial_merge_size
        windows = [math.ceil(h // merge / units) * math.ceil(w // merge / units) for _, h, w in grids]
        assert max(windows) > 1 and any((w // merge) % units for _, _, w in grids)
        assert set(range(vc.depth)) - set(vc.fullatt_block_indexes)  # some blocks are windowed
    else:  # the position table is resampled to grids other than its own side
        side = math.isqrt(vc.num_position_embeddings)
        assert any((h, w) != (side, side) for _, h, w in grids) and vc.deepstack_visual_indexes


def test_features_are_transformers(case):
    with torch.no_grad():
        out = case.tower(case.pixel_values, case.grid_thw)
        embeds, deepstack = _reference_features(case)
    merge = case.config.vision_config.spatial_merge_size
    assert embeds.shape == out.embeds.shape == (int(case.grid_thw.prod(-1).sum()) // merge ** 2,
                                                case.config.vision_config.out_hidden_size)
    assert (out.embeds - embeds).abs().max() <= 1e-5
    assert len(out.deepstack) == len(deepstack) == len(getattr(case.config.vision_config,
                                                               "deepstack_visual_indexes", []))
    for ours, theirs in zip(out.deepstack, deepstack):
        assert ours.shape == theirs.shape and (ours - theirs).abs().max() <= 1e-5
    # each image's rows are its own: the first image alone gives the first rows of the batch
    first = int(case.grid_thw[0].prod())
    with torch.no_grad():
        alone = case.tower(case.pixel_values[:first], case.grid_thw[:1]).embeds
    assert (alone - out.embeds[: alone.shape[0]]).abs().max() <= 1e-5


def test_gradients_are_transformers(case):
    """A fixed random projection of all outputs summed, backward through both; every parameter's gradient matches
    the gradient of the parameter of transformers' model that ``hf_names`` maps it to."""
    tower, visual = case.tower, case.reference.model.visual
    out = tower(case.pixel_values, case.grid_thw)
    embeds, deepstack = _reference_features(case)
    generator = torch.Generator().manual_seed(0)
    weights = [torch.randn(t.shape, generator=generator) for t in (out.embeds, *out.deepstack)]
    for outputs in ((out.embeds, *out.deepstack), (embeds, *deepstack)):
        sum((o * w).sum() for o, w in zip(outputs, weights, strict=True)).backward()
    names = tower.hf_names()
    for name, param in tower.named_parameters():
        hf_name = names[name]
        assert hf_name.startswith(tower.hf_prefix)
        theirs = visual.get_parameter(hf_name[len(tower.hf_prefix):]).grad
        scale = theirs.abs().max()
        assert scale > 0, hf_name
        error = (param.grad - theirs).abs().max()
        assert error <= 1e-5 * scale, f"{name} <- {hf_name}: |grad error| {error:.3g}, scale {scale:.3g}"
    tower.zero_grad(set_to_none=True)
    case.reference.zero_grad(set_to_none=True)


def test_hf_names_cover_the_checkpoint_once_and_wrong_shapes_are_named(case):
    tower = case.tower
    names = tower.hf_names()
    assert set(names) == {name for name, _ in tower.named_parameters()}
    assert len(set(names.values())) == len(names)
    assert sorted(names.values()) == sorted(k for k in case.keys if k.startswith(tower.hf_prefix))
    with safe_open(str(case.folder / "model.safetensors"), "pt") as checkpoint:
        for victim in (names["patch_embed.proj.weight"], names["blocks.0.attn.qkv.bias"]):
            def read(hf_name, victim=victim):
                tensor = checkpoint.get_tensor(hf_name)
                return tensor[:-1] if hf_name == victim else tensor

            with pytest.raises(ValueError, match=re.escape(victim)):
                tower.load_hf(read)
        tower.load_hf(checkpoint.get_tensor)  # the fixture's weights back for the other tests


def test_unknown_model_types_are_refused():
    with pytest.raises(ValueError, match="'qwen2_vl'"):
        build_vision_tower(SimpleNamespace(model_type="qwen2_vl", vision_config=SimpleNamespace()))
