"""Two-node emulation on one machine's loopback addresses, through the launchers themselves.

(a) torchrun: two ``launch/torchrun_multi_node.sh --nnodes 2`` processes meet at a c10d rendezvous on
    127.0.0.1 and run ``launch/dist_check.py`` (gloo collectives through meshrl's parallel state at
    TP 2 and PP 2, and each rank's model shard against ``meshrl plan``'s parameter count).
(b) Slurm + Ray: the rendered ``launch/slurm_ray.sbatch`` runs with stand-ins for ``srun`` and
    ``scontrol`` (tests/launch/fake_slurm) that run each "node" here on its own address: the Ray head
    on 127.0.0.2, a worker on 127.0.0.3, and the driver trains one step of the tiny recipe with
    ``trainer.nnodes=2 trainer.n_gpus_per_node=1``. Each node offers one CPU, so the two ranks (one
    CPU each) can only be placed one per node.

Only processes these tests start are stopped, by their own PIDs (never ``ray stop``, which would stop
every Ray process on the machine). Budget on 2 shared cores: ~45 s + ~95 s.
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parents[2]
LAUNCH = REPO / "launch"
FAKE_SLURM = Path(__file__).resolve().parent / "fake_slurm"
HEAD_IP, WORKER_IP = "127.0.0.2", "127.0.0.3"

pytestmark = pytest.mark.multiproc


def free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class Started:
    """Processes this test started (each in its own session), stopped by PID however the test ends."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []

    def popen(self, command: list[str], log: Path, env: dict, cwd: Path) -> subprocess.Popen:
        proc = subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, cwd=cwd,
                                start_new_session=True)
        self.procs.append(proc)
        return proc

    def stop(self) -> None:
        """SIGTERM every started process (the Slurm script's trap then stops its Ray nodes), wait, then
        SIGKILL whatever of their process trees is left."""
        tree = []
        for proc in self.procs:
            try:
                top = psutil.Process(proc.pid)
                tree += [top, *top.children(recursive=True)]
            except psutil.NoSuchProcess:
                continue
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        _, alive = psutil.wait_procs(tree, timeout=45)
        for leftover in alive:
            try:
                leftover.kill()
            except psutil.NoSuchProcess:
                pass


@pytest.fixture
def started():
    tracker = Started()
    yield tracker
    tracker.stop()


@pytest.fixture
def short_tmp():
    """A short folder under /tmp: Ray's Unix socket paths must stay under 108 characters."""
    path = Path(tempfile.mkdtemp(prefix="mrl-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def processes_mentioning(text: str) -> list[str]:
    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if text in cmdline:
            found.append(f"{proc.info['pid']}: {cmdline[:120]}")
    return found


@pytest.mark.timeout(300)
def test_torchrun_two_nodes_on_loopback(started, tmp_path, tiny_llama_dir, tiny_qwen2_dir):
    port = free_port("127.0.0.1")
    out = tmp_path / "dist_check.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    command = ["bash", str(LAUNCH / "torchrun_multi_node.sh"), "--nnodes", "2", "--nproc-per-node", "1",
               "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"test-{port}",
               str(LAUNCH / "dist_check.py"), "--layouts", "2x1,1x2", "--model", "tiny:llama",
               "--model", "tiny:qwen2", "--timeout", "120", "--out", str(out)]
    nodes = [started.popen(command, tmp_path / f"node{i}.log", env, REPO) for i in range(2)]
    for i, node in enumerate(nodes):
        try:
            node.wait(timeout=240)
        except subprocess.TimeoutExpired:
            pytest.fail(f"torchrun node {i} did not finish:\n{(tmp_path / f'node{i}.log').read_text()[-4000:]}")
    logs = "\n".join((tmp_path / f"node{i}.log").read_text()[-3000:] for i in range(2))
    assert [n.returncode for n in nodes] == [0, 0], logs
    result = json.loads(out.read_text())
    assert result["ok"] and result["world"] == 2 and result["backend"] == "gloo"
    for rank in result["ranks"]:
        for name, layout in rank["layouts"].items():
            assert layout["ok"], (name, layout)
            assert layout["tiny:llama parameters_ok"] and layout["tiny:qwen2 parameters_ok"]
    # TP 2 splits the ranks over tp_rank 0/1; PP 2 over pp_rank 0/1 (the tied model keeps an output copy)
    assert sorted(r["layouts"]["tp2pp1"]["tp_rank"] for r in result["ranks"]) == [0, 1]
    assert sorted(r["layouts"]["tp1pp2"]["pp_rank"] for r in result["ranks"]) == [0, 1]


# `make test-extended` (115 test-seconds): two nodes' processes rendezvous in test_torchrun_two_nodes_on_loopback, the
# Slurm template's commands and keys are tests/launch/test_launch_scripts.py's, Ray's multi-node address
# (workers.cluster) is unit-tested there too.
@pytest.mark.extended
@pytest.mark.timeout(480)
def test_slurm_template_runs_ray_on_two_loopback_nodes(started, short_tmp, tiny_llama_dir):
    sys.path.insert(0, str(LAUNCH))
    from render import render

    run_dir = short_tmp / "run"
    script = short_tmp / "job.sbatch"
    script.write_text(render((LAUNCH / "slurm_ray.sbatch").read_text(), {
        "NNODES": "2", "GPUS_PER_NODE": "1", "CPUS_PER_NODE": "1", "RECIPE": "cpu_tiny_grpo",
        "MESHRL_ROOT": str(REPO), "PYTHON": sys.executable, "RAY_PORT": str(free_port(HEAD_IP)),
        "WAIT_TIMEOUT_S": "120",
        # trainer.verbose: the workers' output reaches the job log with Ray's "(pid=..., ip=...)" prefixes,
        # which say on which node each rank ran.
        "OVERRIDES": f"trainer.total_training_steps=1 trainer.val_before_train=False trainer.test_freq=-1 "
                     f"trainer.verbose=True trainer.default_local_dir={run_dir}",
    }))
    env = {**os.environ, "PATH": f"{FAKE_SLURM}:{os.environ['PATH']}",
           "FAKE_SLURM_NODES": f"node-a={HEAD_IP},node-b={WORKER_IP}", "SLURM_JOB_NODELIST": "node-a,node-b",
           "RAY_TMPDIR": str(short_tmp / "ray"), "MESHRL_RAY_OBJECT_STORE_BYTES": str(150 * 1024**2),
           "PYTHONWARNINGS": "ignore"}
    env.pop("RAY_ADDRESS", None)
    log = short_tmp / "job.log"
    job = started.popen(["bash", str(script)], log, env, short_tmp)
    try:
        job.wait(timeout=420)
    except subprocess.TimeoutExpired:
        started.stop()
        pytest.fail(f"the Slurm job did not finish:\n{log.read_text()[-6000:]}")
    text = log.read_text()
    assert job.returncode == 0, text[-6000:]
    assert f"ray_wait: 2 node(s) alive: {HEAD_IP}, {WORKER_IP}" in text
    assert f"ip={WORKER_IP})" in text and "ActorRolloutRefWorker" in text  # a rank ran on the worker node
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1]
    # the script's trap stopped both Ray nodes: nothing of this session is left
    assert processes_mentioning(str(short_tmp / "ray")) == []
