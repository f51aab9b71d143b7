"""Every registered family at TP1, in process: megatron's layer spec options, parity with the family's own
transformers classes (policy and critic: outputs, loss, gradients, in the row and packed layouts), and an
exported HF folder that transformers reloads to the megatron model's outputs.

TP2, PP2 and TP2xPP2 run the same ``check_parity`` per family in ``mp_worker.py`` (test_parallel_multiproc).
"""

from __future__ import annotations

import fnmatch

import pytest
import torch
from mp_worker import (FAMILIES, TEMPERATURE, build, check_parity, hf_model, hf_outputs, make_critic_dirs,
                       make_micro_batches)
from test_parallel_multiproc import EXPECT, _check

from meshrl.models.families import checkpoint_shapes, family, model_spec
from meshrl.models.tiny import tiny_config, tiny_model_dir
from meshrl.parallel import hf_conversion, layers, model_builder, schedule, state
from meshrl.parallel.forward import OutputRequest
from meshrl.memory_plan import stage_parameters

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def tp1():
    state.initialize(state.ParallelConfig())
    yield
    state.destroy()


@pytest.fixture(scope="module")
def critics(tmp_path_factory):
    """Folder of each family's HF token-classification critic (``critic-<model_type>``)."""
    workdir = tmp_path_factory.mktemp("critics")
    make_critic_dirs(workdir)
    return workdir


def _failures(result: dict, tag: str) -> list[str]:
    failures = []
    for key, value in result.items():
        rules = [rule for pattern, rule in EXPECT.items() if fnmatch.fnmatch(f"parity.{tag}.{key}", pattern)]
        if key != "grad_scale" and not _check(value, *rules[0]):
            failures.append(f"{key} = {value} (expected {' '.join(map(str, rules[0]))})")
    return failures


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_layer_specs_build_the_familys_structure(model_type: str, monkeypatch) -> None:
    """The local (CPU) spec builds q/k layernorm modules exactly for families with q/k norms, meshrl's
    zero-centred norm everywhere for Gemma's, the post norms, the soft-capped core attention and the local
    RoPE attention exactly where the spec asks; the Transformer Engine spec (not importable here) is asked
    for q/k norms with the same argument and gets the post norms built from TE's norm."""
    from megatron.core.extensions.transformer_engine import TENorm
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.transformer.identity_op import IdentityOp

    spec = model_spec(tiny_config(FAMILIES[model_type]))
    layer = model_builder._layer_spec(False, spec).submodules
    attention = layer.self_attention.submodules
    for norm in (attention.q_layernorm, attention.k_layernorm):
        assert (norm is not IdentityOp) == spec.qk_norm
    norms = [layer.input_layernorm, layer.pre_mlp_layernorm] + ([attention.q_layernorm] if spec.qk_norm else [])
    assert all((n is layers.RMSNorm) == spec.zero_centered_norms for n in norms)
    post = [attention.linear_proj, layer.mlp.submodules.linear_fc2]
    assert all(cls.__name__.startswith("PostNormed") == spec.post_norms for cls in post)
    softcap = getattr(attention.core_attention, "params", {}).get("logit_softcap")
    assert softcap == spec.attn_logit_softcap
    assert (layer.self_attention.module.__name__ == "LocalRopeSelfAttention") == (spec.local_rope_theta is not None)
    asked = []

    def te_spec(**kwargs):  # the local spec stands in for TE's, which cannot be built here
        asked.append(kwargs)
        return gpt_layer_specs.get_gpt_layer_local_spec(normalization="RMSNorm", **kwargs)

    monkeypatch.setattr(gpt_layer_specs, "get_gpt_layer_with_transformer_engine_spec", te_spec)
    te = model_builder._layer_spec(True, spec).submodules
    assert asked == [{"qk_layernorm": spec.qk_norm}]
    if spec.post_norms:
        proj = te.self_attention.submodules.linear_proj
        assert layers.post_normed(proj.__mro__[1], TENorm) is proj


@pytest.mark.parametrize("critic", [False, True], ids=["policy", "critic"])
@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_tp1_matches_the_familys_hf_model(tp1, critics, model_type: str, critic: bool) -> None:
    path = critics / f"critic-{model_type}" if critic else tiny_model_dir(FAMILIES[model_type])
    tag = f"{model_type}_critic" if critic else model_type
    result = check_parity(path, critic, temperature=TEMPERATURE[model_type])
    assert not _failures(result, tag), _failures(result, tag)


@pytest.mark.parametrize("critic", [False, True], ids=["policy", "critic"])
@pytest.mark.parametrize("model_type", ["qwen3", "mistral", "gemma", "gemma2", "gemma3_text", "phi3", "glm4"])
def test_export_reloads_to_the_same_outputs(tp1, critics, tmp_path, model_type: str, critic: bool) -> None:
    """Perturbed megatron weights (a stand-in for training) -> ``save_hf_checkpoint`` -> the family's
    transformers class reloads it and computes megatron's log-probs / values; the parameter count is
    ``meshrl plan``'s."""
    from transformers import AutoConfig

    path = critics / f"critic-{model_type}" if critic else tiny_model_dir(FAMILIES[model_type])
    chunks = build(path, critic)
    built = sum(p.numel() for chunk in chunks for p in model_builder.unwrap(chunk).parameters())
    spec = model_spec(AutoConfig.from_pretrained(path))
    assert built == stage_parameters(spec, critic=critic)
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for param in (p for chunk in chunks for p in chunk.parameters()):
            param.add_(0.02 * torch.randn(param.shape, generator=generator))
    out = hf_conversion.save_hf_checkpoint(chunks, AutoConfig.from_pretrained(path), tmp_path / "export",
                                           tokenizer_dir=path)
    exported = hf_conversion.HFCheckpointReader(out)
    assert {name: exported.shape(name) for name in exported.file_of} == checkpoint_shapes(spec, critic)
    batches = make_micro_batches()
    megatron = schedule.forward_only(chunks, batches, OutputRequest(entropy=not critic))
    reloaded = hf_model(out, critic)
    fam = family(spec.model_type)
    assert type(reloaded).__name__ == (fam.critic_class if critic else fam.policy_class)
    with torch.no_grad():
        for mine, mb in zip(megatron, batches):
            theirs = hf_outputs(reloaded, mb, critic)
            for key in theirs:
                assert float((mine[key] - theirs[key]).abs().max()) <= 1.5e-5, key
