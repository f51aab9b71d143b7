"""launch/: every script parses, the Slurm template renders to a valid script made of common.sh's
functions, and the launchers build the commands they document (checked with a stand-in Python)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LAUNCH = REPO / "launch"
sys.path.insert(0, str(LAUNCH))

from render import RenderError, placeholders, render  # noqa: E402

TEMPLATE = (LAUNCH / "slurm_ray.sbatch").read_text()
REQUIRED = dict(NNODES="4", GPUS_PER_NODE="8", CPUS_PER_NODE="96", RECIPE="remax_qwen2.5-32b",
                MESHRL_ROOT=str(REPO), PYTHON=sys.executable)


def bash(script: str, env: dict | None = None, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", script], capture_output=True, text=True, cwd=cwd, timeout=60,
                          env={**os.environ, **(env or {})})


@pytest.mark.parametrize("path", sorted(LAUNCH.glob("*.sh")) + [LAUNCH / "slurm_ray.sbatch"], ids=lambda p: p.name)
def test_scripts_parse(path):
    assert subprocess.run(["bash", "-n", str(path)], capture_output=True).returncode == 0


def test_template_placeholders():
    names = placeholders(TEMPLATE)
    assert {n for n, default in names.items() if default is None} == set(REQUIRED)
    with pytest.raises(RenderError, match="missing value.*RECIPE"):
        render(TEMPLATE, {k: v for k, v in REQUIRED.items() if k != "RECIPE"})
    with pytest.raises(RenderError, match="unknown placeholder.*NODES"):
        render(TEMPLATE, {**REQUIRED, "NODES": "4"})


def test_rendered_script_is_bash_made_of_common_functions(tmp_path):
    text = render(TEMPLATE, {**REQUIRED, "OVERRIDES": "trainer.total_epochs=5", "RAY_PORT": "6400"})
    assert "{{" not in text
    script = tmp_path / "job.sbatch"
    script.write_text(text)
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    assert "#SBATCH --nodes=4" in text and "#SBATCH --gpus-per-node=8" in text
    # The cluster is started, awaited and driven only through launch/common.sh, which the loopback
    # emulation test runs for real.
    assert re.search(r"meshrl_ray_head '\$head_ip' '\$ray_port' 96 8", text)
    assert re.search(r"meshrl_ray_worker '\$RAY_ADDRESS' .*meshrl_node_ip.* 96 8", text)
    assert 'meshrl_wait_for_ray "$RAY_ADDRESS" 1 "$wait_s"' in text
    assert 'meshrl_wait_for_ray "$RAY_ADDRESS" 4 "$wait_s"' in text
    assert ("meshrl_run_driver remax_qwen2.5-32b trainer.nnodes=4 trainer.n_gpus_per_node=8 "
            "trainer.total_epochs=5") in text
    assert "ray stop" not in text  # it would kill every Ray process of the machine


def test_render_cli(tmp_path):
    args = [f"{k}={v}" for k, v in REQUIRED.items()]
    done = subprocess.run([sys.executable, str(LAUNCH / "render.py"), str(LAUNCH / "slurm_ray.sbatch"), *args],
                          capture_output=True, text=True)
    assert done.returncode == 0 and "#SBATCH --time=24:00:00" in done.stdout
    done = subprocess.run([sys.executable, str(LAUNCH / "render.py"), str(LAUNCH / "slurm_ray.sbatch"), "NNODES=2"],
                          capture_output=True, text=True)
    assert done.returncode == 2 and "missing value" in done.stderr


@pytest.fixture
def echo_python(tmp_path):
    """A stand-in for MESHRL_PYTHON that prints its arguments, one per line."""
    stub = tmp_path / "python"
    stub.write_text('#!/bin/bash\nprintf "%s\\n" "$@"\n')
    stub.chmod(0o755)
    return str(stub)


def test_torchrun_multi_node_command(echo_python):
    done = bash("launch/torchrun_multi_node.sh --nnodes 2 --nproc-per-node 4 --rdzv-endpoint 10.0.0.1:29400 "
                "--rdzv-id job7 launch/dist_check.py --tp 4", env={"MESHRL_PYTHON": echo_python})
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=4",
                                   "--rdzv-backend=c10d", "--rdzv-endpoint=10.0.0.1:29400", "--rdzv-id=job7",
                                   "launch/dist_check.py", "--tp", "4"]
    missing = bash("launch/torchrun_multi_node.sh launch/dist_check.py", env={"MESHRL_PYTHON": echo_python})
    assert missing.returncode == 2 and "--nnodes, --rdzv-endpoint" in missing.stderr


def test_torchrun_single_node_command(echo_python):
    done = bash("launch/torchrun_single_node.sh --nproc-per-node 2 -m meshrl.cli convert --tp 2",
                env={"MESHRL_PYTHON": echo_python})
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                                   "-m", "meshrl.cli", "convert", "--tp", "2"]


def test_ray_job_submit_dry_run():
    done = bash("launch/ray_job_submit.sh --address http://10.0.0.1:8265 cpu_tiny_grpo trainer.nnodes=2",
                env={"MESHRL_DRY_RUN": "1", "NCCL_DEBUG": "INFO"})
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "job submit --address=http://10.0.0.1:8265" in out
    assert out.rstrip().endswith("-m meshrl.trainer.main --config-name cpu_tiny_grpo trainer.nnodes=2")
    assert "NCCL_DEBUG" in out  # the shell's NCCL_* settings travel with the job


def test_common_functions():
    done = bash("source launch/common.sh; meshrl_node_ip", env={"MESHRL_NODE_IP": "10.1.2.3"})
    assert done.stdout.strip() == "10.1.2.3"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    done = subprocess.run(["bash", "-c", "source launch/common.sh; meshrl_run_driver cpu_tiny_grpo"],
                          capture_output=True, text=True, cwd=REPO, env=env, timeout=60)
    assert done.returncode == 2 and "RAY_ADDRESS is not set" in done.stderr
