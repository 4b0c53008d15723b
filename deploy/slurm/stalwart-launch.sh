#!/bin/bash
# stalwart under Slurm: run from a batch script (see stalwart.sbatch). One agent per node via
# srun; etcd and the daemon are the ones named, or started here, on the batch node.
#
#   stalwart-launch.sh            the whole job (in the batch script)
#   stalwart-launch.sh agent      one node's agent (what srun runs on each node)
#
# Settings (environment):
#   STALWART_JOB          the job's name in etcd (default: slurm-$SLURM_JOB_ID; keep it across a
#                         requeue so the job resumes from its checkpoints)
#   STALWART_COMMAND      what each worker runs (a shell command line)
#   STALWART_LAST_STEP    the job's last step: done once a checkpoint of it commits
#   STALWART_WORKERS      workers per node (default: $SLURM_GPUS_ON_NODE, else 1)
#   STALWART_ETCD         etcd endpoints (HOST:PORT,...); empty: start etcd on the batch node
#   STALWART_ETCD_PORT    its client port (default 2379; the peer port is the next one)
#   STALWART_DAEMON       "job" (default): start two daemons here; "external": one runs elsewhere
#   STALWART_MIN_NODES    fewest nodes the world may have (default: all of the allocation)
#   STALWART_MAX_NODES    most nodes (default: the allocation; more leaves room for expansion)
#   STALWART_FORM_TIMEOUT seconds without a world before the job ends (default 600)
#   STALWART_REQUEUE      1: when the world can no longer be formed, requeue the job (Slurm
#                         schedules it again, without the drained nodes; it resumes)
#   STALWART_DRAIN        1 (default): quarantined nodes are drained in Slurm with the reason
#   STALWART_LISTEN       the agents' gRPC address (default 0.0.0.0:7077)
#   STALWART_STATE_DIR    per-node state (default /tmp/stalwart-$SLURM_JOB_ID)
#   STALWART_AGENT_EXTRA, STALWART_POLICY_EXTRA   more TOML lines for agent.toml and [policy]
#   STALWART              the stalwart program (default: stalwart on PATH)
set -euo pipefail

STALWART=${STALWART:-stalwart}
JOB=${STALWART_JOB:-slurm-${SLURM_JOB_ID:?not inside a Slurm job}}
STATE=${STALWART_STATE_DIR:-/tmp/stalwart-$SLURM_JOB_ID}

agent() {
    local node=${SLURMD_NODENAME:?not inside a Slurm step}
    local dir="$STATE/$node"
    mkdir -p "$dir" && chmod 700 "$dir"
    local workers=${STALWART_WORKERS:-${SLURM_GPUS_ON_NODE:-1}}
    local command=${STALWART_COMMAND:?STALWART_COMMAND is required}
    command=${command//\\/\\\\}
    command=${command//\"/\\\"}
    cat > "$dir/agent.toml" <<TOML
job = "$JOB"
node_id = "$node"
command = ["/bin/bash", "-c", "$command"]
workers = $workers
listen = "${STALWART_LISTEN:-0.0.0.0:7077}"
insecure = true
state_dir = "$dir"
${STALWART_AGENT_EXTRA:-}
[etcd]
endpoints = [$(sed 's/[^,][^,]*/"&"/g' <<< "$STALWART_ETCD")]
TOML
    exec "$STALWART" --log-level info agent --config "$dir/agent.toml"
}

if [[ "${1:-}" == agent ]]; then
    agent
fi

: "${STALWART_COMMAND:?STALWART_COMMAND is required}"
: "${STALWART_LAST_STEP:?STALWART_LAST_STEP is required}"
mkdir -p "$STATE" && chmod 700 "$STATE"
host=$(hostname)
pids=()
cleanup() {
    for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
    wait 2>/dev/null || true
}
trap cleanup EXIT

if [[ -z "${STALWART_ETCD:-}" ]]; then
    port=${STALWART_ETCD_PORT:-2379}
    etcd --name stalwart --data-dir "$STATE/etcd" --listen-client-urls "http://0.0.0.0:$port" \
        --advertise-client-urls "http://$host:$port" --listen-peer-urls "http://127.0.0.1:$((port + 1))" \
        --initial-advertise-peer-urls "http://127.0.0.1:$((port + 1))" \
        --initial-cluster "stalwart=http://127.0.0.1:$((port + 1))" > "$STATE/etcd.log" 2>&1 &
    pids+=($!)
    STALWART_ETCD="$host:$port"
fi
export STALWART_ETCD

if [[ "${STALWART_DAEMON:-job}" == job ]]; then
    nodes=${SLURM_JOB_NUM_NODES:-1}
    hook=""
    if [[ "${STALWART_DRAIN:-1}" == 1 ]]; then
        hook='on_quarantine = ["scontrol", "update", "nodename={node}", "state=drain", "reason={reason}"]'
    fi
    cat > "$STATE/daemon.toml" <<TOML
[daemon]
job = "$JOB"
metrics_port = 0
$hook
[etcd]
endpoints = [$(sed 's/[^,][^,]*/"&"/g' <<< "$STALWART_ETCD")]
[policy]
min_nodes = ${STALWART_MIN_NODES:-$nodes}
max_nodes = ${STALWART_MAX_NODES:-$nodes}
${STALWART_POLICY_EXTRA:-}
TOML
    for i in 1 2; do  # a leader and a standby
        "$STALWART" --log-level info daemon --config "$STATE/daemon.toml" --daemon-id "$host-$i" \
            > "$STATE/daemon-$i.log" 2>&1 &
        pids+=($!)
    done
fi

# One agent per node; a node whose agent dies does not end the step (--kill-on-bad-exit=0).
srun --ntasks-per-node=1 --kill-on-bad-exit=0 --label "$0" agent > "$STATE/agents.log" 2>&1 &
pids+=($!)

rc=0
"$STALWART" slurm wait --endpoints "$STALWART_ETCD" --job "$JOB" --until-step "$STALWART_LAST_STEP" \
    --form-timeout "${STALWART_FORM_TIMEOUT:-600}" || rc=$?
case $rc in
    0) echo "stalwart: job $JOB finished: training reached step $STALWART_LAST_STEP" ;;
    3) echo "stalwart: job $JOB: the world can no longer be formed"
       if [[ "${STALWART_REQUEUE:-0}" == 1 ]]; then
           echo "stalwart: requeueing Slurm job $SLURM_JOB_ID (drained nodes stay out)"
           scontrol requeue "$SLURM_JOB_ID"
       fi ;;
    4) echo "stalwart: job $JOB gave up (training diverged)" ;;
    *) echo "stalwart: job $JOB: stalwart slurm wait exited $rc" ;;
esac
exit $rc
