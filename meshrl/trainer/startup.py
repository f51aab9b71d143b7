"""Where a run's time to its first step goes: the driver's phases (config checks, data, Ray, the workers), each
worker group's own start (the groups start together: ``meshrl.trainer.worker_start``) and, inside it, its rank 0's
phases (imports, models, engine).

A run prints them in one line once its workers are ready (``meshrl: ready in 31.2 s (...)``) and logs them with its
first training step as ``startup/<phase>_s``, with ``startup/first_step_s``: from the start of the process (the
command; for ``meshrl.trainer.main.run`` called in a process that was already running, from that call) to the end of
that step. The plot leaves them out: they are one number per run, not curves.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator

PREFIX = "startup/"


def process_age_s() -> float:
    """Seconds since this process started (its interpreter's start, before any import)."""
    import psutil

    return max(0.0, time.time() - psutil.Process().create_time())


class StartupClock:
    """Phases measured from an origin: ``origin_age_s`` seconds before the clock was made (0: now)."""

    def __init__(self, origin_age_s: float = 0.0) -> None:
        self._origin = time.monotonic() - origin_age_s
        self.phases: dict[str, float] = {}
        # each group's own start, within the "workers" phase: {"actor_rollout_ref": 17.5, "critic": 8.1}
        self.groups: dict[str, float] = {}
        # a group's phases inside its start, by group: {"actor_rollout_ref": {"imports": 7.1, ...}}
        self.inside: dict[str, dict[str, float]] = {}
        self.kept: set[str] = set()  # groups an earlier run of the process left running (meshrl.workers.pool)
        if origin_age_s:  # the interpreter and the imports before the clock existed
            self.phases["python"] = origin_age_s

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the block as ``name`` (added to an earlier block of that name)."""
        started = time.monotonic()
        try:
            yield
        finally:
            self.phases[name] = self.phases.get(name, 0.0) + time.monotonic() - started

    def group_started(self, group: str, seconds: float, inner: dict[str, float], kept: bool = False) -> None:
        """``group`` took ``seconds`` to start (beside the other groups, within the ``workers`` phase); ``inner``: the
        phases its rank 0 reported from inside that start, the rest of which is ``start``: placing the workers,
        starting their processes, importing the role; ``kept``: its processes were an earlier run's."""
        self.groups[group] = seconds
        if kept:
            self.kept.add(group)
        if inner:
            self.inside[group] = {"start": max(0.0, seconds - sum(inner.values())), **inner}

    def elapsed_s(self) -> float:
        return time.monotonic() - self._origin

    def line(self) -> str:
        """``ready in T s (phase t; ...; workers t [group t: inner t, ...; group t])``."""
        groups = "; ".join(self._group_text(group) for group in self.groups)
        parts = [f"{name} {seconds:.1f}" + (f" [{groups}]" if name == "workers" and groups else "")
                 for name, seconds in self.phases.items()]
        return f"ready in {self.elapsed_s():.1f} s ({'; '.join(parts)})"

    def _group_text(self, group: str) -> str:
        inner = self.inside.get(group, {})
        label = f"{group} (kept workers)" if group in self.kept else group
        return f"{label} {self.groups[group]:.1f}" + (": " + ", ".join(f"{k} {v:.1f}" for k, v in inner.items())
                                                      if inner else "")

    def metrics(self) -> dict[str, float]:
        """``startup/<phase>_s`` for every phase and group (``startup/<group>_s``) and group-inner phase
        (``startup/<group>/<phase>_s``)."""
        out = {f"{PREFIX}{name}_s": seconds for name, seconds in {**self.phases, **self.groups}.items()}
        for group, inner in self.inside.items():
            out.update({f"{PREFIX}{group}/{name}_s": seconds for name, seconds in inner.items()})
        return out
