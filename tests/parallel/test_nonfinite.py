"""Non-finite numbers at the parallel layer, in process at TP1 (fp32 and bf16 parameters): an update whose
gradient norm or loss is NaN / inf is not applied (weights and Adam state stay bit for bit), a normal update
is megatron's own ``step()`` to the bit, and a checkpoint refuses weights or optimizer state holding NaN / inf
on save (the previous one stays the latest) and on load."""

from __future__ import annotations

import math

import pytest
import torch
from mp_worker import build, make_micro_batches, policy_loss

from meshrl.parallel import checkpoint, optimizer, state
from meshrl.parallel.forward import OutputRequest
from meshrl.parallel.model_builder import param_dtype
from meshrl.parallel.offload import _optimizer_tensors
from meshrl.parallel.schedule import forward_backward

REQUEST = OutputRequest(entropy=True)
OPT = optimizer.OptimizerConfig(lr=1e-3, clip_grad=1.0)


@pytest.fixture(scope="module")
def tp1():
    state.initialize(state.ParallelConfig())
    yield
    state.destroy()


def infinite_gradient_loss(outputs, mb):
    """A finite loss whose gradient is not: d sqrt(x)/dx at 0 is inf."""
    loss, metrics = policy_loss(outputs, mb)
    total = outputs["log_probs"].sum()
    return loss + torch.sqrt(total - total.detach()), metrics


def nan_loss(outputs, mb):
    """A NaN loss whose gradient is finite (the NaN is a constant), as a NaN masked to zero would give."""
    loss, metrics = policy_loss(outputs, mb)
    return loss + torch.tensor(float("nan")), metrics


def tensors(chunks, opt) -> list[torch.Tensor]:
    return [p.detach().clone() for c in chunks for p in c.parameters()] + \
        [t.detach().clone() for t in _optimizer_tensors(opt)]


def unchanged(before: list[torch.Tensor], after: list[torch.Tensor]) -> bool:
    return len(before) == len(after) and all(torch.equal(a, b) for a, b in zip(before, after))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("bad_loss", [infinite_gradient_loss, nan_loss])
def test_a_nonfinite_update_is_not_applied(tp1, tiny_llama_dir, dtype, bad_loss) -> None:
    chunks = build(tiny_llama_dir, dtype=param_dtype(dtype))
    opt, _ = optimizer.build_optimizer(chunks, OPT)
    batches = make_micro_batches()
    assert optimizer.train_step(chunks, opt, None, batches, policy_loss, REQUEST)["update_successful"]
    before = tensors(chunks, opt)  # weights, main params and Adam's moments and step after one update
    stats = optimizer.train_step(chunks, opt, None, batches, bad_loss, REQUEST)
    assert not stats["update_successful"] and not math.isfinite(stats["grad_norm"])
    assert math.isfinite(stats["loss"]) == (bad_loss is infinite_gradient_loss)
    assert unchanged(before, tensors(chunks, opt))
    # the next good update applies as usual
    stats = optimizer.train_step(chunks, opt, None, batches, policy_loss, REQUEST)
    assert stats["update_successful"] and math.isfinite(stats["grad_norm"])
    after = tensors(chunks, opt)
    assert not unchanged(before, after) and all(torch.isfinite(t).all() for t in after)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_finite_update_is_megatrons_own_step(tp1, tiny_llama_dir, dtype) -> None:
    """``optimizer_step`` takes megatron's ChainedOptimizer.step apart to check the norm: the same weights."""
    batches = make_micro_batches()
    results = []
    for ours in (True, False):
        chunks = build(tiny_llama_dir, dtype=param_dtype(dtype))
        opt, _ = optimizer.build_optimizer(chunks, OPT)
        for _ in range(2):
            optimizer.zero_grad(chunks, opt)
            forward_backward(chunks, batches, policy_loss, REQUEST)
            norm = optimizer.optimizer_step(opt)["grad_norm"] if ours else opt.step()[1]
        results.append((norm, tensors(chunks, opt)))
    assert results[0][0] == results[1][0] > OPT.clip_grad  # clipping ran
    assert unchanged(results[0][1], results[1][1])


def test_a_checkpoint_refuses_nonfinite_tensors(tp1, tiny_llama_dir, tmp_path, monkeypatch) -> None:
    chunks = build(tiny_llama_dir)
    opt, sched = optimizer.build_optimizer(chunks, OPT)
    optimizer.train_step(chunks, opt, sched, make_micro_batches(), policy_loss, REQUEST)
    root = tmp_path / "actor"
    checkpoint.save_checkpoint(root, 1, chunks, opt, sched)
    name, param = next((n, p) for n, p in chunks[0].module.named_parameters() if "linear_fc1" in n)
    with torch.no_grad():
        param.view(-1)[3] = float("nan")
    with pytest.raises(checkpoint.NonFiniteCheckpointError) as info:
        checkpoint.save_checkpoint(root, 2, chunks, opt, sched)
    message = str(info.value)
    assert "step 2 of the actor" in message and name in message and "previous checkpoint stays the latest" in message
    assert checkpoint.latest_checkpoint(root).name == "step_00000001"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000001"]

    with torch.no_grad():
        param.view(-1)[3] = 0.0
        exp_avg = next(s["exp_avg"] for s in opt.chained_optimizers[0].optimizer.state.values())
        exp_avg.view(-1)[0] = float("inf")
    with pytest.raises(checkpoint.NonFiniteCheckpointError, match=r"1 optimizer state tensor\(s\)"):
        checkpoint.save_checkpoint(root, 2, chunks, opt, sched)

    # A checkpoint written without the check (before it existed) is named when loaded.
    monkeypatch.setattr(checkpoint, "_nonfinite_tensors", lambda chunks, optimizer: [])
    checkpoint.save_checkpoint(root, 2, chunks, opt, sched)
    monkeypatch.undo()
    fresh = build(tiny_llama_dir)
    fresh_opt, fresh_sched = optimizer.build_optimizer(fresh, OPT)
    with pytest.raises(checkpoint.NonFiniteCheckpointError, match="step_00000002 holds NaN or inf"):
        checkpoint.load_checkpoint(root, fresh, fresh_opt, fresh_sched)
