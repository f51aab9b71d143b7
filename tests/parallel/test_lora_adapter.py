"""The adapter tensors vLLM's adapter path expects (``meshrl.rollout.lora_adapter``) are PEFT's: names and shapes
equal those of ``get_peft_model`` on the HF model, derived only from the engine's weight manifest and the
adapter config meshrl writes (``peft_io.adapter_config``); a stream that does not fit is refused by name.
(``peft_io.iter_adapter_weights`` yields PEFT's names at TP1 / TP2 / PP2: ``test_lora_vllm.py`` and
``test_lora_multiproc.py``.)"""

from __future__ import annotations

import pytest
import torch

from meshrl.parallel import peft_io
from meshrl.parallel.lora import LoraSettings
from meshrl.rollout.lora_adapter import adapter_shapes, collect_adapter
from meshrl.rollout.weight_sync import WeightSyncError, hf_weight_manifest

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def peft_tensors(path, settings: LoraSettings) -> dict[str, torch.Tensor]:
    """PEFT's own adapter tensors on the HF model, under the names of its saved adapter (no ``.default``)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
                           LoraConfig(r=settings.rank, lora_alpha=settings.alpha,
                                      target_modules=list(settings.targets)))
    return {name.replace(".default", ""): tensor for name, tensor in model.state_dict().items() if ".lora_" in name}


@pytest.mark.parametrize("fixture,targets", [("tiny_llama_dir", ALL),
                                             ("tiny_qwen2_dir", ("k_proj", "v_proj", "up_proj"))],
                         ids=["llama-all-linear", "qwen2-subset"])
def test_expected_adapter_is_pefts(request, fixture, targets) -> None:
    path = request.getfixturevalue(fixture)
    settings = LoraSettings(rank=8, alpha=16, targets=targets)
    config = peft_io.adapter_config(settings, str(path))
    theirs = peft_tensors(path, settings)
    manifest = hf_weight_manifest(str(path))
    assert adapter_shapes(manifest, config) == {name: tuple(t.shape) for name, t in theirs.items()}
    assert collect_adapter(iter(theirs.items()), manifest, config).keys() == theirs.keys()


def test_streams_that_do_not_fit_are_refused(tiny_llama_dir) -> None:
    settings = LoraSettings(rank=8, alpha=16, targets=("q_proj", "v_proj"))
    config = peft_io.adapter_config(settings, None)
    manifest = hf_weight_manifest(str(tiny_llama_dir))
    good = list(peft_tensors(tiny_llama_dir, settings).items())
    a_name, a = good[0]
    bad_streams = {
        "unexpected adapter tensor": good + [(a_name.replace("q_proj", "o_proj"), a)],  # not a target
        "sent twice": good + [good[0]],
        "has shape": [(a_name, a[:4])] + good[1:],  # rank 4 for a rank-8 config
        "must be floating point": [(a_name, a.to(torch.int32))] + good[1:],
        "ended without 1 of its 8": good[1:],
    }
    for problem, stream in bad_streams.items():
        with pytest.raises(WeightSyncError, match=problem):
            collect_adapter(iter(stream), manifest, config)
    with pytest.raises(ValueError, match="list module names"):
        adapter_shapes(manifest, {**config, "target_modules": "all-linear"})


def test_cpu_lora_ops_compute_what_vllms_do() -> None:
    """``vllm_cpu_lora``'s ops (one matmul per adapter slot) against vLLM's own (a copy of the adapter per token),
    loaded from vLLM's file so that a patched module cannot stand in for them: several slots, -1 (vLLM's index for
    no adapter), 4-D stacked weights, shrink with scaling, expand with and without adding, the sliced expand."""
    import importlib.util

    from meshrl.rollout import vllm_cpu_lora as mine

    # The file itself (it imports only torch): importing the vllm package would take seconds.
    vllm_dir = importlib.util.find_spec("vllm").submodule_search_locations[0]
    spec = importlib.util.spec_from_file_location("vllm_lora_ops", f"{vllm_dir}/lora/ops/torch_ops/lora_ops.py")
    theirs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(theirs)
    g = torch.Generator().manual_seed(0)
    tokens, rank, width, slots = 7, 8, 24, 3
    indices = torch.tensor([0, 2, -1, 0, 1, 2, 0])
    x, h = torch.randn(tokens, width, generator=g), torch.randn(tokens, rank, generator=g)
    a, b = torch.randn(slots, 1, rank, width, generator=g), torch.randn(slots, 1, width, rank, generator=g)
    start = torch.randn(tokens, 2 * width, generator=g)
    calls = [("bgmv_shrink", (x, a), (0.5,), rank), ("bgmv_expand", (h, b), (True,), width),
             ("bgmv_expand", (h, b), (False,), width),
             ("bgmv_expand_slice", (h, b), (width, width, True), 2 * width)]
    for name, args, extra, out_width in calls:
        outs = [start[:, :out_width].clone() for _ in range(2)]
        getattr(theirs, name)(*args, outs[0], indices, *extra)
        getattr(mine, name)(*args, outs[1], indices, *extra)
        assert torch.allclose(outs[0], outs[1], atol=1e-5, rtol=0), name
        assert not torch.equal(outs[1], start[:, :out_width])  # the call wrote something
    single = torch.zeros(tokens, dtype=torch.long)  # one slot: the single-matmul path
    outs = [torch.zeros(tokens, rank) for _ in range(2)]
    theirs.bgmv_shrink(x, a, outs[0], single, 1.0)
    mine.bgmv_shrink(x, a, outs[1], single, 1.0)
    assert torch.allclose(outs[0], outs[1], atol=1e-5, rtol=0)
