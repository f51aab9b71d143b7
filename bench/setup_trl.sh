#!/usr/bin/env bash
# Create (or check) the separate TRL environment that bench/vs_trl.py runs TRL's GRPOTrainer in.
#
# It lives in .cache/bench-trl/venv (git-ignored) so TRL and whatever it resolves can never change the
# main .venv. Every package TRL's runner imports is pinned; torch is installed first and pinned because
# an unpinned resolve pulls several GB of CUDA wheels. transformers / accelerate / datasets are the
# versions the main .venv has, so both frameworks run the same model code; TRL 1.16.0 is the newest on
# the registry (Nov 2026) and declares transformers>=4.56.2, accelerate>=1.10.1, datasets>=4.7.0.
# Idempotent: returns at once when the stamp matches this script. Prints the venv's python on stdout.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3.11}
ROOT=${MESHRL_CACHE_DIR:-$PWD/.cache}/bench-trl
VENV=$ROOT/venv
STAMP=$VENV/.bench-trl-stamp
PINS=(torch==2.13.0 trl==1.16.0 transformers==5.19.0 accelerate==1.15.0 datasets==5.2.0 psutil==7.2.2)
stamp_now=$(sha256sum "$0" | cut -d' ' -f1)

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$stamp_now" ]; then
    echo "$VENV/bin/python"
    exit 0
fi
command -v "$PYTHON" >/dev/null || { echo "setup_trl: $PYTHON not found; set PYTHON=/path/to/python3.11" >&2; exit 1; }
echo "setup_trl: creating $VENV (first time: a few minutes)" >&2
mkdir -p "$ROOT"
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
pip="$VENV/bin/python -m pip --disable-pip-version-check -q"
$pip install --upgrade pip wheel >&2
$pip install "${PINS[0]}" >&2
# Everything pinned in one resolve, torch included, so nothing can swap it for a CUDA build.
$pip install "${PINS[@]}" >&2
# Never let these in: there are no CPU builds of them here, and they break `import transformers`.
$pip uninstall -y torchvision torchaudio torchcodec triton >/dev/null 2>&1 || true
"$VENV/bin/python" -c "import torch, trl, transformers; assert torch.__version__.startswith('2.13.0'), torch.__version__" >&2
echo "$stamp_now" > "$STAMP"
echo "$VENV/bin/python"
