"""Two GRPO steps of the tiny Qwen2.5-VL and Qwen3-VL on Geometry3K-layout prompts with images (issue 40), through
the whole path: meshrl's processor and 3-D positions, the HF engine generating from the images, the Megatron policy
(vision tower on the first stage) computing log-probs and updating, the new weights (tower included) synced into
the engine, the HF export. The engine and the trainer see the same images at the same positions only if every link
carries them: at both steps their log-probs agree (step 2 after an update that moved every tensor), and the export
loads in transformers with every tensor trained."""

import io
from pathlib import Path

import numpy as np
import pytest

# `make test-extended` (about a minute): `make test` checks the parts (the model against transformers at TP1 / TP2 /
# PP2, the processor, the 3-D positions, the refusals) and stays within CI's budget.
pytestmark = [pytest.mark.e2e, pytest.mark.extended, pytest.mark.timeout(600), pytest.mark.usefixtures("ray_session")]


@pytest.fixture
def geo3k(tmp_path) -> Path:
    """verl's Geometry3K layout written by ``meshrl preprocess geo3k`` from a local copy of images of several
    sizes."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from PIL import Image

    from meshrl.data import preprocess

    def png(height: int, width: int, seed: int) -> bytes:
        buffer = io.BytesIO()
        pixels = np.random.default_rng(seed).integers(0, 255, (height, width, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(buffer, format="PNG")
        return buffer.getvalue()

    copy = tmp_path / "geometry3k"
    (copy / "data").mkdir(parents=True)
    for split, count in (("train", 8), ("test", 2)):
        rows = [{"images": [{"bytes": png(40 + 14 * i, 60 + 9 * i, i), "path": f"{split}_{i}.png"}],
                 "problem": f"<image>Find x in triangle {i}.", "answer": str(3 + i)} for i in range(count)]
        pq.write_table(pa.Table.from_pylist(rows), copy / "data" / f"{split}-00000-of-00001.parquet")
    out = tmp_path / "geo3k"
    preprocess.preprocess("geo3k", out, local_dataset_path=copy, log=lambda _: None)
    return out


@pytest.mark.parametrize("model_type", ["qwen2_5_vl", "qwen3_vl"])
def test_two_grpo_steps_on_image_prompts_with_the_hf_engine(train, tmp_path, geo3k, model_type):
    import torch

    from meshrl.models.families import family
    from meshrl.models.hf_classes import hf_class
    from meshrl.models.tiny_vision import tiny_vl_model_dir

    model_class = hf_class(family(model_type).policy_class)
    run = tmp_path / "run"
    _, steps = train(f"actor_rollout_ref.model.path=tiny:{model_type}", "actor_rollout_ref.rollout.name=hf",
                     f"data.train_files={geo3k / 'train.parquet'}", f"data.val_files={geo3k / 'test.parquet'}",
                     "trainer.total_training_steps=2", "trainer.val_before_train=False", "trainer.test_freq=-1",
                     "trainer.save_freq=2",
                     "actor_rollout_ref.actor.checkpoint.save_contents=[model,optimizer,extra,hf_model]",
                     run_dir=run)
    for step in (1, 2):  # HF engine and Megatron in fp32 on the same images: rounding only
        assert steps[step]["rollout/log_prob_max_abs_diff"] < 1e-4, (step, steps[step])
    assert steps[1]["actor/grad_norm"] > 0
    exported = run / "global_step_2" / "actor" / "huggingface"
    assert (exported / "preprocessor_config.json").is_file()  # the folder serves as a model path again
    model, info = model_class.from_pretrained(exported, dtype=torch.float32, output_loading_info=True)
    assert not any(info[key] for key in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    initial = dict(model_class.from_pretrained(tiny_vl_model_dir(model_type), dtype=torch.float32)
                   .named_parameters())
    unchanged = [name for name, param in model.named_parameters() if torch.equal(param, initial[name])]
    assert not unchanged and any(name.startswith("model.visual.") for name in initial), unchanged
