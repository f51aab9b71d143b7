"""Names and removal of the shared-memory segments a colocated vLLM engine creates (``/dev/shm``).

What vLLM 0.32 creates while a colocated engine starts, and why it leaked and collided:

- the CPU backend's TP/PP communicator (``vllm/distributed/device_communicators/cpu_communicator.py``,
  C++ ``SHMManager``, in vLLM's AVX-512 kernels only; on a CPU without AVX-512 the group talks through
  torch.distributed and creates none): one segment per rank, ``{ident}-{group}-[{ranks}]-cpushm_{rank}``,
  created with ``O_EXCL``. ``ident`` comes from ``VLLM_DIST_IDENT``, which vLLM's CPU worker sets from the
  distributed init method: always ``env://`` with the external launcher, so every run on a machine
  used the same names (``-tp:0-[0-1]-cpushm_0``, the leading slashes dropped by ``shm_open``). They are
  unlinked only by the C++ destructor of a process-wide singleton, which a killed or ``os._exit``-ed
  process never runs: the next run's ``O_EXCL`` create then fails with ``errno: 17``.
- message-queue rings of the groups (``shm_broadcast.ShmRingBuffer``, the same-node probe, the tensor
  arena): ``multiprocessing.shared_memory`` segments ``psm_<random>``, unlinked when vLLM destroys its
  groups, which a killed process never does.

What this module makes of them (``EngineSegments``, used by ``meshrl.rollout.vllm_engine``):

- **Per-run names.** While the engine is built, every segment is named ``meshrl-<pid>-<nonce>-...``:
  the CPU communicator's identifier is replaced through ``_CPUSHMDistributed.make_group_name`` (the one
  place vLLM composes the name; ``VLLM_DIST_IDENT`` itself is overwritten by the worker just before),
  and ``multiprocessing.shared_memory.SharedMemory`` is swapped for a subclass that names new segments
  with the tag. ``<pid>`` and ``<nonce>`` are the replica leader's (the first rank of the inference-TP
  group, on the same machine as the segments): the ranks of a replica must agree on the names, runs
  and replicas must not.
- **Unlinked as soon as the engine has started.** Peers open each other's segments by name only while
  the engine is built; after a barrier over the world every rank has, and the names are removed (the
  mappings, and the memory, live on until the processes end). From then on nothing is left behind
  however the process ends: a clean shutdown, an error, Ctrl-C, SIGTERM or ``kill -9``. A failed start
  removes its names at once.
- **Stale names.** A process killed while its engine starts leaves its names. ``remove_stale_segments``
  unlinks the names whose ``<pid>`` is no longer a live process on this machine; every colocated
  engine runs it before it starts, and the training driver on its way out. A name whose pid is alive is
  kept: removing a name never disturbs a process that has the segment mapped, but a run still starting
  needs its names.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
from multiprocessing import resource_tracker, shared_memory
from typing import Iterator
from unittest import mock

import psutil
import torch.distributed as dist

from meshrl.runtime import SHM_DIR, shm_names

_TAGGED = re.compile(r"meshrl-(\d+)-[0-9a-f]{8}-")


def new_tag() -> str:
    """A name prefix no other run or replica uses: ``meshrl-<this pid>-<8 random hex digits>``."""
    return f"meshrl-{os.getpid()}-{secrets.token_hex(4)}"


def segments(tag: str) -> list[str]:
    """The names under ``/dev/shm`` that carry ``tag``."""
    return sorted(name for name in shm_names() if name.startswith(f"{tag}-"))


def remove_stale_segments() -> list[str]:
    """Unlink every meshrl-named segment whose owning pid is not a live process here; returns their names.

    Another user's segments are skipped (``/dev/shm`` is sticky): their names are per run too, so they
    cannot collide with this user's."""
    removed = []
    for name in sorted(shm_names()):
        match = _TAGGED.match(name)
        if match and not psutil.pid_exists(int(match[1])):
            with contextlib.suppress(PermissionError):
                if _unlink(name):
                    removed.append(name)
    return removed


class EngineSegments:
    """The segments of one colocated engine; see the module docstring.

    Collective over the default process group, like the engine's start: every rank constructs it, runs the
    engine's construction inside ``naming()`` and calls ``release`` when the construction ended.
    """

    def __init__(self, tensor_parallel: int) -> None:
        remove_stale_segments()
        tags: list[str | None] = [None] * dist.get_world_size()
        dist.all_gather_object(tags, new_tag())
        rank = dist.get_rank()
        self.tag: str = tags[rank - rank % tensor_parallel]  # the replica leader's
        self._created: list[shared_memory.SharedMemory] = []

    @contextlib.contextmanager
    def naming(self) -> Iterator[None]:
        """While active, the segments vLLM creates in this process carry ``self.tag``."""
        from vllm.distributed.device_communicators.cpu_communicator import _CPUSHMDistributed

        vllm_group_name = _CPUSHMDistributed.make_group_name
        tag = self.tag

        def group_name(communicator) -> str:
            os.environ["VLLM_DIST_IDENT"] = tag
            return vllm_group_name(communicator)

        saved_ident = os.environ.get("VLLM_DIST_IDENT")
        try:
            with mock.patch.object(_CPUSHMDistributed, "make_group_name", staticmethod(group_name)), \
                    mock.patch.object(shared_memory, "SharedMemory", _tagged_shared_memory(tag, self._created)):
                yield
        finally:
            if saved_ident is None:
                os.environ.pop("VLLM_DIST_IDENT", None)
            else:
                os.environ["VLLM_DIST_IDENT"] = saved_ident

    def release(self, *, started: bool) -> None:
        """Unlink the names of this engine's segments.

        ``started``: the construction succeeded on this rank; then it waits at a barrier over the world until
        every rank's has (peers open each other's segments by name while they start). After a failed start it
        does not wait: the peers' start fails too, their names go at once."""
        if started:
            dist.barrier()
        for segment in self._created:  # through the object, which also drops it from Python's resource tracker
            segment.unlink()
        for name in segments(self.tag):  # the CPU communicator's, which no Python object owns
            _unlink(name)


def _tagged_shared_memory(tag: str, created: list) -> type[shared_memory.SharedMemory]:
    """A ``SharedMemory`` whose new segments are named ``{tag}-psm_<hex>`` and recorded in ``created``."""

    class RunSharedMemory(shared_memory.SharedMemory):
        _unlinked = False

        def __init__(self, name: str | None = None, create: bool = False, size: int = 0) -> None:
            if create and name is None:
                name = f"{tag}-psm_{secrets.token_hex(4)}"
            super().__init__(name, create, size)
            if create:
                created.append(self)

        def unlink(self) -> None:
            # Called by EngineSegments.release after the start, and again by vLLM when it destroys its
            # groups: only the first call unlinks. A peer of the replica may have removed the name first.
            if self._unlinked:
                return
            self._unlinked = True
            try:
                super().unlink()
            except FileNotFoundError:
                resource_tracker.unregister(self._name, "shared_memory")

    return RunSharedMemory


def _unlink(name: str) -> bool:
    """Remove ``/dev/shm/name``; False when it was already gone (a peer of the replica removed it first)."""
    try:
        os.unlink(SHM_DIR / name)
    except FileNotFoundError:
        return False
    return True
