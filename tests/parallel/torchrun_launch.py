"""One torchrun launch of a multi-process check script (gloo on CPU), for the tests that read its results.

``launch(script, nproc, workdir, name, timeout, *args)`` runs ``script`` (a file beside this one) with ``nproc``
ranks, ``--out <workdir>/<name>.json`` and ``args``; returns that JSON (empty when the script wrote none) with the
tail of the launch's log under ``"_log"``, which says so when the launch ran past ``timeout`` seconds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


def launch(script: str, nproc: int, workdir: Path, name: str, timeout: int, *args: str) -> dict:
    out, log = workdir / f"{name}.json", workdir / f"{name}.log"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--standalone",
               str(HERE / script), "--out", str(out), *args]
    with open(log, "w") as handle:
        try:
            subprocess.run(command, cwd=REPO, env=env, stdout=handle, stderr=subprocess.STDOUT, timeout=timeout)
        except subprocess.TimeoutExpired:
            handle.write(f"\n*** launch timed out after {timeout}s ***\n")
    results = json.loads(out.read_text()) if out.is_file() else {}
    results["_log"] = log.read_text()[-6000:]
    return results
