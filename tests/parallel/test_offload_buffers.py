"""Offload's host-buffer pool: buffers come back on restore and the next offload reuses them."""

import torch

from meshrl.parallel.offload import HostBuffers, offload


def test_host_buffers_are_reused_and_round_trip_is_exact():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 8))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    total = sum(p.untyped_storage().nbytes() for p in model.parameters())
    pool = HostBuffers()

    first = offload([model], params=True, grads=False, optimizer_state=False, include_host_tensors=True,
                    buffers=pool)
    assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())
    assert first.nbytes == total and pool.nbytes == 0
    pointers = sorted(host.data_ptr() for _, host in first._moved)
    first.restore()
    assert pool.nbytes == total  # every buffer went back to the pool

    second = offload([model], params=True, grads=False, optimizer_state=False, include_host_tensors=True,
                     buffers=pool)
    assert sorted(host.data_ptr() for _, host in second._moved) == pointers
    assert pool.nbytes == 0
    second.restore()
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
