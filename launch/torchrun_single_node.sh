#!/bin/bash
# torchrun on this machine only: meshrl's multi-process jobs that are not the RL trainer.
#
#   launch/torchrun_single_node.sh [--nproc-per-node N] SCRIPT.py|-m MODULE [args ...]
#
# meshrl's trainer is a Ray single controller (launch/slurm_ray.sbatch, launch/ray_job_submit.sh);
# torchrun runs the parallel layer's standalone jobs, one process per GPU:
#   launch/torchrun_single_node.sh --nproc-per-node 8 -m meshrl.cli convert hf-to-mcore --hf DIR --out OUT --tp 8
#   launch/torchrun_single_node.sh --nproc-per-node 2 launch/dist_check.py --tp 2 --model Qwen/Qwen2.5-0.5B-Instruct
#   launch/torchrun_single_node.sh --nproc-per-node 2 tests/parallel/mp_worker.py --suite w2 --workdir W --out W/w2.json
# N defaults to the number of visible GPUs (nvidia-smi), or 2 without one (gloo on CPU).
set -euo pipefail
# shellcheck source=launch/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

usage() { meshrl_usage "${BASH_SOURCE[0]}"; }
nproc=""
while [[ $# -gt 0 ]]; do
    case "$1" in
        --nproc-per-node) nproc=$2; shift 2 ;;
        --nproc-per-node=*) nproc=${1#*=}; shift ;;
        -h|--help) usage; exit 0 ;;
        *) break ;;
    esac
done
if [[ $# -eq 0 ]]; then
    usage >&2
    exit 2
fi
if [[ -z "$nproc" ]]; then
    nproc=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
    [[ "$nproc" -gt 0 ]] || nproc=2
fi
meshrl_torchrun_standalone "$nproc" "$@"
