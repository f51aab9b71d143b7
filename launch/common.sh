# shellcheck shell=bash
# Functions shared by every launcher in launch/, the Slurm template and tests/launch, which runs them
# on loopback addresses: what the tests exercise is what a cluster runs. Source this file; it only
# defines functions and fills unset variables.
#
#   MESHRL_ROOT     the meshrl checkout (default: this file's parent folder)
#   MESHRL_PYTHON   the Python that has meshrl installed (default: $MESHRL_ROOT/.venv/bin/python, else python3)
#   MESHRL_NODE_IP  this node's address for Ray and torch.distributed (default: first of `hostname -I`)
#   RAY_TMPDIR      Ray's session folder; keep it node-local and short (Unix socket paths are <108 chars)
# See launch/README.md for every knob.

: "${MESHRL_ROOT:=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}"
if [[ -z "${MESHRL_PYTHON:-}" ]]; then
    if [[ -x "$MESHRL_ROOT/.venv/bin/python" ]]; then
        MESHRL_PYTHON="$MESHRL_ROOT/.venv/bin/python"
    else
        MESHRL_PYTHON=python3
    fi
fi
export MESHRL_ROOT MESHRL_PYTHON

# meshrl_usage FILE: print FILE's header comment (the lines after the shebang up to the first
# non-comment line) as the launcher's help.
meshrl_usage() {
    awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$1"
}

# Environment every meshrl process of a multi-node run shares. Fills what the user left unset, except
# RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER: meshrl.runtime sets it to 0 to keep a single machine on loopback,
# and a value inherited from a meshrl process would make worker nodes refuse to join; a launched
# cluster is multi-node by definition (1 is also Ray's own default on Linux).
meshrl_launch_env() {
    export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=1
    # Ray's token auth would write a token into $HOME and make every node need it; clusters run Ray on
    # a private network instead (see README: keep Ray's ports unreachable from outside).
    export RAY_AUTH_MODE="${RAY_AUTH_MODE:-disabled}"
    export RAY_USAGE_STATS_ENABLED="${RAY_USAGE_STATS_ENABLED:-0}"
    export RAY_TMPDIR="${RAY_TMPDIR:-/tmp/ray-$(id -u)}"
    # Workers resolve their Python path from the driver's; the repo must be importable on every node.
    export PYTHONPATH="$MESHRL_ROOT${PYTHONPATH:+:$PYTHONPATH}"
    mkdir -p "$RAY_TMPDIR"
}

# This node's address: MESHRL_NODE_IP, or the first address `hostname -I` lists (not the loopback
# address that `hostname -i` gives on many distributions).
meshrl_node_ip() {
    if [[ -n "${MESHRL_NODE_IP:-}" ]]; then
        echo "$MESHRL_NODE_IP"
        return
    fi
    local ips
    read -r -a ips <<<"$(hostname -I)"
    if [[ ${#ips[@]} -eq 0 ]]; then
        echo "meshrl_node_ip: hostname -I lists no address; set MESHRL_NODE_IP" >&2
        return 1
    fi
    echo "${ips[0]}"
}

# Arguments both kinds of Ray node take: CPUS and GPUS logical resources ("" = let Ray detect them).
_meshrl_ray_resources() {
    local cpus=$1 gpus=$2 args=()
    [[ -n "$cpus" ]] && args+=("--num-cpus=$cpus")
    [[ -n "$gpus" ]] && args+=("--num-gpus=$gpus")
    [[ -n "${MESHRL_RAY_OBJECT_STORE_BYTES:-}" ]] && args+=("--object-store-memory=$MESHRL_RAY_OBJECT_STORE_BYTES")
    echo "${args[@]}"
}

# meshrl_ray_head IP PORT [CPUS] [GPUS]: run the Ray head in the foreground (--block) until signalled;
# SIGTERM to this process stops every Ray process it started. MESHRL_RAY_DASHBOARD=1 adds the
# dashboard (needed by `ray job submit`) on IP:${MESHRL_RAY_DASHBOARD_PORT:-8265}.
meshrl_ray_head() {
    local ip=$1 port=$2 dashboard=(--include-dashboard=false)
    meshrl_launch_env
    if [[ "${MESHRL_RAY_DASHBOARD:-0}" == 1 ]]; then
        dashboard=(--include-dashboard=true "--dashboard-host=$ip"
                   "--dashboard-port=${MESHRL_RAY_DASHBOARD_PORT:-8265}")
    fi
    # shellcheck disable=SC2046
    exec "$MESHRL_PYTHON" -m ray.scripts.scripts start --head "--node-ip-address=$ip" "--port=$port" \
        "${dashboard[@]}" "--temp-dir=$RAY_TMPDIR" $(_meshrl_ray_resources "${3:-}" "${4:-}") --block
}

# meshrl_ray_worker HEAD_ADDRESS IP [CPUS] [GPUS]: run a Ray worker node in the foreground (--block).
meshrl_ray_worker() {
    local head=$1 ip=$2
    meshrl_launch_env
    # shellcheck disable=SC2046
    exec "$MESHRL_PYTHON" -m ray.scripts.scripts start "--address=$head" "--node-ip-address=$ip" \
        $(_meshrl_ray_resources "${3:-}" "${4:-}") --block
}

# meshrl_wait_for_ray ADDRESS NODES TIMEOUT_S: return once NODES nodes are alive; fail after TIMEOUT_S.
meshrl_wait_for_ray() {
    meshrl_launch_env
    "$MESHRL_PYTHON" "$MESHRL_ROOT/launch/ray_wait.py" --address "$1" --nodes "$2" --timeout "$3"
}

# meshrl_run_driver RECIPE [key=value ...]: the single-controller trainer, joining the cluster that
# RAY_ADDRESS names. Returns the trainer's exit status.
meshrl_run_driver() {
    if [[ -z "${RAY_ADDRESS:-}" ]]; then
        echo "meshrl_run_driver: RAY_ADDRESS is not set; start the cluster first" >&2
        return 2
    fi
    meshrl_launch_env
    local recipe=$1
    shift
    "$MESHRL_PYTHON" -m meshrl.trainer.main --config-name "$recipe" "$@"
}

# meshrl_torchrun NNODES NPROC_PER_NODE RDZV_ENDPOINT RDZV_ID SCRIPT|-m MODULE [args ...]: one node's
# torchrun of a multi-node job (run the same line on every node; c10d rendezvous at RDZV_ENDPOINT).
meshrl_torchrun() {
    local nnodes=$1 nproc=$2 endpoint=$3 rdzv_id=$4
    shift 4
    export PYTHONPATH="$MESHRL_ROOT${PYTHONPATH:+:$PYTHONPATH}"
    "$MESHRL_PYTHON" -m torch.distributed.run "--nnodes=$nnodes" "--nproc-per-node=$nproc" \
        --rdzv-backend=c10d "--rdzv-endpoint=$endpoint" "--rdzv-id=$rdzv_id" "$@"
}

# meshrl_torchrun_standalone NPROC SCRIPT|-m MODULE [args ...]: torchrun on this node only.
meshrl_torchrun_standalone() {
    local nproc=$1
    shift
    export PYTHONPATH="$MESHRL_ROOT${PYTHONPATH:+:$PYTHONPATH}"
    "$MESHRL_PYTHON" -m torch.distributed.run --standalone "--nproc-per-node=$nproc" "$@"
}
