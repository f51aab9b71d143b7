"""Two GRPO steps of the tiny Qwen2.5-VL and Qwen3-VL on Geometry3K-layout prompts with images (issue 40), through
the whole path: meshrl's processor and 3-D positions, the HF engine generating from the images, the Megatron policy
(vision tower on the first stage) computing log-probs and updating, the new weights (tower included) synced into
the engine, the HF export. The engine and the trainer see the same images at the same positions only if every link
carries them: at both steps their log-probs agree (step 2 after an update that moved every tensor), and the export
loads in transformers with every tensor trained."""

from pathlib import Path

import pytest
from e2e_checks import geo3k_data

# `make test-extended` (about a minute): `make test` checks the parts (the model against transformers at TP1 / TP2 /
# PP2, the processor, the 3-D positions, the refusals) and stays within CI's budget.
pytestmark = [pytest.mark.e2e, pytest.mark.extended, pytest.mark.timeout(600), pytest.mark.usefixtures("ray_session")]


@pytest.fixture
def geo3k(tmp_path) -> Path:
    return geo3k_data(tmp_path)


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
