"""torch's fused AdamW kernel behind megatron's optimizer (``optimizer.OptimizerConfig.fused_adam``) against torch's
per-parameter loop (megatron's fallback as it comes), in process at TP1.

One update of a tiny Llama from the same weights on the same micro-batch: the weights after it agree within two
fp32 epsilons of each tensor's scale (the fused kernel computes ``m``, ``v`` and the step in one pass, in another
order of roundings; measured <= 0.56 epsilon on CPU: 3e-8 at weights of scale 0.3-0.45, and 1.12 with the CUDA
kernel on an H100), and moved by far more (2e-3).
A second update runs on the fused state (its step count is what a checkpoint saves). After it the two runs
differ by up to 2.7e-7: the first update's rounding changes the second's gradients, which Adam's normalisation
amplifies where a gradient is near zero.
"""

from __future__ import annotations

import pytest
import torch

from meshrl.parallel import model_builder, optimizer, state
from meshrl.parallel.forward import OutputRequest

EPS = torch.finfo(torch.float32).eps
CONFIG = dict(lr=1e-3, weight_decay=0.1, eps=1e-6, clip_grad=1.0)


@pytest.fixture(scope="module")
def tp1():
    state.initialize(state.ParallelConfig())
    yield
    state.destroy()


def _batches() -> list[dict]:
    g = torch.Generator().manual_seed(5)
    mask = torch.ones(3, 10, dtype=torch.long)
    mask[0, :2] = 0
    return [{"input_ids": torch.randint(0, 49152, (3, 10), generator=g), "attention_mask": mask,
             "adv": torch.randn(3, 10, generator=g), "loss_mask": mask.float(), "n_tokens": float(mask.sum())}]


def _loss(outputs: dict, mb: dict):
    return -(outputs["log_probs"] * mb["adv"] * mb["loss_mask"]).sum() / mb["n_tokens"], {}


def _trained(path: str, fused: bool) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], object, list]:
    from transformers import AutoConfig

    from meshrl.parallel import hf_conversion

    chunks = model_builder.build_model(AutoConfig.from_pretrained(path), dtype=torch.float32)  # a GPU's default: bf16
    hf_conversion.load_hf_weights(chunks, path)
    start = {n: p.detach().clone() for n, p in chunks[0].named_parameters()}
    opt, sched = optimizer.build_optimizer(chunks, optimizer.OptimizerConfig(**CONFIG, fused_adam=fused))
    assert optimizer.train_step(chunks, opt, sched, _batches(), _loss, OutputRequest())["update_successful"]
    return start, {n: p.detach().clone() for n, p in chunks[0].named_parameters()}, opt, (chunks, sched)


def test_the_fused_kernel_updates_as_the_loop_does(tp1, tiny_llama_dir) -> None:
    start, looped, loop_opt, _ = _trained(tiny_llama_dir, fused=False)
    _, fused, fused_opt, (chunks, sched) = _trained(tiny_llama_dir, fused=True)
    assert all(g["fused"] for g in fused_opt.param_groups) and not any(g.get("fused") for g in loop_opt.param_groups)
    moved = max(float((looped[n] - start[n]).abs().max()) for n in start)
    # In units of fp32's epsilon at each tensor's scale (the norms' weights are ~1, the others ~0.1).
    ulps = max(float((fused[n] - looped[n]).abs().max() / (EPS * looped[n].abs().max())) for n in start)
    assert moved > 1e-3 and ulps <= 2, (moved, ulps)
    assert optimizer.train_step(chunks, fused_opt, sched, _batches(), _loss, OutputRequest())["update_successful"]
    for inner in optimizer._inner_optimizers(fused_opt):  # the torch state a checkpoint saves
        assert {float(s["step"]) for s in inner.optimizer.state_dict()["state"].values()} == {2.0}


def test_a_device_without_the_kernel_is_refused() -> None:
    param = torch.nn.Parameter(torch.zeros(2, device="meta"))
    with pytest.raises(ValueError, match=r"no fused AdamW kernel for \['meta'\]: set fused_adam=False"):
        optimizer._use_fused_kernel(torch.optim.AdamW([param]))
