"""vLLM engines colocated with ranks of an existing gloo world; Megatron TP2, PP2, TP2xPP2 -> engine TP1.

One launch of ``colocated_worker.py`` per world size (2 ranks, then 4) runs every phase; this module
asserts on the JSON the ranks write. The 4-rank launch (~1.5 min on 2 cores) is also marked slow.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.multiproc, pytest.mark.vllm]

WORKER = Path(__file__).with_name("colocated_worker.py")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(tmp_path_factory, world: int) -> list[dict]:
    out = tmp_path_factory.mktemp(f"colocated{world}") / "result.json"
    env = {**os.environ, "PYTHONPATH": str(WORKER.parents[2])}
    proc = subprocess.run([sys.executable, str(WORKER), "--world", str(world), "--port", str(free_port()),
                           "--out", str(out), "--megatron"], env=env, capture_output=True, text=True, timeout=420)
    written = sorted(out.parent.glob("result.rank*.json"))
    assert written, f"no results (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    results = [r for path in written for r in json.loads(path.read_text())]
    errors = [r["error"] for r in results if "error" in r]
    assert not errors, "\n".join(errors)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(results) == world
    return results


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    """World of 2: TP-1 engines, Megatron TP2 and PP2 -> TP-1 engines, then one inference-TP-2 engine."""
    return launch(tmp_path_factory, 2)


@pytest.fixture(scope="module")
def ranks4(tmp_path_factory) -> list[dict]:
    """World of 4: TP-1 engines fed by Megatron TP2 x PP2."""
    return launch(tmp_path_factory, 4)


@pytest.mark.timeout(480)
def test_tp1_engine_per_rank_in_an_existing_world(ranks):
    assert [r["tp1.dp_rank"] for r in ranks] == [0, 1]  # one replica per rank
    for r in ranks:
        assert r["tp1.greedy_matches_hf"] and r["tp1.greedy_matches_hf_after_sync"]
        assert r["tp1.same_replica_seed_agrees"] and r["tp1.other_replica_differs"]
        assert r["tp1.world_sum_after_generate"] == 3.0
        # vLLM's shutdown must not take the trainer's world with it.
        assert r["tp1.world_alive_after_shutdown"] and r["tp1.world_sum_after_shutdown"] == 3.0


@pytest.mark.timeout(480)
@pytest.mark.parametrize("layout", ["megatron_tp2", "megatron_pp2"])
def test_megatron_training_layout_streams_into_tp1_engines(ranks, layout):
    for r in ranks:
        assert r[f"{layout}.unexpected_names"] == [] and r[f"{layout}.tensors"] == 20
        assert r[f"{layout}.ranks_agree_on_weights"]
        assert r[f"{layout}.greedy_matches_exported"]


@pytest.mark.timeout(480)
def test_inference_tp2_replica_over_the_world(ranks):
    for r in ranks:
        assert r["tp2.dp_rank"] == 0 and r["tp2.greedy_matches_hf_after_sync"]
        assert r["tp2.ranks_sample_the_same"] and r["tp2.world_sum_after_shutdown"] == 3.0


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_megatron_tp2_pp2_streams_into_four_tp1_engines(ranks4):
    assert [r["tp1.dp_rank"] for r in ranks4] == [0, 1, 2, 3]
    for r in ranks4:
        assert r["tp1.greedy_matches_hf_after_sync"] and r["tp1.world_sum_after_shutdown"] == 10.0
        assert r["megatron_tp2pp2.unexpected_names"] == [] and r["megatron_tp2pp2.tensors"] == 20
        assert r["megatron_tp2pp2.ranks_agree_on_weights"] and r["megatron_tp2pp2.greedy_matches_exported"]
