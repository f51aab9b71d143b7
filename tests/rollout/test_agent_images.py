"""Multi-turn conversations on a vision-language model (issue 40; verl's Geometry3K multi-turn scripts): the tiny
Qwen2.5-VL on the HF engine, verl's Geometry3K chat template (``model.custom_chat_template``, read from the vendored
config of verl's script), a scripted user answering each assistant turn. Every turn is the engine's own sampling
with the prompt's image: the log-probs it reports for the tokens of the second and third turns equal transformers'
forward over the whole conversation with the image, which they would not if a later turn were generated without it,
and the trainer's 3-D positions for the whole conversation (``mrope_columns``) are transformers' ``get_rope_index``."""

import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from meshrl.data.chat_template import use_chat_template
from meshrl.data.mrope_positions import PROMPT_POSITIONS, positions_for_config
from meshrl.data.vision import encode_prompt, load_processor, prompt_messages
from meshrl.models.tiny_vision import tiny_vl_model_dir
from meshrl.rollout.agent_loop import AgentLoop, MultiTurnSettings
from meshrl.rollout.base import EngineConfig, SamplingConfig
from meshrl.rollout.hf_engine import HFEngine
from meshrl.rollout.interactions.base import Interaction
from meshrl.rollout.tools import ToolRunner
from meshrl.workers.sequences import mrope_columns

VENDORED = Path(__file__).resolve().parents[1] / "verl_scripts" / "arguments.json"
GEO3K_CONFIG = "/verl/examples/sglang_multiturn/config/geo3k_multiturn_grpo.yaml"


def verl_geo3k_template() -> str:
    """The chat template of verl's Geometry3K multi-turn config, as extract.py vendored it."""
    scripts = json.loads(VENDORED.read_text())["scripts"]
    text = next(s["files"][GEO3K_CONFIG] for s in scripts if GEO3K_CONFIG in s.get("files", {}))
    return yaml.safe_load(text)["actor_rollout_ref"]["model"]["custom_chat_template"]


def png(height: int, width: int, seed: int) -> dict:
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 255, (height, width, 3), dtype=np.uint8)).save(
        buffer, format="PNG")
    return {"bytes": buffer.getvalue(), "path": f"{seed}.png"}


def test_every_turn_is_generated_and_trained_with_the_prompts_image():
    from transformers import AutoConfig, AutoTokenizer, Qwen2_5_VLForConditionalGeneration

    folder = tiny_vl_model_dir("qwen2_5_vl")
    positions = positions_for_config(AutoConfig.from_pretrained(folder))
    tokenizer = use_chat_template(AutoTokenizer.from_pretrained(folder), verl_geo3k_template())
    processor = load_processor(folder, tokenizer, "qwen2_5_vl")
    rows = [([{"role": "system", "content": "Use the tool."}, {"role": "user", "content": "<image>Find x."}],
             [png(56, 84, 1)]),
            ([{"role": "user", "content": "What is <image> showing?"}], [png(70, 42, 2)])]
    prompts, images, messages = [], [], []
    for row_messages, row_images in rows:
        built, loaded = prompt_messages(row_messages, row_images)
        ids, inputs = encode_prompt(processor, built, loaded)
        # the 3-D positions of the prompt, as the dataset gives them with its images (multi_modal_inputs)
        inputs[PROMPT_POSITIONS] = positions(torch.tensor(ids), inputs["image_grid_thw"])
        prompts.append(ids), images.append(inputs), messages.append(row_messages)
    assert "<|vision_start|><|image_pad|>" in tokenizer.decode(prompts[0])  # verl's template's image item

    engine = HFEngine(folder, EngineConfig(name="hf", dtype="float32", enable_prefix_caching=False))
    # a scripted user (verl's BaseInteraction's answer) after every turn, two user turns: three assistant turns each
    loop = AgentLoop(engine, tokenizer, ToolRunner([], max_response_chars=256),
                     MultiTurnSettings(max_user_turns=2), response_length=160,
                     interactions={"user": Interaction({"name": "user"})})
    # every third token id ends a turn, so the random model's turns end after a few tokens
    stops = tuple(range(0, len(tokenizer), 3))
    sampling = SamplingConfig(n=2, max_response_length=160, stop_token_ids=stops, seed=7)
    completions, stats = loop.generate(prompts, sampling, [{"interaction_kwargs": {"name": "user"}}] * 2, messages,
                                       images=images)
    assert [s.assistant_turns for s in stats] == [3] * 4, [(s.assistant_turns, c.finish_reason)
                                                           for s, c in zip(stats, completions)]

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    for completion in completions:
        prompt, inputs = prompts[completion.prompt_index], images[completion.prompt_index]
        ids = torch.tensor(prompt + completion.token_ids)
        kinds = (ids == model.config.image_token_id).long()[None]
        with torch.no_grad():
            logits = model(input_ids=ids[None], mm_token_type_ids=kinds, pixel_values=inputs["pixel_values"],
                           image_grid_thw=inputs["image_grid_thw"]).logits[0]
            blind = model(input_ids=ids[None], mm_token_type_ids=kinds).logits[0]
        sampled = torch.tensor(completion.loss_mask).bool()
        targets = ids[len(prompt):]
        seen = torch.log_softmax(logits[len(prompt) - 1:-1], -1).gather(1, targets[:, None])[:, 0][sampled]
        unseen = torch.log_softmax(blind[len(prompt) - 1:-1], -1).gather(1, targets[:, None])[:, 0][sampled]
        engine_lp = torch.tensor(completion.logprobs)[sampled]
        assert (seen - engine_lp).abs().max() < 1e-4  # every turn, the last two included, sampled with the image
        assert (unseen - engine_lp).abs().max() > 1e-3  # the image changes them: the check could fail
        # the trainer's positions for prompt + conversation (tool and user turns are text) are transformers'
        expected, _ = model.model.get_rope_index(ids[None], mm_token_type_ids=kinds,
                                                 image_grid_thw=inputs["image_grid_thw"])
        columns = mrope_columns([prompt], [inputs], len(prompt), len(completion.token_ids))
        assert torch.equal(columns[0], expected[:, 0])


@pytest.mark.parametrize("bad", ["{% if %}", "{{ raise_exception('no') }}"])
def test_a_custom_chat_template_that_does_not_render_is_refused_naming_the_key(bad):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_vl_model_dir("qwen2_5_vl"))
    with pytest.raises(ValueError, match="actor_rollout_ref.model.custom_chat_template: the template does not render"):
        use_chat_template(tokenizer, bad)
