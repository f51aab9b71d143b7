"""The megatron CPU compatibility layer: the audited places still exist, and each redirection behaves.

These fail loudly on a megatron-core upgrade that moves or rewrites a patched place, before any model
runs. They import megatron (~4 s) but start no process group.
"""

from __future__ import annotations

import sys

import pytest
import torch

from meshrl.parallel import cpu_compat


def test_megatron_is_the_audited_version() -> None:
    assert cpu_compat.megatron_version() == cpu_compat.SUPPORTED_MEGATRON_VERSION


def test_every_patch_point_exists_with_its_cuda_marker() -> None:
    cpu_compat.verify_patch_points()


def test_a_moved_patch_point_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    moved = cpu_compat.PATCH_POINTS + (("megatron.core.utils", "no_such_function", "x"),)
    monkeypatch.setattr(cpu_compat, "PATCH_POINTS", moved)
    with pytest.raises(RuntimeError, match="moved megatron.core.utils.no_such_function"):
        cpu_compat.verify_patch_points()


def test_a_changed_patch_point_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    changed = cpu_compat.PATCH_POINTS + (("megatron.core.utils", "local_multi_tensor_l2_norm", "not-there"),)
    monkeypatch.setattr(cpu_compat, "PATCH_POINTS", changed)
    with pytest.raises(RuntimeError, match="no longer contains 'not-there'"):
        cpu_compat.verify_patch_points()


def test_torch_stand_in_redirects_only_cuda() -> None:
    fake = cpu_compat._TORCH_ON_CPU
    assert fake.cuda.current_device() == torch.device("cpu")
    assert fake.cuda.synchronize() is None
    assert fake.zeros(2, device="cuda").device.type == "cpu"
    assert fake.tensor([1.0], device=torch.device("cuda", 0)).device.type == "cpu"
    assert fake.ones(1, device="meta").device.type == "meta"  # other devices untouched
    assert fake.nn is torch.nn and fake.float32 is torch.float32
    assert fake.cuda.is_available() == torch.cuda.is_available()


def test_cuda_rng_calls_drive_the_cpu_generator() -> None:
    fake = cpu_compat._TORCH_ON_CPU
    fake.cuda.manual_seed(123)
    first = torch.rand(3)
    state = fake.cuda.get_rng_state()
    second = torch.rand(3)
    fake.cuda.set_rng_state(state)
    assert torch.equal(torch.rand(3), second)
    torch.manual_seed(123)
    assert torch.equal(torch.rand(3), first)


def test_tensor_method_shims_are_scoped() -> None:
    real_type, real_cuda = torch.Tensor.type, torch.Tensor.cuda
    tensor = torch.zeros(2)
    with pytest.raises(ValueError):
        with cpu_compat._tensor_methods_as_cuda():
            assert tensor.type() == "torch.cuda.FloatTensor"
            assert tensor.type(torch.float64).dtype == torch.float64
            assert tensor.cuda() is tensor
            raise ValueError("leave the block by an exception")
    assert torch.Tensor.type is real_type and torch.Tensor.cuda is real_cuda
    assert tensor.type() == "torch.FloatTensor"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the layer is not applied when CUDA is present")
def test_apply_redirects_megatron_modules_only() -> None:
    assert cpu_compat.apply() is True
    assert cpu_compat.apply() is True  # idempotent
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.tensor_parallel import random as tp_random
    from megatron.core.transformer.utils import get_default_causal_mask

    assert schedules.torch is cpu_compat._TORCH_ON_CPU
    assert get_default_causal_mask(3).device.type == "cpu"
    assert tp_random._get_cuda_rng_state is cpu_compat._get_cpu_rng_state
    assert sys.modules["torch"] is torch and torch.cuda.current_device is not cpu_compat._CudaOnCpu.current_device
    # A megatron module imported only now (lazily, as megatron itself does) gets the stand-in too.
    sys.modules.pop("megatron.core.inference.communication_utils", None)
    import megatron.core.inference.communication_utils as late

    assert late.torch is cpu_compat._TORCH_ON_CPU
    cpu_compat.verify_patch_points()  # still finds the originals behind the wrappers
