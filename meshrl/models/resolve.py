"""``actor_rollout_ref.model.path`` → a local Hugging Face folder.

    embedded:smollm2       the packaged SmolLM2-135M-Instruct (converted once into the cache)
    embedded:gemma3-270m   the packaged Gemma-3-270M (pretrained; converted once into the cache)
    tiny:<family>          a tiny random model of a registered family, named by its module in
                           meshrl.models.families (tiny:llama, tiny:qwen2, tiny:qwen3, tiny:mistral, tiny:gemma,
                           tiny:gemma2, tiny:gemma3 for model_type gemma3_text, tiny:qwen2_5_vl and
                           tiny:qwen3_vl with a vision tower; tests, smoke runs)
    tiny-rm:<family>       a tiny random reward model (*ForSequenceClassification, one label) of a family
                           (meshrl.models.tiny_reward; reward_model.model.path in tests)
    <folder>               a local HF folder (config.json + safetensors + tokenizer)

No model hub is reachable, so a hub id such as ``Qwen/Qwen2.5-7B-Instruct`` that is not a local
folder is an error that says how to provide the model.
"""

from __future__ import annotations

from pathlib import Path

from meshrl.models.families import FAMILY_MODULES, text_model_types

EMBEDDED_MODELS = ("embedded:smollm2", "embedded:gemma3-270m")
# tiny:<family module> -> its model_type
TINY_MODELS = {f"tiny:{module}": model_type for model_type, module in FAMILY_MODULES.items()}
TINY_REWARD_MODELS = {f"tiny-rm:{FAMILY_MODULES[model_type]}": model_type for model_type in text_model_types()}


def resolve_model_path(path: str) -> Path:
    if path == "embedded:smollm2":
        from meshrl.models.embedded import smollm2_hf_dir

        return smollm2_hf_dir()
    if path == "embedded:gemma3-270m":
        from meshrl.models.embedded import gemma3_270m_hf_dir

        return gemma3_270m_hf_dir()
    if path in TINY_MODELS and TINY_MODELS[path] not in text_model_types():
        from meshrl.models.tiny_vision import tiny_vl_model_dir

        return tiny_vl_model_dir(TINY_MODELS[path])
    if path in TINY_MODELS:
        from meshrl.models.tiny import tiny_model_dir, tiny_spec

        return tiny_model_dir(tiny_spec(TINY_MODELS[path]))
    if path in TINY_REWARD_MODELS:
        from meshrl.models.tiny_reward import tiny_reward_model_dir

        return tiny_reward_model_dir(TINY_REWARD_MODELS[path])
    folder = Path(path).expanduser()
    if (folder / "config.json").is_file():
        return folder
    if folder.exists():
        raise FileNotFoundError(f"model path {folder} has no config.json; give a Hugging Face model folder")
    raise FileNotFoundError(
        f"model path '{path}' is not a local folder, and no model hub is reachable from here. Download the "
        f"model elsewhere and pass its folder, or use one of: {', '.join(EMBEDDED_MODELS + tuple(TINY_MODELS))}.")
