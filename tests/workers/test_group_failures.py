"""WorkerGroup failure handling with real Ray actors in a gloo group: when one rank raises or dies while
its peers wait for it in a collective, the call fails within seconds naming that rank (not a peer whose
collective broke when it died), and the peers are killed instead of blocking until the process-group
timeout (300 s here)."""

import os
import time

import psutil
import pytest

from meshrl.workers.group import WorkerError, WorkerGroup

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(300)]

WORLD = 3
FAILING = 1
COLLECTIVE_TIMEOUT_S = 300


def _rank_class():
    # Defined in a function so that Ray ships the class by value (the tests folder is not importable
    # in the actors).
    class Rank:
        def __init__(self, rank: int, world_size: int) -> None:
            self.rank, self.world_size = rank, world_size

        def address(self) -> str:
            import socket

            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                return f"tcp://127.0.0.1:{s.getsockname()[1]}"

        def setup(self, address: str) -> int:
            from datetime import timedelta

            import torch.distributed as dist

            dist.init_process_group("gloo", init_method=address, rank=self.rank, world_size=self.world_size,
                                    timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
            return os.getpid()

        def step(self, failing: int, how: str) -> float:
            import torch
            import torch.distributed as dist

            if self.rank == failing:
                if how == "raise":
                    raise ValueError("bad batch")
                os._exit(1)
            value = torch.ones(1)
            dist.all_reduce(value)  # never completes: the failing rank does not join
            return float(value)

    return Rank


def _started_group():
    import ray

    group = WorkerGroup(_rank_class(), WORLD, name="toy", timeout_s=120,
                        env_vars={"OMP_NUM_THREADS": "1"})
    address = ray.get(group.workers[0].address.remote(), timeout=120)
    return group, group.call("setup", address)


def _alive(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            pass
    return alive


@pytest.mark.parametrize("how,message", [("raise", r"toy rank 1 failed in step: ValueError: bad batch"),
                                         ("exit", r"toy rank 1 died during step")])
def test_a_failing_rank_fails_the_call_and_its_blocked_peers_are_killed(ray_session, how, message):
    group, pids = _started_group()
    try:
        start = time.monotonic()
        with pytest.raises(WorkerError, match=message):
            group.call("step", FAILING, how)
        failed_after = time.monotonic() - start
        deadline = time.monotonic() + 10
        while _alive(pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        gone_after = time.monotonic() - start
        assert _alive(pids) == [], f"still alive {gone_after:.1f} s after the call: {_alive(pids)} of {pids}"
        assert failed_after < 60, failed_after  # far below the collective timeout
        # Later calls name the first failure instead of a dead rank 0.
        with pytest.raises(WorkerError, match=rf"toy was stopped after an earlier failure: {message}"):
            group.call("step", FAILING, how)
    finally:
        group.shutdown()
