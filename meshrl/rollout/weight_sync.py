"""Weight sync: stream the trainer's weights into a running engine, in place, in bounded buckets.

The trainer side yields ``(hf_name, full_tensor)`` one tensor at a time
(``meshrl.parallel.hf_conversion.iter_hf_weights``: Megatron -> HF names, TP-gathered,
PP-broadcast, fused QKV / gate-up split; or an HF model's ``named_parameters()``).
``sync_weights`` packs them into buckets of at most ``bucket_bytes`` (a tensor larger than a bucket
travels alone), hands each bucket to the engine, and closes the update (the engine re-processes the
layers it received and resets its prefix cache, whose KV entries were computed with the old weights).

Memory: the sync layer holds one bucket at a time, so the extra memory of a sync is about one bucket
(or the largest tensor) plus what the engine buffers for a layer whose tensors straddle two buckets,
not a copy of the model. ``LiveBytesMeter`` measures exactly that for any stream.

Validation and failure: every tensor is checked against ``engine.expected_weights()`` (name, shape,
floating dtype, sent once) *before* it enters a bucket, so the engine never sees an invalid tensor
(vLLM cannot survive one: its layer-wise reload would be left half done). A bad tensor raises
``WeightSyncError`` naming it, and the trainer's tensors are never modified. If the bad tensor comes
before the first bucket was sent, the engine still holds its previous weights, untouched. If buckets
were already loaded, the engine closes the update cleanly (it keeps serving; its untouched layers
keep their old values) but marks its weights incomplete: ``generate`` then refuses to run until a
full sync succeeds, because a mix of old and new layers is a policy nobody trained. A stream that
ends without every expected tensor is a failure of the same kind.

Colocation: ``colocated_rollout`` is the single place where memory changes hands between trainer and
engine around generation (slime scatters these calls over its loop).
"""

from __future__ import annotations

import difflib
import threading
import time
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Mapping, Protocol, Sequence

import torch

WeightStream = Iterable[tuple[str, torch.Tensor]]


class WeightReceiver(Protocol):
    """What the sync asks of an engine (``meshrl.rollout.base.RolloutEngine`` implements it): the weights
    it expects, an update in buckets, and the memory hand-off around generation."""

    def expected_weights(self) -> Mapping[str, torch.Size]: ...
    def begin_weight_update(self) -> None: ...
    def load_weight_bucket(self, bucket: Sequence[tuple[str, torch.Tensor]]) -> None: ...
    def finish_weight_update(self, complete: bool, reason: str = "") -> None: ...
    def load_weights(self, weights: WeightStream, *, bucket_bytes: int | None = None) -> "SyncStats": ...
    def wake_up(self, tags: Sequence[str] | None = None) -> None: ...
    def sleep(self) -> None: ...


class WeightSyncError(ValueError):
    """A tensor of a weight stream does not fit the engine's model (or one is missing)."""


@dataclass
class SyncStats:
    """What one sync moved: tensors, bytes, buckets, the largest bucket, wall time."""

    tensors: int = 0
    bytes: int = 0
    buckets: int = 0
    largest_bucket_bytes: int = 0
    seconds: float = 0.0

    @property
    def bytes_per_second(self) -> float:
        return self.bytes / self.seconds if self.seconds > 0 else 0.0


def tensor_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def iter_buckets(weights: WeightStream, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group a stream into consecutive buckets of at most ``bucket_bytes`` (an oversize tensor alone).

    The caller must drop its reference to a bucket before asking for the next one, or two buckets
    are alive at once.
    """
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in weights:
        nbytes = tensor_bytes(tensor)
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
        del tensor  # the bucket holds it; a stale loop variable would pin a flushed tensor
    if bucket:
        yield bucket


def _validated(weights: WeightStream, expected: Mapping[str, torch.Size], seen: set[str]) -> WeightStream:
    for item in weights:
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
            raise WeightSyncError(f"a weight stream yields (hf_name, tensor) pairs, got {type(item).__name__}")
        name, tensor = item
        del item
        if not isinstance(tensor, torch.Tensor):
            raise WeightSyncError(f"tensor {name!r}: expected a torch.Tensor, got {type(tensor).__name__}")
        shape = expected.get(name)
        if shape is None:
            raise WeightSyncError(f"unexpected tensor {name!r}: the engine's model has no such weight"
                                  + _name_hint(name, expected))
        if name in seen:
            raise WeightSyncError(f"tensor {name!r} was sent twice in one sync")
        if tuple(tensor.shape) != tuple(shape):
            raise WeightSyncError(f"tensor {name!r} has shape {tuple(tensor.shape)}; the engine's model "
                                  f"needs {tuple(shape)} (trainer and engine configs disagree?)")
        if not tensor.is_floating_point():
            raise WeightSyncError(f"tensor {name!r} has dtype {tensor.dtype}; weights must be floating point")
        seen.add(name)
        yield name, tensor
        del tensor


def _name_hint(name: str, expected: Mapping[str, torch.Size]) -> str:
    if name.endswith("lm_head.weight") and any(n.endswith("embed_tokens.weight") for n in expected):
        return " (it ties lm_head to embed_tokens: do not send lm_head.weight)"
    close = difflib.get_close_matches(name, list(expected), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def sync_weights(engine: WeightReceiver, weights: WeightStream, *, bucket_bytes: int) -> SyncStats:
    """Load a full set of weights into ``engine`` in place; see the module docstring for guarantees.

    Raises ``WeightSyncError`` (bad, duplicate or missing tensor) or whatever the stream raises; in
    both cases after closing any update the engine had begun.
    """
    expected = engine.expected_weights()
    seen: set[str] = set()
    stats = SyncStats()
    started = False
    start = time.perf_counter()
    try:
        with torch.no_grad():
            for bucket in iter_buckets(_validated(weights, expected, seen), bucket_bytes):
                if not started:
                    engine.begin_weight_update()
                    started = True
                engine.load_weight_bucket(bucket)
                size = sum(tensor_bytes(t) for _, t in bucket)
                stats.tensors += len(bucket)
                stats.bytes += size
                stats.buckets += 1
                stats.largest_bucket_bytes = max(stats.largest_bucket_bytes, size)
                del bucket  # before the next bucket is filled
        missing = [name for name in expected if name not in seen]
        if missing:
            raise WeightSyncError(f"the weight stream ended without {len(missing)} of the engine's "
                                  f"{len(expected)} tensors, e.g. {missing[:4]}")
    except BaseException as error:
        if started:
            engine.finish_weight_update(complete=False, reason=f"a sync failed after loading {stats.tensors} "
                                                               f"tensors: {error}")
        raise
    if not started:  # a model without weights still needs its caches reset
        engine.begin_weight_update()
    engine.finish_weight_update(complete=True)
    stats.seconds = time.perf_counter() - start
    return stats


def hf_weight_manifest(model_path: str) -> dict[str, torch.Size]:
    """HF name -> shape of every parameter of the causal LM in ``model_path``, built on the meta device.

    These are the names an HF model's ``named_parameters()`` yields, so a tied ``lm_head`` is absent, and its
    persistent buffers (DeepSeek-V3's router ``e_score_correction_bias``, a parameter in vLLM), as its checkpoints
    hold them: transformers fuses a mixture-of-experts layer's experts in memory and writes (and vLLM loads) them
    per expert.
    """
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.core_model_loading import revert_weight_conversion

    config = AutoConfig.from_pretrained(model_path)
    with torch.random.fork_rng(devices=[]), torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    persistent = set(model.state_dict())
    tensors = {**dict(model.named_parameters()),
               **{name: buffer for name, buffer in model.named_buffers() if name in persistent}}
    return {name: tensor.shape for name, tensor in revert_weight_conversion(model, tensors).items()}


class LiveBytesMeter:
    """Measures how many bytes of a weight stream's tensors are alive at once during a sync.

    ``meter.wrap(stream)`` passes the stream through and counts a tensor from the moment it is
    yielded until its last reference anywhere (bucket, engine buffer) is gone. Meaningful for streams
    whose tensors are fresh buffers, as ``iter_hf_weights`` yields; ``peak`` is then the extra memory
    a sync needed on top of the engine's own weights.
    """

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0
        self._lock = threading.Lock()

    def wrap(self, weights: WeightStream) -> WeightStream:
        for name, tensor in weights:
            nbytes = tensor_bytes(tensor)
            with self._lock:
                self.live += nbytes
                self.peak = max(self.peak, self.live)
            weakref.finalize(tensor, self._release, nbytes)
            yield name, tensor
            del tensor

    def _release(self, nbytes: int) -> None:
        with self._lock:
            self.live -= nbytes


@contextmanager
def colocated_rollout(engine: WeightReceiver, weights: WeightStream | None = None, *,
                      offload_trainer: Callable[[], None] | None = None,
                      onload_trainer: Callable[[], None] | None = None,
                      bucket_bytes: int | None = None) -> Iterator[WeightReceiver]:
    """The memory hand-off around one rollout phase; generate inside the ``with`` block.

    Entering: wake the engine's weights, sync ``weights`` into them (if given), ``offload_trainer()``
    (free the trainer's optimizer state, gradients, ...), then wake the KV cache. Leaving (also on
    error): put the engine to sleep, then ``onload_trainer()`` if the trainer was offloaded. A failed
    sync raises before the trainer is touched. On CPU waking the weights is a no-op and the
    callbacks still run, so the same code path is exercised everywhere.
    """
    offloaded = False
    engine.wake_up(("weights",))
    try:
        if weights is not None:
            engine.load_weights(weights, bucket_bytes=bucket_bytes)
        if offload_trainer is not None:
            offload_trainer()
            offloaded = True
        engine.wake_up(("kv_cache",))
        yield engine
    finally:
        try:
            engine.sleep()
        finally:
            if offloaded and onload_trainer is not None:
                onload_trainer()
