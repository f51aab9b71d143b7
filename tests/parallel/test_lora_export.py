"""The merged HF export of a LoRA policy (``hf_model`` in the actor's ``checkpoint.save_contents``): the folder
``save_hf_checkpoint`` writes from the merged stream is a plain HF checkpoint that transformers loads without PEFT,
and it computes what PEFT's ``merge_and_unload()`` of the adapter saved beside it computes (the independent
reference)."""

from __future__ import annotations

import pytest
import torch
from mp_worker import build, hf_model
from safetensors import safe_open

from meshrl.parallel import lora, peft_io, state
from meshrl.parallel.hf_conversion import save_hf_checkpoint


@pytest.fixture(scope="module")
def tp1():
    state.initialize(state.ParallelConfig())
    yield
    state.destroy()


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.parametrize("fixture,settings", [
    ("tiny_llama_dir", lora.LoraSettings(rank=4, alpha=16, targets=tuple(lora.HF_TARGETS))),
    # fused (one A per megatron layer), a subset of the parts, on a model with QKV bias and an untied head
    ("tiny_qwen2_dir", lora.LoraSettings(rank=8, alpha=8, targets=("q_proj", "v_proj", "up_proj", "down_proj"),
                                         shared_a=True, init_a="xavier")),
], ids=["llama-all-linear", "qwen2-fused-subset"])
def test_merged_export_equals_peft_merge_and_unload(tp1, request, tmp_path, fixture, settings) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    path = request.getfixturevalue(fixture)
    chunks = lora.apply_lora(build(path), settings)
    # B != 0 (PEFT's init_lora_weights=False): at B = 0 the merged model would be the base
    torch.manual_seed(0)
    with torch.no_grad():
        for _, adapter in lora.adapters(chunks):
            for b in adapter.lora_B.values():
                b.normal_(std=0.1)
    base = hf_model(path, critic=False)
    # the worker's export stream with LoRA (ActorRolloutRefWorker.hf_weights): the merged weights
    exported = save_hf_checkpoint(chunks, base.config, tmp_path / "huggingface", tokenizer_dir=path,
                                  weights=peft_io.iter_merged_weights(chunks, base.config))
    adapter = peft_io.save_adapter(chunks, tmp_path / "lora_adapter", base_model=str(path))

    # plain HF: no PEFT names, no adapter files
    names = {name for file in exported.glob("*.safetensors") for name in safe_open(str(file), "pt").keys()}
    assert names and not [n for n in names if "lora" in n or "base_layer" in n]
    assert not (exported / peft_io.CONFIG_FILE).exists()

    ids = torch.randint(0, base.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    base_logits = logits(base.eval(), ids)
    reference = PeftModel.from_pretrained(base, adapter).merge_and_unload().eval()
    mine = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32, attn_implementation="eager").eval()
    exported_logits = logits(mine, ids)
    assert float((exported_logits - logits(reference, ids)).abs().max()) < 1e-5
    assert float((exported_logits - base_logits).abs().max()) > 1e-2  # the export is not the base
