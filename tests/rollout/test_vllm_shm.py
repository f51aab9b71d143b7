"""Shared memory of colocated vLLM engines (meshrl.rollout.vllm_shm): per-run names, nothing left behind.

The first two tests need no engine. The others start inference-TP-2 engines over 2-rank gloo worlds
(``vllm_shm_rank.py``, one process per rank): two runs at the same time, one shut down and one killed after
its start; and a run killed while its engine starts, whose names the stale check removes.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from datetime import timedelta
from multiprocessing import shared_memory
from pathlib import Path
from types import SimpleNamespace

import pytest

from meshrl.rollout.vllm_shm import SHM_DIR, EngineSegments, remove_stale_segments, segments
from meshrl.runtime import remove_orphaned_shared_memory

RANK = Path(__file__).with_name("vllm_shm_rank.py")
LEAK_WARNINGS = ("Exception ignored", "leaked shared_memory")


def reaped_child() -> int:
    """The pid of a process that has ended and been reaped: no live process has it (until the pids wrap)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def shm_file(name: str) -> Path:
    path = SHM_DIR / name
    path.write_bytes(b"\0" * 64)
    return path


@pytest.fixture
def cleanup_names():
    """Names a test creates under /dev/shm, removed afterwards whatever happened."""
    paths: list[Path] = []
    yield paths
    for path in paths:
        path.unlink(missing_ok=True)


def test_stale_check_removes_only_names_of_dead_pids(cleanup_names):
    nonce = secrets.token_hex(4)
    stale = shm_file(f"meshrl-{reaped_child()}-{nonce}-tp:0-[0-1]-cpushm_0")
    live = shm_file(f"meshrl-{os.getpid()}-{nonce}-psm_{nonce}")
    foreign = shm_file(f"-tp:0-[0-1]-cpushm_{nonce}")  # vLLM's own naming: not meshrl's to remove
    cleanup_names.extend([stale, live, foreign])

    removed = remove_stale_segments()

    assert stale.name in removed and not stale.exists()
    assert live.exists() and foreign.exists() and live.name not in removed and foreign.name not in removed


def test_orphaned_message_queues_go_and_held_or_other_names_stay(cleanup_names):
    """What a killed vLLM process tree leaves (``psm_*`` segments, ``sem.mp-*`` semaphores no process holds) is removed;
    a segment a live process has mapped, one it only holds open, and a name of another kind are not."""
    import mmap

    nonce = secrets.token_hex(4)
    orphan, mapped, opened = (shm_file(f"psm_{nonce}{i}") for i in range(3))
    semaphore, other = shm_file(f"sem.mp-{nonce}"), shm_file(f"sem.x{nonce}")
    cleanup_names.extend([orphan, mapped, opened, semaphore, other])
    with open(mapped, "r+b") as held_file, open(opened, "rb"):
        view = mmap.mmap(held_file.fileno(), 64)
        try:
            removed = remove_orphaned_shared_memory({p.name for p in (orphan, mapped, opened, semaphore, other)})
        finally:
            view.close()
    assert removed == sorted([orphan.name, semaphore.name]) and not orphan.exists() and not semaphore.exists()
    assert mapped.exists() and opened.exists() and other.exists()


@pytest.mark.vllm
def test_segments_carry_the_run_tag_and_are_released(tmp_path, cleanup_names):
    import torch.distributed as dist
    from vllm.distributed.device_communicators.cpu_communicator import _CPUSHMDistributed

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1,
                            timeout=timedelta(seconds=30))
    try:
        ident = os.environ.get("VLLM_DIST_IDENT")  # an engine created earlier in this process may have set it
        first, second = EngineSegments(1), EngineSegments(1)
        assert first.tag.startswith(f"meshrl-{os.getpid()}-") and first.tag != second.tag
        with first.naming():
            ring = shared_memory.SharedMemory(create=True, size=64)  # as vLLM's message queues create theirs
            group = _CPUSHMDistributed.make_group_name(SimpleNamespace(unique_name="tp:0", ranks=[0, 1]))
        assert os.environ.get("VLLM_DIST_IDENT") == ident  # restored
        cpu_segment = shm_file(f"{group}_0")  # what vLLM's C++ SHMManager creates from the group name
        cleanup_names.extend([cpu_segment, SHM_DIR / ring.name])
        assert ring.name.startswith(f"{first.tag}-") and group.startswith(f"{first.tag}-tp:0-")
        assert segments(first.tag) == sorted([cpu_segment.name, ring.name])

        first.release(started=True)

        assert segments(first.tag) == []
        ring.unlink()  # vLLM unlinks its rings again when it destroys its groups: must not raise
        ring.close()
    finally:
        dist.destroy_process_group()


def launch(out: Path, end: str) -> list[subprocess.Popen]:
    out.mkdir(parents=True)
    env = {**os.environ, "PYTHONPATH": str(RANK.parents[2])}
    return [subprocess.Popen([sys.executable, str(RANK), "--rank", str(rank), "--out", str(out), "--end", end],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for rank in range(2)]


def finish(ranks: list[subprocess.Popen]) -> list[str]:
    """Each rank's stderr, once all have ended (killed after a timeout)."""
    errors = []
    for proc in ranks:
        try:
            errors.append(proc.communicate(timeout=400)[1])
        except subprocess.TimeoutExpired:
            for other in ranks:
                other.kill()
            raise
    return errors


def records(out: Path, stderr: list[str]) -> list[dict]:
    written = sorted(out.glob("rank*.json"))
    assert len(written) == 2, "\n".join(text[-3000:] for text in stderr)
    return [json.loads(path.read_text()) for path in written]


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    """Two TP-2 runs at once on this machine, started after a dead run's name was left in /dev/shm."""
    base = tmp_path_factory.mktemp("shm")
    stale = shm_file(f"meshrl-{reaped_child()}-{secrets.token_hex(4)}-tp:0-[0-1]-cpushm_1")
    try:
        shut, killed = launch(base / "shutdown", "shutdown"), launch(base / "kill", "kill")
        shut_err, killed_err = finish(shut), finish(killed)
        yield SimpleNamespace(
            shut=records(base / "shutdown", shut_err), killed=records(base / "kill", killed_err),
            shut_err=shut_err, shut_rc=[p.returncode for p in shut], killed_rc=[p.returncode for p in killed],
            stale=stale)
    finally:
        stale.unlink(missing_ok=True)


@pytest.mark.vllm
@pytest.mark.multiproc
@pytest.mark.timeout(900)
def test_two_tp2_runs_at_once_both_generate(two_runs):
    assert two_runs.shut_rc == [0, 0], two_runs.shut_err
    assert two_runs.killed_rc == [-9, -9]
    tokens = [r["tokens"] for r in two_runs.shut + two_runs.killed]
    assert all(t == tokens[0] for t in tokens) and all(len(row) == 6 for row in tokens[0])
    (shut_tag,), (killed_tag,) = {r["tag"] for r in two_runs.shut}, {r["tag"] for r in two_runs.killed}
    assert shut_tag != killed_tag
    assert shut_tag.startswith(f"meshrl-{two_runs.shut[0]['pid']}-")  # rank 0 leads the replica


@pytest.mark.vllm
@pytest.mark.multiproc
@pytest.mark.timeout(900)
def test_nothing_is_left_after_start_shutdown_or_kill(two_runs):
    for record in two_runs.shut + two_runs.killed:
        assert record["after_start"] == []
        assert segments(record["tag"]) == []
    assert all(r["after_shutdown"] == [] for r in two_runs.shut)
    assert not any(warning in text for text in two_runs.shut_err for warning in LEAK_WARNINGS), two_runs.shut_err


@pytest.mark.vllm
@pytest.mark.multiproc
@pytest.mark.timeout(900)
def test_a_dead_runs_name_is_removed_by_the_next_start(two_runs):
    assert two_runs.shut_rc == [0, 0] and not two_runs.stale.exists()


@pytest.mark.vllm
@pytest.mark.multiproc
@pytest.mark.timeout(600)
def test_ranks_killed_while_starting_leave_names_the_cleanup_removes(tmp_path):
    ranks = launch(tmp_path / "run", "kill-while-starting")
    stderr = finish(ranks)
    assert [p.returncode for p in ranks] == [-9, -9], stderr
    at_death = records(tmp_path / "run", stderr)
    assert all(r["started"] for r in at_death)
    left = at_death[0]["names"]  # what the killed ranks left (a stale check of another run may remove it first)
    assert at_death[0]["tag"].startswith(f"meshrl-{ranks[0].pid}-")
    assert any("-psm_" in n for n in left), left  # the message-queue rings, on every CPU
    cpu_shm = sorted(name[-1] for name in left if "-cpushm_" in name)  # only vLLM's AVX-512 kernels create them
    assert cpu_shm == (["0", "1"] if at_death[0]["cpu_shm"] else []), left

    remove_stale_segments()

    assert not [name for name in left if (SHM_DIR / name).exists()]
