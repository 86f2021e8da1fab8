#!/usr/bin/env bash
# The launcher every slurm/run_*.sh uses, inside its sbatch allocation:
#
#   slurm/launch.sh <Hydra overrides of experiments/train.py, including gpus=N>
#
# It checks the job against its allocation (gpus a multiple of the GPUs per node, GPUS_PER_NODE
# matching the allocation), the overrides (on CPU nodes also the point's memory against the
# node's), and a results folder every node sees: bad input is one line, status "invalid", exit 2,
# nothing started. Then it starts one torchrun per node
# through srun (slurm/node.sh; each rank under slurm/rank.sh), with c10d rendezvous at the first
# node's address as Slurm has it (NodeAddr: node names may resolve nowhere), running
# experiments/train.py on gpus/nodes ranks per node. Records land in a folder of this job,
# results/slurm/<job id>/, beside job_status.json, which is written however the job ends (ok,
# invalid, fail, or timeout when Slurm ends the job at its time limit). A rank that dies of a
# signal ends the job at once (srun --kill-on-bad-exit); its record then names the rank and node.
#
# Time limits: the run_*.sh scripts ask Slurm for USR1 shortly before the limit (#SBATCH
# --signal=B:USR1@<s>) and for --requeue. On USR1 this script creates $ZERO_REPRO_STOP_FILE; the
# ranks see it after their current step, save a checkpoint (zero_impl.checkpoint), write the
# point's record as "timeout" with the step reached and the checkpoint, and exit; the job then
# requeues itself, and the next run (SLURM_RESTART_COUNT > 0) resumes from that checkpoint
# (train.resume=true). If the job is killed without warning, the trap on TERM turns the record
# rank 0 keeps ready (<record>.pending: status timeout, last step, last checkpoint) into the record.
#
# Environment: ZERO_REPRO_DIR (default: the sbatch submission directory), PYTHON (default: the
# repository's .venv), GPUS_PER_NODE (default: Slurm's SLURM_GPUS_ON_NODE, else gpus / nodes),
# ZERO_REPRO_SLURM_RESULTS (default: results/slurm).
set -uo pipefail

if [ -z "${SLURM_JOB_ID:-}" ]; then
    echo "error: slurm/launch.sh runs inside a Slurm job: submit a script with sbatch, e.g. sbatch slurm/run_13b.sh" >&2
    exit 2
fi
REPO="${ZERO_REPRO_DIR:-${SLURM_SUBMIT_DIR:-$(pwd)}}"
PYTHON="${PYTHON:-$REPO/.venv/bin/python}"
JOB="$SLURM_JOB_ID"
if [ -n "${SLURM_ARRAY_TASK_ID:-}" ]; then JOB="${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}"; fi
JOB_DIR="${ZERO_REPRO_SLURM_RESULTS:-$REPO/results/slurm}/$JOB"
mkdir -p "$JOB_DIR"
# Slurm's warning may come at any time (it checks every 30 s or so, and may signal up to that much
# earlier than asked): trap it first thing. The ranks poll this file after every step.
export ZERO_REPRO_STOP_FILE="$JOB_DIR/stop_requested"
# slurm/rank.sh names the first rank that dies of a signal here (a rank killed outright records nothing)
export ZERO_REPRO_RANK_DIED="$JOB_DIR/rank_died"
rm -f "$ZERO_REPRO_STOP_FILE" "$ZERO_REPRO_STOP_FILE.saved" "$ZERO_REPRO_RANK_DIED"
trap 'echo "job $JOB: USR1, the time limit is near: the ranks checkpoint and stop"; touch "$ZERO_REPRO_STOP_FILE"' USR1
LOG="$(scontrol show job "$SLURM_JOB_ID" 2>/dev/null | sed -n 's/^ *StdOut=//p' | head -n 1)"

OVERRIDES=("$@")
JOB_NODES="${SLURM_JOB_NODELIST:-}"  # the nodes the job runs on, once known (job_status.json)

finalize_pending() {  # [status message]: records rank 0 kept ready (experiments/train.py PendingTimeout)
    # become the records, never over an ok one; with a status, as that status, the message first
    find "$JOB_DIR" -name '*.json.pending' 2>/dev/null | while read -r pending; do
        if grep -qs '"status": "ok"' "${pending%.pending}"; then
            rm -f "$pending"
        elif [ $# -eq 0 ]; then
            mv -f "$pending" "${pending%.pending}"
        else
            "$PYTHON" - "$pending" "$1" "$2" <<'PY'
import json, os, sys
pending, status, message = sys.argv[1:4]
with open(pending) as f:
    record = json.load(f)
resume = record.get("resume") or {}
record["status"] = status
record["error"] = f"{message} after step {resume.get('last_step')}" + (
    f"; resume from {resume['checkpoint']} with train.resume=true" if resume.get("checkpoint") else "")
with open(pending, "w") as f:
    json.dump(record, f, indent=1)
os.replace(pending, pending[:-len(".pending")])
PY
        fi
    done
}

write_status() {  # status exit_code message
    JOB_NODES="$JOB_NODES" "$PYTHON" - "$JOB_DIR/job_status.json" "$1" "$2" "$3" "$JOB" "$LOG" "${OVERRIDES[@]}" <<'PY'
import json, os, sys, time
path, status, code, message, job, log = sys.argv[1:7]
record = {"job": job, "status": status, "exit_code": None if code == "-" else int(code), "message": message,
          "log": log, "nodes": os.environ["JOB_NODES"].split(), "overrides": sys.argv[7:],
          "updated": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
tmp = path + ".tmp"
with open(tmp, "w") as f:
    json.dump(record, f, indent=1)
os.replace(tmp, path)
PY
}

refuse() {  # message: the job's input is wrong; nothing has started (status invalid, exit code 2)
    write_status invalid 2 "$1"
    echo "error: $1" >&2
    exit 2
}

GPUS=""
for arg in "$@"; do case "$arg" in gpus=*) GPUS="${arg#gpus=}" ;; esac; done
[ -n "$GPUS" ] || refuse "launch.sh needs a gpus=N override"
[[ "$GPUS" =~ ^[1-9][0-9]*$ ]] || refuse "gpus=$GPUS is not a positive whole number"

# Ranks per node: GPUS_PER_NODE, else the GPUs Slurm gave each node, else gpus spread over the nodes.
ALLOCATED="${SLURM_GPUS_ON_NODE:-0}"
[[ "$ALLOCATED" =~ ^[0-9]+$ ]] || ALLOCATED=0
if [ -n "${GPUS_PER_NODE:-}" ]; then
    [[ "$GPUS_PER_NODE" =~ ^[1-9][0-9]*$ ]] || refuse "GPUS_PER_NODE=$GPUS_PER_NODE is not a positive whole number"
    if (( ALLOCATED > 0 && GPUS_PER_NODE != ALLOCATED )); then
        refuse "GPUS_PER_NODE=$GPUS_PER_NODE does not match the allocation's $ALLOCATED GPUs per node (SLURM_GPUS_ON_NODE)"
    fi
    PER_NODE="$GPUS_PER_NODE" SOURCE="GPUS_PER_NODE"
elif (( ALLOCATED > 0 )); then
    PER_NODE="$ALLOCATED" SOURCE="the allocation's"
else
    PER_NODE=$(( (GPUS + SLURM_NNODES - 1) / SLURM_NNODES )) SOURCE="gpus over the job's $SLURM_NNODES node(s)"
fi
if (( GPUS % PER_NODE != 0 )); then
    refuse "gpus=$GPUS is not a multiple of the $PER_NODE GPUs per node ($SOURCE): every node runs as many ranks"
fi
NODES=$(( GPUS / PER_NODE ))
if (( NODES > SLURM_NNODES )); then
    refuse "gpus=$GPUS needs $NODES nodes of $PER_NODE GPUs ($SOURCE) and the job has $SLURM_NNODES"
fi
# The overrides, and on CPU nodes the point's memory against this node's for PER_NODE ranks
# (experiments/train.py): its plan goes to the log, its one-line refusal into job_status.json too.
if ! { CHECK="$(ZERO_REPRO_CHECK_ONLY=1 LOCAL_WORLD_SIZE="$PER_NODE" "$PYTHON" "$REPO/experiments/train.py" "$@" 2>&1 >&3)"; } 3>&1; then
    echo "$CHECK" >&2
    REFUSAL="$(printf '%s\n' "$CHECK" | sed -n 's/^error: //p' | tail -n 1)"
    write_status invalid 2 "${REFUSAL:-the overrides were rejected (see the log)}"
    echo "job $JOB: invalid overrides, nothing started" >&2; exit 2
fi
[ -z "$CHECK" ] || echo "$CHECK" >&2

# The nodes this job runs on and their addresses as Slurm has them (NodeAddr; the name where it
# has none): node names may resolve nowhere but in Slurm.
mapfile -t NODE_ADDRS < <("$PYTHON" "$REPO/experiments/slurm_nodes.py" "$SLURM_JOB_NODELIST" | head -n "$NODES")
JOB_NODES="${NODE_ADDRS[*]%% *}"
export ZERO_REPRO_NODE_ADDRS="$(printf '%s\n' "${NODE_ADDRS[@]}" | tr ' ' '=' | tr '\n' ' ')"  # for slurm/node.sh
read -r HEAD HEAD_ADDR <<< "${NODE_ADDRS[0]}"
export ZERO_REPRO_RDZV_HEAD="$HEAD"  # the node that serves the rendezvous' store (slurm/node.sh)

# Every node must see the records' folder (rank 0 writes the records, every rank its checkpoint
# shards): this node writes a marker there, each node must read it. A fresh name per run, so that
# no node holds a cached miss of it (NFS); a few tries, for a file system slower to show it.
MARKER="$JOB_DIR/.node_check.${SLURM_RESTART_COUNT:-0}"
echo "$JOB" > "$MARKER"
UNSEEN="$(srun --nodes="$NODES" --ntasks="$NODES" --ntasks-per-node=1 --kill-on-bad-exit=0 bash -c \
    'for try in 1 2 3 4 5 6 7 8 9 10; do grep -qsx "$1" "$2" && exit; sleep 0.5; done; echo "$SLURMD_NODENAME"' \
    _ "$JOB" "$MARKER" | sort | tr '\n' ' ')"
rm -f "$MARKER"
if [ -n "${UNSEEN// /}" ]; then
    refuse "the results folder $JOB_DIR is not shared: ${UNSEEN% } cannot read what $HEAD wrote there;\
 put it on a file system every node mounts (ZERO_REPRO_SLURM_RESULTS)"
fi

PORT=$(( 20000 + SLURM_JOB_ID % 20000 ))
RDZV_HOST="$HEAD_ADDR"
if [[ "$RDZV_HOST" == *:* ]]; then RDZV_HOST="[$RDZV_HOST]"; fi  # an IPv6 NodeAddr
if [ "$HEAD_ADDR" = "$HEAD" ]; then WHERE="$HEAD's name: Slurm gives it no NodeAddr"; else WHERE="$HEAD's NodeAddr"; fi

# NCCL on DGX clusters: a failed or stuck collective aborts its communicator and raises in the
# rank (mode 2; mode 1 would kill the process before rank 0 records why, experiments/run/outcome.py),
# and errors are printed. Fabric-specific settings (NCCL_IB_HCA, NCCL_SOCKET_IFNAME, ...) come from
# the site's environment modules; set them before sbatch if your cluster documents them.
export TORCH_NCCL_ASYNC_ERROR_HANDLING="${TORCH_NCCL_ASYNC_ERROR_HANDLING:-2}"
export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
export ZERO_REPRO_LAUNCHER="slurm"
if [ "${SLURM_RESTART_COUNT:-0}" -gt 0 ]; then
    set -- "$@" train.resume=true  # a requeued job continues from its latest checkpoint
    OVERRIDES=("$@")
fi

trap 'write_status timeout 143 "ended by Slurm (time limit or scancel)"; kill -TERM "$PID" 2>/dev/null; wait "$PID"; finalize_pending; exit 143' TERM INT
echo "job $JOB: $NODES node(s) x $PER_NODE ranks, rendezvous $RDZV_HOST:$PORT ($WHERE), records in $JOB_DIR"
echo "overrides: $*"
write_status running - "started on $NODES node(s) x $PER_NODE"
# Since Slurm 22.05 srun no longer inherits sbatch's --cpus-per-task (only SRUN_CPUS_PER_TASK):
# without it each torchrun, its ranks and NCCL's proxy threads share one core. The one task per
# node gets the allocation's --cpus-per-task, else every CPU the job holds on the node (e.g.
# salloc --exclusive with no -c); with neither known, srun's default.
# --kill-on-bad-exit: a node whose torchrun fails (a rank died) ends the others' at once, rather
# than leaving them to wait in a collective until the job's time limit.
TASK_CPUS="${SLURM_CPUS_PER_TASK:-${SLURM_CPUS_ON_NODE:-}}"
srun --nodes="$NODES" --ntasks="$NODES" --ntasks-per-node=1 --kill-on-bad-exit=1 \
    ${TASK_CPUS:+"--cpus-per-task=$TASK_CPUS"} \
    "$REPO/slurm/node.sh" "$PYTHON" -m torch.distributed.run --nnodes="$NODES" --nproc-per-node="$PER_NODE" \
    --rdzv-backend=c10d --rdzv-endpoint="$RDZV_HOST:$PORT" --rdzv-id="$JOB" \
    --no-python "$REPO/slurm/rank.sh" "$PYTHON" "$REPO/experiments/train.py" "results_dir=$JOB_DIR" "$@" &
PID=$!
while true; do  # a trapped USR1 interrupts `wait`: wait again until the ranks have exited
    wait "$PID"
    CODE=$?
    kill -0 "$PID" 2>/dev/null || break
done
if [ -e "$ZERO_REPRO_STOP_FILE.saved" ] && [ "$CODE" -ne 0 ]; then  # rank 0 saved and recorded at our request
    finalize_pending
    trap - TERM INT
    write_status timeout "$CODE" "checkpointed at Slurm's warning before the time limit; requeued to resume (restart $(( ${SLURM_RESTART_COUNT:-0} + 1 )))"
    echo "job $JOB: checkpointed before the time limit; requeueing"
    scontrol requeue "$SLURM_JOB_ID"
    exit 0
fi
if [ "$CODE" -eq 0 ]; then
    finalize_pending
    write_status ok 0 "records in $JOB_DIR"
else
    # A rank that raised has its traceback in rank 0's record; one killed outright (SIGKILL, the
    # OOM killer, a segfault) took its node's torchrun down, and srun the other nodes' with rank
    # 0 before it could record anything: its record then says which rank died, and where.
    WHY="$(cat "$ZERO_REPRO_RANK_DIED" 2>/dev/null)"
    WHY="${WHY:-the ranks exited with code $CODE}"
    finalize_pending fail "$WHY"
    write_status fail "$CODE" "$WHY; the point's record and the log say more"
fi
echo "job $JOB: $(sed -n 's/.*"status": "\(.*\)".*/\1/p' "$JOB_DIR/job_status.json"), exit code $CODE"
exit "$CODE"
