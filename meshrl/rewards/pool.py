"""Reward scoring for a batch in worker processes, with a per-call wall-clock timeout.

Contract of :meth:`RewardPool.score`: every response gets a float score. A call that raises, returns
something that is not a number (or a dict with a numeric ``"score"``), crashes its worker, or runs
past ``timeout_s`` scores 0.0 and is counted (``reward/num_errors``, ``reward/num_timeouts``). A score
that is NaN, infinite, or beyond float32's range (the trainer holds scores in float32: 1e39 would
become inf there) is handled by ``on_nonfinite_score`` (``reward_model.on_nonfinite_score``): ``skip``
scores it 0.0, counts it (``reward/num_nonfinite``) and warns naming the function and the value;
``stop`` raises :class:`RewardError` with the same details. A pool whose calls all fail for
``max_failed_batches`` batches in a row (``reward_model.max_failed_batches``) raises
:class:`RewardError`: training on all-zero scores teaches nothing and would exit as if it had worked.
A call that returns a dict whose ``reward_error`` entry names a reason (code rewards: a program that timed
out, crashed or was killed; :mod:`meshrl.rewards.code`) has a score like any other, and is counted per
batch as ``reward/errors/<reason>``.

Code rewards: with ``spec.sandbox`` set, one semaphore of ``sandbox.max_concurrent`` slots, shared by the
workers, bounds the programs in flight at the sandbox (verl's ``concurrent_semaphore``).

Why processes, and why the parent enforces the timeout: a reward function can hang in C code (a
catastrophic regex, a SymPy simplification) where no Python-level signal handler runs, and
math-verify already uses ``signal.alarm`` for its own timeouts (re-arming and then cancelling the one
process-wide alarm, which would silently disarm any outer alarm). So the parent gives each worker a
deadline per call and kills the worker (then starts a fresh one) when it is missed. Workers are
spawned (not forked: the trainer process holds torch threads), and math-verify's signal-based
timeouts work there because each call runs in the worker's main thread.

An ``async def`` reward function (verl's recommended form for calls to a model or a service, e.g. a judge:
``meshrl.rewards.judge``) runs each chunk's calls concurrently in the worker's event loop, each cut at
``timeout_s`` there (the worker survives; the parent's deadline keeps a grace of ``ASYNC_GRACE_S`` for a worker
stuck in blocking code), and a worker gets one chunk per batch so that the whole batch is in flight.

Every batch goes to the workers, however small, so that the timeout holds for every batch: a warm
pool answers a batch of 4 GSM8K responses in ~0.2 ms and one of 32 in ~1 ms (inline: 0.01 / 0.09 ms),
nothing beside an RL step's seconds. With ``num_workers=0`` everything is scored in the calling
process, where a hanging call cannot be interrupted (one that returns after ``timeout_s`` still scores
0.0 and counts as a timeout).

Workers are started with ``spawn``, which re-imports the main module: entry-point scripts must keep
their top level behind ``if __name__ == "__main__":``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import logging
import math
import multiprocessing
import os
import signal
import time
import weakref
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

from meshrl.config.schema import NONFINITE_ACTIONS
from meshrl.rewards.code import ERROR_KEY
from meshrl.rewards.dispatch import RewardFn, RewardSpec

logger = logging.getLogger(__name__)

# The largest float32: the trainer's score tensors are float32, and a float64 score beyond it becomes inf.
FLOAT32_MAX = 3.4028234663852886e38

_Item = tuple[int, str, str, str, Mapping[str, Any] | None]
_Outcome = tuple[str, Any]  # ("ok", (score, extras)) | ("err", message) | ("nonfinite", score) | ("timeout", None)
ASYNC_GRACE_S = 5.0


def normalize_reward_output(out: Any) -> tuple[float, dict[str, Any]]:
    """``(score, extras)`` from a reward function's return value (a number, or a dict with "score").

    Raises:
        TypeError: not a number nor a dict with a numeric "score".
        NonFiniteScore: the score is NaN, infinite, or beyond float32's range.
    """
    extras: dict[str, Any] = {}
    if isinstance(out, Mapping):
        if "score" not in out:
            raise TypeError(f"reward function returned a dict without a 'score' key: keys {sorted(out)}")
        extras = {k: v for k, v in out.items() if k != "score"}
        out = out["score"]
    if not isinstance(out, (int, float)) and not hasattr(out, "__float__"):
        raise TypeError(f"reward function returned {type(out).__name__}; expected a number or a dict with 'score'")
    score = float(out)
    if not abs(score) <= FLOAT32_MAX:
        raise NonFiniteScore(score)
    return score, extras


class NonFiniteScore(ValueError):
    """A reward function returned NaN, an infinity, or a number float32 cannot hold."""

    def __init__(self, score: float) -> None:
        self.score = score
        beyond = " (beyond float32, where the trainer holds scores)" if math.isfinite(score) else ""
        super().__init__(f"reward function returned a non-finite score {score!r}{beyond}")


class RewardError(RuntimeError):
    """The reward stops the run: a non-finite score under ``on_nonfinite_score="stop"``, or
    ``max_failed_batches`` batches in a row in which no call succeeded. The message names the function."""


def _outcome(call) -> _Outcome:
    """The outcome of one reward call (``call()``: the function's return value)."""
    try:
        return "ok", normalize_reward_output(call())
    except NonFiniteScore as e:
        return "nonfinite", e.score
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # math-verify's TimeoutException derives from BaseException
        return "err", f"{type(e).__name__}: {e}"


def score_items(fn: RewardFn, items: Sequence[_Item], timeout_s: float, send) -> None:
    """Score ``items`` with ``fn``, calling ``send(index, outcome)`` for each in input order. A synchronous ``fn``
    runs one call after another (whoever calls this enforces the time limit); an ``async def`` one runs all calls
    at once in one event loop, each cut at ``timeout_s`` (outcome ``("timeout", None)``)."""
    if not inspect.iscoroutinefunction(fn):
        for index, *args in items:
            send(index, _outcome(lambda: fn(*args)))
        return

    async def one(args) -> _Outcome:
        try:
            value = await asyncio.wait_for(fn(*args), timeout_s)
        except asyncio.TimeoutError:
            return "timeout", None
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:
            return "err", f"{type(e).__name__}: {e}"
        return _outcome(lambda: value)

    async def all_items() -> None:
        tasks = [asyncio.ensure_future(one(args)) for _, *args in items]
        for (index, *_), task in zip(items, tasks):
            send(index, await task)

    asyncio.run(all_items())


def _worker_main(conn: Connection, spec: RewardSpec, concurrency, timeout_s: float) -> None:
    """Worker loop: build the reward function once, then score chunks, answering item by item."""
    # A terminal's Ctrl-C reaches the whole process group; the driver closes the pool itself, and a
    # traceback from each worker would bury its one "interrupted" line.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Imported before "ready" so that the first call's timeout is not spent importing SymPy.
    import math_verify  # noqa: F401

    fn = spec.build(concurrency)
    conn.send(("ready",))
    while True:
        chunk = conn.recv()
        if chunk is None:
            return
        score_items(fn, chunk, timeout_s, functools.partial(_answer, conn))


def _answer(conn: Connection, index: int, outcome: _Outcome) -> None:
    try:
        conn.send((outcome[0], index, outcome[1]))
    except Exception as e:  # unpicklable extras
        conn.send(("err", index, f"reward output cannot be sent back: {type(e).__name__}: {e}"))


@dataclass
class _Worker:
    process: multiprocessing.process.BaseProcess
    conn: Connection
    ready: bool = False
    chunk: list[_Item] = field(default_factory=list)
    position: int = 0
    deadline: float = math.inf


@dataclass
class RewardBatch:
    """Scores of one batch (in input order), per-sample extra outputs, and metrics."""

    scores: list[float]
    extras: dict[str, list[Any]]
    metrics: dict[str, float]


class RewardPool:
    """Scores ``(data_source, solution, ground_truth, extra_info)`` batches with :class:`RewardSpec`'s function.

    Args:
        spec: which reward function (built once here to fail fast on a bad custom file, and once per worker).
        num_workers: worker processes (default: usable cores, at most 8); 0 scores everything in this
            process, where ``timeout_s`` cannot interrupt a call.
        timeout_s: wall-clock limit per call.
        chunk_size: items sent to a worker per message (default: about 4 chunks per worker, at most 256).
        on_nonfinite_score: ``skip`` or ``stop`` (module docstring).
        max_failed_batches: raise after this many batches in a row with no successful call; 0 never does.
    """

    def __init__(
        self,
        spec: RewardSpec | None = None,
        *,
        num_workers: int | None = None,
        timeout_s: float = 10.0,
        chunk_size: int | None = None,
        on_nonfinite_score: str = "skip",
        max_failed_batches: int = 3,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"reward timeout_s must be > 0, got {timeout_s}")
        if on_nonfinite_score not in NONFINITE_ACTIONS:
            raise ValueError(f"on_nonfinite_score {on_nonfinite_score!r} is not one of {NONFINITE_ACTIONS}")
        if max_failed_batches < 0:
            raise ValueError(f"max_failed_batches must be >= 0, got {max_failed_batches}")
        self.spec = spec or RewardSpec()
        self._ctx = multiprocessing.get_context("spawn")
        # Passed to each worker at its start (a semaphore crosses processes only by inheritance).
        self._concurrency = self._ctx.BoundedSemaphore(self.spec.sandbox.max_concurrent) if self.spec.sandbox else None
        self._fn: RewardFn = self.spec.build(self._concurrency)
        self._async = inspect.iscoroutinefunction(self._fn)
        self.num_workers = min(8, len(os.sched_getaffinity(0))) if num_workers is None else num_workers
        if self.num_workers < 0:
            raise ValueError(f"reward num_workers must be >= 0, got {num_workers}")
        if self.num_workers == 0:
            logger.warning("reward num_workers=0: rewards run in the trainer process, where the %.1f s timeout "
                           "cannot interrupt a hanging call", timeout_s)
        self.timeout_s = timeout_s
        self.chunk_size = chunk_size
        self.on_nonfinite_score = on_nonfinite_score
        self.max_failed_batches = max_failed_batches
        self.failed_batches = 0  # batches in a row in which no call succeeded
        self.totals: dict[str, float] = {"num_scored": 0, "num_errors": 0, "num_timeouts": 0, "num_nonfinite": 0,
                                         "num_worker_restarts": 0}
        self._workers: list[_Worker] = [self._spawn() for _ in range(self.num_workers)]
        self._finalizer = weakref.finalize(self, RewardPool._shutdown, self._workers)

    # ------------------------------------------------------------------ lifecycle
    def _spawn(self) -> _Worker:
        parent, child = self._ctx.Pipe(duplex=True)
        process = self._ctx.Process(target=_worker_main, args=(child, self.spec, self._concurrency, self.timeout_s),
                                    daemon=True, name="meshrl-reward")
        process.start()
        child.close()
        return _Worker(process, parent)

    @staticmethod
    def _shutdown(workers: list[_Worker]) -> None:
        for w in workers:
            with contextlib.suppress(OSError):  # the worker may already be gone
                w.conn.send(None)
        for w in workers:
            w.process.join(timeout=2)
            if w.process.is_alive():
                w.process.kill()
                w.process.join()
            w.conn.close()
        workers.clear()

    def close(self) -> None:
        """Stop the worker processes (also done at garbage collection / interpreter exit)."""
        self._finalizer()

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ scoring
    def score(
        self,
        data_sources: Sequence[str],
        solutions: Sequence[str],
        ground_truths: Sequence[str],
        extra_infos: Sequence[Mapping[str, Any] | None] | None = None,
    ) -> RewardBatch:
        """Score a batch; see the module docstring for the failure contract."""
        n = len(solutions)
        if not (len(data_sources) == len(ground_truths) == n) or (extra_infos is not None and len(extra_infos) != n):
            raise ValueError(
                f"reward batch fields differ in length: {len(data_sources)} data_sources, {n} solutions, "
                f"{len(ground_truths)} ground_truths" + (f", {len(extra_infos)} extra_infos" if extra_infos else "")
            )
        items: list[_Item] = [
            (i, data_sources[i], solutions[i], ground_truths[i], extra_infos[i] if extra_infos is not None else None)
            for i in range(n)
        ]
        outcomes: list[tuple[str, Any]] = [("err", "not scored")] * n
        start = time.perf_counter()
        pooled = self.num_workers > 0
        if pooled:
            self._score_pooled(items, outcomes)
        else:
            self._score_inline(items, outcomes)
        return self._collect(outcomes, data_sources, pooled, time.perf_counter() - start)

    def _score_inline(self, items: list[_Item], outcomes: list[tuple[str, Any]]) -> None:
        last = time.perf_counter()

        def record(index: int, outcome: _Outcome) -> None:
            nonlocal last
            now = time.perf_counter()
            # a synchronous call that returned after the limit (nothing could cut it) counts as timed out
            late = not self._async and outcome[0] == "ok" and now - last > self.timeout_s
            outcomes[index] = ("timeout", None) if late else outcome
            last = now

        score_items(self._fn, items, self.timeout_s, record)

    def _score_pooled(self, items: list[_Item], outcomes: list[tuple[str, Any]]) -> None:
        # an async function's calls run concurrently within a chunk: one chunk per worker keeps all in flight
        spread = self.num_workers if self._async else 4 * self.num_workers
        size = self.chunk_size or max(1, min(256, math.ceil(len(items) / spread)))
        limit = self.timeout_s + (ASYNC_GRACE_S if self._async else 0.0)
        pending: deque[list[_Item]] = deque(items[i : i + size] for i in range(0, len(items), size))
        failed_starts = 0
        while pending or any(w.chunk for w in self._workers):
            now = time.perf_counter()
            for w in self._workers:
                if w.ready and not w.chunk and pending:
                    w.chunk, w.position, w.deadline = pending.popleft(), 0, now + limit
                    w.conn.send(w.chunk)
            deadline = min((w.deadline for w in self._workers if w.chunk), default=now + 1.0)
            readable = wait([w.conn for w in self._workers], timeout=max(0.0, deadline - now))
            for slot, w in enumerate(list(self._workers)):
                if w.conn not in readable:
                    continue
                try:
                    message = w.conn.recv()
                except (EOFError, OSError):
                    failed_starts = failed_starts + 1 if not w.ready else 0
                    if failed_starts > 3:
                        raise RuntimeError(
                            f"reward worker processes exit during start-up (exit code {w.process.exitcode}); "
                            f"check that {self.spec} can be built in a fresh process"
                        ) from None
                    self._replace(slot, pending, outcomes, ("err", "reward worker process died"))
                    continue
                if message[0] == "ready":
                    w.ready = True
                    continue
                kind, index, payload = message
                outcomes[index] = (kind, payload)
                w.position += 1
                w.deadline = time.perf_counter() + limit
                if w.position == len(w.chunk):
                    w.chunk, w.deadline = [], math.inf
            now = time.perf_counter()
            for slot, w in enumerate(list(self._workers)):
                if w.chunk and now > w.deadline:
                    self._replace(slot, pending, outcomes, ("timeout", None))

    def _replace(
        self, slot: int, pending: deque[list[_Item]], outcomes: list[tuple[str, Any]], outcome: tuple[str, Any]
    ) -> None:
        """Kill worker ``slot``; its current item gets ``outcome``, the rest of its chunk is re-queued."""
        w = self._workers[slot]
        if w.chunk:
            outcomes[w.chunk[w.position][0]] = outcome
            rest = w.chunk[w.position + 1 :]
            if rest:
                pending.appendleft(rest)
        w.process.kill()
        w.process.join()
        w.conn.close()
        self._workers[slot] = self._spawn()
        self.totals["num_worker_restarts"] += 1

    def _collect(self, outcomes: list[tuple[str, Any]], data_sources: Sequence[str], pooled: bool,
                 seconds: float) -> RewardBatch:
        scores: list[float] = []
        extras: dict[str, list[Any]] = {}
        errors: list[str] = []
        nonfinite: list[int] = []
        timeouts = 0
        for i, (kind, payload) in enumerate(outcomes):
            if kind == "ok":
                score, extra = payload
                for key, value in extra.items():
                    extras.setdefault(key, [None] * len(outcomes))[i] = value
            else:
                score = 0.0
                timeouts += kind == "timeout"
                if kind == "err":
                    errors.append(payload)
                elif kind == "nonfinite":
                    nonfinite.append(i)
            scores.append(score)
        function = self.spec.label
        if nonfinite:
            first = nonfinite[0]
            what = (f"{function} returned {outcomes[first][1]!r} for response {first} of the batch (data_source "
                    f"{data_sources[first]!r}), which is NaN, infinite or beyond float32 (max {FLOAT32_MAX:.4g}, "
                    f"where the trainer holds scores); {len(nonfinite)} such score(s) in this batch")
            if self.on_nonfinite_score == "stop":
                raise RewardError(f"{what}. reward_model.on_nonfinite_score=stop ends the run; set it to skip to "
                                  "score them 0 and count them (reward/num_nonfinite)")
            logger.warning("%s: scored 0 (reward_model.on_nonfinite_score=skip)", what)
        if errors:
            logger.warning("%s: %d reward call(s) failed and scored 0; first: %s", function, len(errors), errors[0])
        if timeouts:
            logger.warning("%s: %d reward call(s) ran past %.1f s and scored 0", function, timeouts, self.timeout_s)
        metrics: dict[str, float] = {
            "reward/num_errors": float(len(errors)),
            "reward/num_timeouts": float(timeouts),
            "reward/num_nonfinite": float(len(nonfinite)),
            "reward/seconds": seconds,
            "reward/pooled": float(pooled),
        }
        for reason in filter(None, extras.get(ERROR_KEY, ())):
            metrics[f"reward/errors/{reason}"] = metrics.get(f"reward/errors/{reason}", 0.0) + 1.0
        for key, values in extras.items():
            present = [v for v in values if v is not None]
            if present and all(isinstance(v, bool) for v in present):
                metrics[f"reward/num_{key}"] = float(sum(present))
            elif present and all(isinstance(v, (int, float)) for v in present):
                metrics[f"reward/{key}/mean"] = float(sum(present) / len(present))
        self.totals["num_scored"] += len(outcomes)
        self.totals["num_errors"] += len(errors)
        self.totals["num_timeouts"] += timeouts
        self.totals["num_nonfinite"] += len(nonfinite)
        self._count_failed_batch(failed=bool(outcomes) and len(errors) + timeouts + len(nonfinite) == len(outcomes),
                                 errors=errors, timeouts=timeouts, nonfinite=len(nonfinite))
        return RewardBatch(scores, extras, metrics)

    def _count_failed_batch(self, failed: bool, errors: list[str], timeouts: int, nonfinite: int) -> None:
        """Track batches in a row with no successful call; raise ``RewardError`` at ``max_failed_batches``."""
        self.failed_batches = self.failed_batches + 1 if failed else 0
        if not self.max_failed_batches or self.failed_batches < self.max_failed_batches:
            return
        first = f"; its first error: {errors[0]}" if errors else ""
        raise RewardError(
            f"{self.spec.label} failed on every response of {self.failed_batches} batches in a row "
            f"(reward_model.max_failed_batches={self.max_failed_batches}); in the last one {len(errors)} raised, "
            f"{timeouts} ran past {self.timeout_s:.1f} s and {nonfinite} returned a non-finite score{first}. "
            "Training on all-zero scores teaches nothing: fix the reward function (or raise "
            "reward_model.max_failed_batches; 0 never stops)")
