#!/bin/bash
# One node's share of a multi-node torchrun job: run the same line on every node (by hand, pdsh, or an
# `srun --ntasks-per-node=1` step); torchrun's c10d rendezvous at --rdzv-endpoint assigns node ranks.
#
#   launch/torchrun_multi_node.sh --nnodes N --rdzv-endpoint HOST:PORT [--nproc-per-node P]
#                                 [--rdzv-id ID] SCRIPT.py|-m MODULE [args ...]
#
# What it is for: meshrl's trainer is a Ray single controller and is not launched by torchrun (use
# launch/slurm_ray.sbatch). torchrun runs the parallel layer's standalone jobs across nodes: a
# conversion too big for one node (-m meshrl.cli convert ... --tp T --pp P), or the network check
# launch/dist_check.py before a long run. HOST is one node's address reachable from all others;
# --rdzv-id (default: $SLURM_JOB_ID, else "meshrl") must be the same on every node of one job.
# P defaults to the number of visible GPUs (nvidia-smi), or 1 without one (gloo on CPU).
set -euo pipefail
# shellcheck source=launch/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

usage() { meshrl_usage "${BASH_SOURCE[0]}"; }
nnodes="" endpoint="" nproc="" rdzv_id="${SLURM_JOB_ID:-meshrl}"
while [[ $# -gt 0 ]]; do
    case "$1" in
        --nnodes) nnodes=$2; shift 2 ;;
        --nnodes=*) nnodes=${1#*=}; shift ;;
        --rdzv-endpoint) endpoint=$2; shift 2 ;;
        --rdzv-endpoint=*) endpoint=${1#*=}; shift ;;
        --nproc-per-node) nproc=$2; shift 2 ;;
        --nproc-per-node=*) nproc=${1#*=}; shift ;;
        --rdzv-id) rdzv_id=$2; shift 2 ;;
        --rdzv-id=*) rdzv_id=${1#*=}; shift ;;
        -h|--help) usage; exit 0 ;;
        *) break ;;
    esac
done
if [[ -z "$nnodes" || -z "$endpoint" || $# -eq 0 ]]; then
    echo "torchrun_multi_node: --nnodes, --rdzv-endpoint and a script are required" >&2
    usage >&2
    exit 2
fi
if [[ -z "$nproc" ]]; then
    nproc=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
    [[ "$nproc" -gt 0 ]] || nproc=1
fi
meshrl_torchrun "$nnodes" "$nproc" "$endpoint" "$rdzv_id" "$@"
