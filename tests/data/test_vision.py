"""Images in prompts (issue 40's data path): Geometry3K in verl's layout from a local copy, prompts with images
tokenised by the vision-language model's processor (checked against transformers' image processor and model), and
the rows that cannot be read refused by name."""

from __future__ import annotations

import io
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from meshrl.data import preprocess as pp
from meshrl.data import vision
from meshrl.data.dataset import MultiModalDataError, RLDataset
from meshrl.models.tiny_vision import tiny_vl_model_dir

MODEL_TYPES = ("qwen2_5_vl", "qwen3_vl")


def _png(height: int, width: int, seed: int) -> bytes:
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 255, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def geo3k_copy(tmp_path_factory) -> Path:
    """A local copy of the hub's hiyouga/geometry3k in its layout: data/<split>-00000-of-00001.parquet with
    ``images`` (PNG bytes and a path, as ``datasets`` stores images), ``problem`` starting with ``<image>``,
    ``answer``; images of several sizes."""
    root = tmp_path_factory.mktemp("geometry3k")
    (root / "data").mkdir()
    for split, count in (("train", 5), ("test", 2)):
        rows = [{"images": [{"bytes": _png(40 + 14 * i, 60 + 9 * i, i), "path": f"{split}_{i}.png"}],
                 "problem": f"<image>Find x in triangle {split} {i}.", "answer": str(3 + i)} for i in range(count)]
        pq.write_table(pa.Table.from_pylist(rows), root / "data" / f"{split}-00000-of-00001.parquet")
    return root


@pytest.fixture(scope="module")
def geo3k(geo3k_copy, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("geo3k")
    pp.preprocess("geo3k", out, local_dataset_path=geo3k_copy, log=lambda _: None)
    return out


def test_geo3k_rows_are_verls_from_a_local_copy(geo3k_copy, geo3k, capsys):
    raw = pq.read_table(geo3k_copy / "data" / "train-00000-of-00001.parquet").to_pylist()
    rows = pq.read_table(geo3k / "train.parquet").to_pylist()
    assert len(rows) == 5 and (geo3k / "test.parquet").is_file()
    for i, (row, src) in enumerate(zip(rows, raw, strict=True)):
        assert row == {"data_source": "hiyouga/geometry3k",
                       "prompt": [{"role": "user", "content": f"{src['problem']} {pp.GEO3K_INSTRUCTION}"}],
                       "images": src["images"], "ability": "math",
                       "reward_model": {"style": "rule", "ground_truth": src["answer"]},
                       "extra_info": {"split": "train", "index": i, "answer": src["answer"],
                                      "question": src["problem"]}}
    assert r"MUST BE put in \boxed{}." in pp.GEO3K_INSTRUCTION  # verl's instruction, its raw string as written
    said = []
    pp.preprocess("geo3k", geo3k, local_dataset_path=geo3k_copy, log=said.append)
    assert all("up to date" in line for line in said)  # the same copy: nothing rewritten
    with pytest.raises(SystemExit):
        pp.main(["geo3k", "--local_dir", str(geo3k)])
    assert "geo3k is not packaged: give --local_dataset_path" in capsys.readouterr().err


def test_geo3k_multiturn_rows_are_verls_with_the_tools_ground_truth(geo3k_copy, tmp_path):
    """verl's geo3k_multiturn_w_tool.py layout: its system message, the problem with the instruction, and the
    calc_geo3k_reward tool's ground truth in tools_kwargs (what meshrl.rollout.tools.geo3k reads)."""
    pp.preprocess("geo3k_multiturn_w_tool", tmp_path, local_dataset_path=geo3k_copy, log=lambda _: None)
    raw = pq.read_table(geo3k_copy / "data" / "test-00000-of-00001.parquet").to_pylist()
    rows = pq.read_table(tmp_path / "test.parquet").to_pylist()
    assert len(rows) == len(raw) == 2
    for i, (row, src) in enumerate(zip(rows, raw, strict=True)):
        assert row["prompt"] == [{"role": "system", "content": pp.GEO3K_TOOL_SYSTEM},
                                 {"role": "user", "content": f"{src['problem']} {pp.GEO3K_INSTRUCTION}"}]
        assert row["images"] == src["images"] and row["data_source"] == "hiyouga/geometry3k"
        assert row["reward_model"] == {"style": "rule", "ground_truth": src["answer"]}
        assert row["extra_info"] == {"split": "test", "index": i, "answer": src["answer"], "question": src["problem"],
                                     "need_tools_kwargs": True, "tools_kwargs": {"calc_geo3k_reward": {
                                         "create_kwargs": {"ground_truth": src["answer"]}}}}
    assert "use the `calc_geo3k_reward` tool" in pp.GEO3K_TOOL_SYSTEM


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_image_prompts_hold_one_pad_per_merged_patch_and_run_in_transformers(geo3k, model_type):
    """Against transformers: the image processor's own patch count for each image's size, and the model's forward
    on the ids and pixels (the image changes the logits after it: it is attended)."""
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    folder = tiny_vl_model_dir(model_type)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    processor = vision.load_processor(folder, tokenizer, model_type)
    data = RLDataset(geo3k / "train.parquet", tokenizer, processor=processor, max_prompt_length=512)
    model = AutoModelForImageTextToText.from_pretrained(folder).eval()
    image_pad = model.config.image_token_id
    merge = processor.image_processor.merge_size ** 2
    for index in range(len(data)):
        sample, inputs = data[index], data.multi_modal_inputs(index)
        (image,) = [vision.load_image(entry) for entry in sample.images]
        patches = processor.image_processor.get_number_of_image_patches(image.height, image.width)
        assert sample.prompt_ids.count(image_pad) == patches // merge == int(inputs["image_grid_thw"].prod()) // merge
        text = tokenizer.decode(sample.prompt_ids)
        assert text.startswith("<|im_start|>system") and text.endswith("<|im_start|>assistant\n")
        assert "<|vision_start|>" + "<|image_pad|>" * (patches // merge) + "<|vision_end|>Find x" in text
    ids = torch.tensor([data[0].prompt_ids])
    inputs = data.multi_modal_inputs(0)
    with torch.no_grad():
        seen = model(input_ids=ids, mm_token_type_ids=(ids == image_pad).long(), **inputs).logits
        other = {**inputs, "pixel_values": inputs["pixel_values"].flip(0)}
        shuffled = model(input_ids=ids, mm_token_type_ids=(ids == image_pad).long(), **other).logits
    assert (seen[0, -1] - shuffled[0, -1]).abs().max() > 1e-3  # the last prompt position sees the image


def test_the_length_filter_counts_the_image_pads(geo3k):
    from transformers import AutoTokenizer

    folder = tiny_vl_model_dir("qwen2_5_vl")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    processor = vision.load_processor(folder, tokenizer, "qwen2_5_vl")
    full = RLDataset(geo3k / "train.parquet", tokenizer, processor=processor, max_prompt_length=512)
    budget = int(full.prompt_lengths.min())  # the shortest prompt fits; those with bigger images do not
    kept = RLDataset(geo3k / "train.parquet", tokenizer, processor=processor, max_prompt_length=budget)
    assert kept.num_filtered == int((full.prompt_lengths > budget).sum()) > 0


def test_rows_whose_images_cannot_be_read_are_refused(tmp_path, geo3k):
    from transformers import AutoTokenizer

    folder = tiny_vl_model_dir("qwen2_5_vl")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    processor = vision.load_processor(folder, tokenizer, "qwen2_5_vl")
    row = pq.read_table(geo3k / "train.parquet").to_pylist()[0]
    cases = {"two.parquet": ({**row, "images": row["images"] * 2}, "the row has 2 image(s) but its prompt marks 1"),
             "video.parquet": ({**row, "prompt": [{"role": "user", "content": "<video>x"}], "images": row["images"]},
                               "videos need torchvision")}
    for name, (bad, message) in cases.items():
        pq.write_table(pa.Table.from_pylist([bad]), tmp_path / name)
        with pytest.raises(vision.ImageDataError, match=f"{name}, row 0 \\(0-based\\): .*{re.escape(message)}"):
            RLDataset(tmp_path / name, tokenizer, processor=processor)
    with pytest.raises(MultiModalDataError, match="images are read for a vision-language model's processor"):
        RLDataset(geo3k / "train.parquet", tokenizer)  # a text-only model's dataset
    with pytest.raises(ValueError, match="llama has no image processor"):
        vision.load_processor(folder, tokenizer, "llama")
