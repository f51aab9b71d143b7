"""meshrl.process_memory (the mmap threshold, resident-memory peaks) and the update's memory metrics
(meshrl.workers.memory_metrics). Allocator behaviour is process-wide, so each check runs in a fresh process."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from meshrl import process_memory

REPO = Path(__file__).resolve().parents[2]


def run_python(code: str, **env: str) -> dict:
    run = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **env})
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("raw, expected", [("", process_memory.DEFAULT_MMAP_THRESHOLD), ("65536", 65536),
                                           (" Dynamic ", None), (str(32 << 20), 32 << 20)])
def test_threshold_setting_reads_the_variable(monkeypatch, raw, expected):
    monkeypatch.setenv(process_memory.ENV_MMAP_THRESHOLD, raw)
    assert process_memory.mmap_threshold_setting() == expected


@pytest.mark.parametrize("raw", ["1M", "-1", "0", "100", str((32 << 20) + 1), "off"])
def test_bad_threshold_is_refused_with_what_to_give(monkeypatch, raw):
    monkeypatch.setenv(process_memory.ENV_MMAP_THRESHOLD, raw)
    with pytest.raises(ValueError, match="byte count from 4096 .*'dynamic'"):
        process_memory.mmap_threshold_setting()


# Tensors of 1 MiB allocated after a 16 MiB block was freed (which raises glibc's dynamic threshold to 16 MiB), each
# followed by a small tensor that stays alive: the layout an update's activations and the step's lasting tensors leave.
HEAP_PATTERN = """
    import json, torch
    from meshrl import process_memory
    threshold = process_memory.limit_heap_growth()
    big = torch.ones(16 << 20, dtype=torch.uint8); del big
    before = process_memory.rss_bytes()
    pairs = [(torch.ones(1 << 18), torch.ones(1 << 10)) for _ in range(256)]   # 256 x (1 MiB, 4 KiB), touched
    grown = process_memory.rss_bytes()
    kept = [small for _, small in pairs]
    del pairs
    print(json.dumps({"threshold": threshold, "grown": grown - before, "kept": process_memory.rss_bytes() - before}))
"""


def test_fixed_threshold_gives_freed_tensors_back_and_dynamic_keeps_them():
    fixed = run_python(HEAP_PATTERN, MESHRL_MALLOC_MMAP_THRESHOLD="524288")
    dynamic = run_python(HEAP_PATTERN, MESHRL_MALLOC_MMAP_THRESHOLD="dynamic")
    assert fixed["threshold"] == 524288 and dynamic["threshold"] is None
    assert fixed["grown"] > 200 << 20 and dynamic["grown"] > 200 << 20
    assert dynamic["kept"] > 200 << 20  # glibc's own threshold: the heap holds the freed blocks
    assert fixed["kept"] < 16 << 20  # mmapped: they left with the tensors


def test_a_phase_that_trims_the_heap_leaves_no_freed_tensors_resident():
    """glibc's own threshold keeps the pattern's freed blocks (above); ``trims_heap`` hands their pages back when the
    phase returns."""
    r = run_python("""
        import json, torch
        from meshrl import process_memory
        big = torch.ones(16 << 20, dtype=torch.uint8); del big
        kept = []

        def phase():
            pairs = [(torch.ones(1 << 18), torch.ones(1 << 10)) for _ in range(256)]
            kept.extend(small for _, small in pairs)

        before = process_memory.rss_bytes()
        phase()
        untrimmed = process_memory.rss_bytes()
        process_memory.trims_heap(phase)()
        print(json.dumps({"untrimmed": untrimmed - before, "trimmed": process_memory.rss_bytes() - untrimmed}))
    """, MESHRL_MALLOC_MMAP_THRESHOLD="dynamic")
    assert r["untrimmed"] > 200 << 20  # 256 MiB freed, still resident
    assert r["trimmed"] < 16 << 20  # the second phase's 256 MiB (and the first's) went back


def test_update_memory_reports_the_peak_inside_only():
    r = run_python("""
        import json, torch, torch.distributed as dist
        from meshrl import process_memory
        from meshrl.workers.memory_metrics import update_memory
        process_memory.limit_heap_growth()
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
        earlier = torch.ones(1 << 28, dtype=torch.uint8); del earlier   # a 256 MiB peak before the update
        metrics = {}
        before = process_memory.rss_bytes()
        with update_memory(metrics):
            inside = torch.ones(96 << 20, dtype=torch.uint8); del inside  # 96 MiB during it
        print(json.dumps({"metrics": metrics, "before": before}))
    """)
    gib = 1024**3
    peak, before = r["metrics"]["perf/max_rss_gb"] * gib, r["before"]
    assert 90 << 20 <= peak - before < 200 << 20  # the inside allocation; the earlier, larger peak was reset away
    assert r["metrics"]["perf/cpu_memory_used_gb"] > 0
    assert "perf/max_memory_allocated_gb" not in r["metrics"]  # CPU: no CUDA allocator figures


@pytest.mark.parametrize("user, expected", [
    (None, "glibc.malloc.hugetlb=1"),
    ("glibc.malloc.arena_max=2", "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"),
    ("glibc.malloc.hugetlb=0", "glibc.malloc.hugetlb=0"),  # the user's choice stays
    ("glibc.malloc.hugetlb=0:glibc.malloc.arena_max=2", "glibc.malloc.hugetlb=0:glibc.malloc.arena_max=2"),
])
def test_workers_start_with_huge_pages_unless_the_user_chose(user, expected):
    environ = {} if user is None else {"GLIBC_TUNABLES": user}
    assert process_memory.allocator_environment(environ) == {"GLIBC_TUNABLES": expected}


THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@pytest.mark.skipif(not THP_MODE.is_file() or "[madvise]" not in THP_MODE.read_text(),
                    reason="transparent huge pages follow the tunable only in the kernel's madvise mode")
def test_the_tunable_makes_mmapped_tensors_fault_in_huge_pages():
    """A process started with ``allocator_environment()`` backs a tensor above the mmap threshold with 2 MiB pages
    (AnonHugePages), with far fewer page faults than one started without it."""
    code = """
        import json, resource, torch
        from meshrl import process_memory
        process_memory.limit_heap_growth()
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t = torch.ones(64 << 20, dtype=torch.uint8)   # 64 MiB, mmapped, touched
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
        huge = next(int(l.split()[1]) for l in open('/proc/self/smaps_rollup') if l.startswith('AnonHugePages'))
        print(json.dumps({"faults": faults, "huge_kib": huge}))
    """
    with_thp = run_python(code, **process_memory.allocator_environment({}))
    without = run_python(code, GLIBC_TUNABLES="glibc.malloc.hugetlb=0")
    assert with_thp["huge_kib"] >= 32 << 10 and without["huge_kib"] == 0
    assert without["faults"] > 8000 and with_thp["faults"] < without["faults"] / 4


def test_a_bad_threshold_stops_the_run_at_preflight(monkeypatch):
    """Checked before any worker starts (each worker would raise it at start, after Ray and the models loaded)."""
    from meshrl.config import ConfigError, load_config
    from meshrl.trainer.main import preflight

    cfg = load_config([], recipe="cpu_tiny_grpo")
    monkeypatch.setenv(process_memory.ENV_MMAP_THRESHOLD, "1M")
    with pytest.raises(ConfigError, match="MESHRL_MALLOC_MMAP_THRESHOLD='1M': give a byte count"):
        preflight(cfg)
    monkeypatch.setenv(process_memory.ENV_MMAP_THRESHOLD, "dynamic")
    preflight(cfg)
