#!/bin/bash
# Submit a training run to a running Ray cluster through its job server (the head's dashboard).
#
#   launch/ray_job_submit.sh [--address http://HEAD_IP:8265] [--no-wait] RECIPE [key=value ...]
#
# The cluster: heads started with MESHRL_RAY_DASHBOARD=1 meshrl_ray_head ... (launch/common.sh), or any
# Ray cluster whose nodes have meshrl installed at $MESHRL_ROOT. The driver runs on the head node;
# Ray gives it RAY_ADDRESS, so meshrl joins the cluster instead of starting one. The address defaults
# to $RAY_DASHBOARD_ADDRESS, else http://$(meshrl_node_ip):8265. MESHRL_*, NCCL_*, GLOO_* and HF_*
# variables of this shell are passed to the job. MESHRL_DRY_RUN=1 prints the command instead.
set -euo pipefail
# shellcheck source=launch/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

usage() { meshrl_usage "${BASH_SOURCE[0]}"; }
address="${RAY_DASHBOARD_ADDRESS:-}" wait_flag=()
while [[ $# -gt 0 ]]; do
    case "$1" in
        --address) address=$2; shift 2 ;;
        --address=*) address=${1#*=}; shift ;;
        --no-wait) wait_flag=(--no-wait); shift ;;
        -h|--help) usage; exit 0 ;;
        *) break ;;
    esac
done
if [[ $# -eq 0 ]]; then
    usage >&2
    exit 2
fi
[[ -n "$address" ]] || address="http://$(meshrl_node_ip):8265"
meshrl_launch_env
runtime_env=$("$MESHRL_PYTHON" -c '
import json, os
keep = ("MESHRL_", "NCCL_", "GLOO_", "HF_")
print(json.dumps({"env_vars": {k: v for k, v in os.environ.items() if k.startswith(keep)}}))')
command=("$MESHRL_PYTHON" -m ray.scripts.scripts job submit "--address=$address" "${wait_flag[@]}"
         --runtime-env-json "$runtime_env" --
         "$MESHRL_PYTHON" -m meshrl.trainer.main --config-name "$@")
if [[ "${MESHRL_DRY_RUN:-0}" == 1 ]]; then
    printf '%q ' "${command[@]}"
    echo
    exit 0
fi
cd "$MESHRL_ROOT"
exec "${command[@]}"
