"""What this machine can do, and what a model costs on it: shared by the benchmarks in bench/.

- ``matmul_flops``: dense ``torch.mm`` FLOP/s right now (best of a few; fp32 or bf16).
- ``memory_bandwidth``: bytes/s of streaming a large tensor (read: ``sum``; copy: read + write).
- ``decode_matmuls``: a decode step's weight matmuls at its real row count, timed with torch's GEMMs.
- ``model_shape`` / ``transformer_flops``: a model's parameter count and layout, and the model FLOPs
  of running it over sequences (PaLM's convention, used by every FLOP figure in bench/).
- ``ProcessTreeSampler``: the summed memory of a process and all its descendants (Ray workers,
  engine processes, reward pools), sampled in a thread.
- ``ServedVariant``: one variant of a side-by-side benchmark in its own process, driven line by line.

The machine is shared with other processes: a measured rate is what was available at that moment,
never more than the machine's capability, so where several measurements exist the best one is the
closest to it (``best_rate``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch


def timed(fn: Callable[[], object]) -> float:
    """Wall seconds of one call of ``fn``."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def matmul_flops(n: int = 2048, repeats: int = 3, dtype: torch.dtype = torch.float32) -> float:
    """``torch.mm`` FLOP/s of an n×n by n×n product in ``dtype`` with the current thread count (best of
    ``repeats`` after one warm-up; 2·n³ FLOPs per product)."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    torch.mm(a, b)
    best = min(timed(lambda: torch.mm(a, b)) for _ in range(repeats))
    return 2 * n**3 / best


def memory_bandwidth(mib: int = 512, repeats: int = 3) -> dict[str, float]:
    """Streaming bandwidth of a ``mib`` MiB fp32 tensor, best of ``repeats`` after a warm-up:
    ``read_bytes_per_s`` (a ``sum`` reads every byte once: the access pattern of reading weights) and
    ``copy_bytes_per_s`` (``copy_`` into a second tensor: bytes read + bytes written). The tensor is far
    larger than any cache, so this is DRAM bandwidth."""
    numel = (mib << 20) // 4
    src = torch.ones(numel)
    dst = torch.empty_like(src)
    nbytes = src.numel() * src.element_size()
    src.sum(), dst.copy_(src)  # warm-up: fault the pages in
    read = min(timed(lambda: src.sum()) for _ in range(repeats))
    copy = min(timed(lambda: dst.copy_(src)) for _ in range(repeats))
    return {"read_bytes_per_s": nbytes / read, "copy_bytes_per_s": 2 * nbytes / copy, "tensor_mib": mib}


def bf16_is_emulated(bf16_flops: float, fp32_flops: float) -> bool:
    """Whether bf16 matmuls run without a bf16 matrix unit (AVX512-BF16/AMX): torch then emulates them,
    measured here at 1.3 GFLOP/s against 173 GFLOP/s in fp32 (an AMX machine gave 425 GFLOP/s bf16)."""
    return bf16_flops < fp32_flops / 4


def measure_rates(threads: int) -> dict[str, float]:
    """This machine's rates right now with ``threads`` torch threads: fp32 and bf16 matmul FLOP/s and
    memory bandwidth, stamped with the time and load average (the thread count is restored after).
    Where bf16 is emulated its figure comes from a 512³ product (a 2048³ one would take minutes)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        fp32 = matmul_flops(dtype=torch.float32)
        bf16 = matmul_flops(n=512, repeats=1, dtype=torch.bfloat16)
        emulated = bf16_is_emulated(bf16, fp32)
        return {"t": time.time(), "load_average": load_average(), "threads": threads, "matmul_flops_fp32": fp32,
                "matmul_flops_bf16": bf16 if emulated else matmul_flops(dtype=torch.bfloat16),
                "bf16_emulated": emulated, **memory_bandwidth()}
    finally:
        torch.set_num_threads(previous)


def best_rate(*values: float | None) -> float:
    """The best of several measurements of one rate (others' load can only lower a measurement)."""
    present = [v for v in values if v]
    if not present:
        raise ValueError("no measurement given")
    return max(present)


@dataclass(frozen=True)
class ModelShape:
    """What the FLOP and byte counts need of a decoder-only transformer."""

    params: int  # every stored parameter once (a tied embedding counts once: it is the vocabulary projection too)
    layers: int
    hidden: int
    kv_heads: int
    head_dim: int
    vocab: int

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def model_shape(model_dir: str | os.PathLike) -> ModelShape:
    """The shape of the HF model in ``model_dir``: the layout as meshrl's model builder reads it from
    the config, the parameter count from the safetensors headers (what is actually stored)."""
    from safetensors import safe_open
    from transformers import AutoConfig

    from meshrl.parallel.model_builder import model_spec

    spec = model_spec(AutoConfig.from_pretrained(model_dir))
    params = 0
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(path, framework="pt") as handle:
            params += sum(torch.Size(handle.get_slice(k).get_shape()).numel() for k in handle.keys())
    return ModelShape(params=params, layers=spec.num_layers, hidden=spec.hidden_size, kv_heads=spec.num_kv_heads,
                      head_dim=spec.head_dim, vocab=spec.vocab_size)


def transformer_flops(seq_lens, shape: ModelShape, *, backward: bool, output_tokens: float | None = None) -> float:
    """Model FLOPs of one pass over sequences of lengths ``seq_lens`` (PaLM's convention).

    Forward, per token of a sequence of length S: 2·N for the weights plus 4·layers·hidden·S for
    attention (QKᵀ and AV, not halved for causality); with ``backward`` the pass costs three times the
    forward (one forward, two for the backward): 6·N + 12·layers·hidden·S per token. With
    ``output_tokens``, only that many tokens run the vocabulary projection (2·vocab·hidden of the 2·N;
    meshrl computes the response tokens' outputs only): the other tokens' share is left out.
    """
    per_token_weights = 2 * shape.params
    per_token_attention = 4 * shape.layers * shape.hidden
    factor = 3 if backward else 1
    total = sum(factor * s * (per_token_weights + per_token_attention * s) for s in seq_lens)
    if output_tokens is not None:
        total -= factor * 2 * shape.vocab * shape.hidden * (sum(seq_lens) - output_tokens)
    return float(total)


def kv_bytes_per_token(shape: ModelShape, dtype_bytes: int) -> int:
    """Bytes of K and V cache one context token holds (read once per decode step that attends to it)."""
    return 2 * shape.layers * shape.kv_heads * shape.head_dim * dtype_bytes


def decode_matmuls(model_dir: str | os.PathLike, rows: int, threads: int, dtype: torch.dtype = torch.float32,
                   repeats: int = 5) -> dict:
    """What one decode step's weight matmuls cost with torch's own GEMMs: every linear layer of the model
    in ``model_dir`` (fused QKV, attention output, fused gate/up, down, times the layers, and the
    vocabulary projection) applied to ``rows`` tokens, each shape timed alone (best of ``repeats`` after
    a warm-up). A decode step of ``rows`` sequences cannot do its matmuls faster than these kernels do
    (short of better GEMMs), whatever the peak FLOP/s of large products says."""
    from transformers import AutoConfig

    from meshrl.parallel.model_builder import model_spec

    spec = model_spec(AutoConfig.from_pretrained(model_dir))
    qkv = (spec.num_attention_heads + 2 * spec.num_kv_heads) * spec.head_dim
    shapes = {"qkv": (qkv, spec.hidden_size, spec.num_layers),
              "attention_out": (spec.hidden_size, spec.num_attention_heads * spec.head_dim, spec.num_layers),
              "gate_up": (2 * spec.ffn_hidden_size, spec.hidden_size, spec.num_layers),
              "down": (spec.hidden_size, spec.ffn_hidden_size, spec.num_layers),
              "vocabulary": (spec.vocab_size, spec.hidden_size, 1)}
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        by_shape, total_s, total_flops = {}, 0.0, 0.0
        for name, (out_features, in_features, count) in shapes.items():
            x = torch.randn(rows, in_features, dtype=dtype)
            weight = torch.randn(out_features, in_features, dtype=dtype)
            torch.nn.functional.linear(x, weight)
            seconds = min(timed(lambda: torch.nn.functional.linear(x, weight)) for _ in range(repeats))
            flops = 2 * rows * out_features * in_features
            by_shape[name] = {"out": out_features, "in": in_features, "count": count, "seconds": seconds,
                              "flops_per_s": flops / seconds}
            total_s += seconds * count
            total_flops += flops * count
    finally:
        torch.set_num_threads(previous)
    return {"rows": rows, "threads": threads, "dtype": str(dtype).removeprefix("torch."),
            "seconds_per_step": total_s, "flops_per_s": total_flops / total_s, "by_shape": by_shape}


def load_average() -> float:
    """1-minute load average (other processes sharing the cores skew every timing; recorded beside it)."""
    return round(os.getloadavg()[0], 2)


def write_result(name: str, result: dict, plot) -> Path:
    """``bench/results/<name>.json`` and the chart ``plot(result, <name>.png)`` beside it; the JSON's path."""
    results = Path(__file__).resolve().parent / "results"
    results.mkdir(parents=True, exist_ok=True)
    (results / f"{name}.json").write_text(json.dumps(result, indent=1))
    plot(result, results / f"{name}.png")
    return results / f"{name}.json"


class ServedVariant:
    """``python -m MODULE --serve VARIANT ARGS...`` started from the repo root (or ``cwd``) with ``threads`` OpenMP
    threads (plus ``env``): it answers each command line written to its stdin with one JSON line, after a first
    line once it is ready. Each variant in its own process keeps its memory its own, and the parent can
    interleave the variants' steps so all see the same background load."""

    def __init__(self, module: str, variant: str, args: list[str], threads: int, env: dict | None = None,
                 cwd: Path | None = None) -> None:
        command = [sys.executable, "-m", module, "--serve", variant, *args]
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONWARNINGS": "ignore", **(env or {})}
        self.variant = variant
        self.process = subprocess.Popen(command, cwd=cwd or Path(__file__).resolve().parents[1], env=env, text=True,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.read()  # ready

    def read(self) -> dict:
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the {self.variant} process died (exit {self.process.wait()})")
        return json.loads(line)

    def ask(self, command: str) -> dict:
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()
        return self.read()

    def close(self) -> dict:
        """Its final report (the answer to ``done``), then waits for it to exit."""
        report = self.ask("done")
        self.process.wait(timeout=120)
        return report

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()


class ProcessTreeSampler:
    """Samples the summed memory of process ``pid`` and all its descendants in a background thread.

    RSS (every ``interval_s``) counts a page shared by several processes (libraries, Ray's object store)
    once per process, so the sum overstates the footprint; PSS (proportional set size: a shared page
    split between its sharers) does not, but reading it costs more, so it is sampled every
    ``pss_every`` RSS samples. CPU seconds are the sum over every process seen of its user + system
    time at its last sample (a process that exits between samples loses its last interval).

    Use as a context manager; ``samples`` holds ``(unix_time, rss_bytes, processes, cpu_seconds_so_far)``,
    ``pss_samples`` ``(unix_time, pss_bytes)``, and ``peak_by_process`` the processes of the sample with the
    largest summed RSS: ``(name, rss_bytes)``, largest first (what the peak is made of).
    """

    def __init__(self, pid: int, interval_s: float = 0.5, pss_every: int = 10) -> None:
        import psutil

        self._psutil = psutil
        self._root = psutil.Process(pid)
        self._interval = interval_s
        self._pss_every = pss_every
        self._stop = threading.Event()
        self._cpu: dict[int, float] = {}
        self.samples: list[tuple[float, int, int, float]] = []
        self.pss_samples: list[tuple[float, int]] = []
        self.peak_by_process: list[tuple[str, int]] = []
        self._peak_rss = 0

    def _tree(self) -> list:
        try:
            return [self._root, *self._root.children(recursive=True)]
        except self._psutil.Error:
            return []

    def sample(self, with_pss: bool = False) -> None:
        rss = pss = 0
        procs = self._tree()
        parts: list[tuple[str, int]] = []
        for proc in procs:
            try:
                part = proc.memory_info().rss
                rss += part
                parts.append((proc.name(), part))
                times = proc.cpu_times()
                self._cpu[proc.pid] = times.user + times.system
                if with_pss:
                    pss += proc.memory_full_info().pss
            except (self._psutil.Error, AttributeError):
                continue  # exited between listing and reading, or PSS unsupported here
        now = time.time()
        if procs:
            if rss > self._peak_rss:
                self._peak_rss, self.peak_by_process = rss, sorted(parts, key=lambda item: -item[1])
            self.samples.append((now, rss, len(procs), self.cpu_seconds))
            if with_pss and pss:
                self.pss_samples.append((now, pss))

    def _run(self) -> None:
        count = 0
        while not self._stop.is_set():
            self.sample(with_pss=count % self._pss_every == 0)
            count += 1
            self._stop.wait(self._interval)

    def __enter__(self) -> ProcessTreeSampler:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def cpu_seconds(self) -> float:
        return sum(self._cpu.values())


def peak_between(samples, start: float | None = None, end: float | None = None) -> int | None:
    """Largest value of ``(time, value, ...)`` samples with ``start <= time <= end`` (None: unbounded);
    None when no sample falls in the window."""
    inside = [s[1] for s in samples if (start is None or s[0] >= start) and (end is None or s[0] <= end)]
    return max(inside) if inside else None


def cpu_between(samples, start: float, end: float) -> float | None:
    """CPU seconds a sampled process tree used between ``start`` and ``end``: the difference of the
    cumulative CPU (4th field) of the last samples at or before each time; None without both."""
    before = [smp[3] for smp in samples if smp[0] <= start]
    upto = [smp[3] for smp in samples if smp[0] <= end]
    return upto[-1] - before[-1] if before and upto else None
