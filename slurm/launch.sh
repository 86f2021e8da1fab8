#!/usr/bin/env bash
# The launcher every slurm/run_*.sh uses, inside its sbatch allocation:
#
#   slurm/launch.sh <Hydra overrides of experiments/train.py, including gpus=N>
#
# It checks the job against its allocation (gpus a multiple of the GPUs per node, GPUS_PER_NODE
# matching the allocation and every node's GPUs), the overrides (on CPU nodes also the point's
# memory against the node's), and a results folder (and train.checkpoint_dir) every node sees:
# bad input is one line, status "invalid", exit 2, nothing started. Then it starts one torchrun
# per node through srun (slurm/node.sh; each rank under slurm/rank.sh), with c10d rendezvous at
# the first node's address as Slurm has it (NodeAddr: node names may resolve nowhere), running
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
# ZERO_REPRO_SLURM_RESULTS (default: results/slurm), ZERO_REPRO_RDZV_ADDR and ZERO_REPRO_RDZV_PORT
# (default: the first node's NodeAddr, and 10000 + job id % 20000).
#
# The body is one function, called on the last line: bash reads a script as it runs, so editing
# this file during a long job would otherwise change what the job runs next.
set -uo pipefail

main() {
if [ -z "${SLURM_JOB_ID:-}" ]; then
    echo "error: slurm/launch.sh runs inside a Slurm job: submit a script with sbatch, e.g. sbatch slurm/run_13b.sh" >&2
    exit 2
fi
REPO="${ZERO_REPRO_DIR:-${SLURM_SUBMIT_DIR:-$(pwd)}}"
PYTHON="${PYTHON:-$REPO/.venv/bin/python}"
COMMIT="$(git -C "$REPO" rev-parse HEAD 2>/dev/null)"  # the code the job ran, in job_status.json
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
PID=""  # the ranks' srun, once started
trap 'write_status timeout 143 "ended by Slurm (time limit or scancel)"; [ -z "$PID" ] || { kill -TERM "$PID" 2>/dev/null; wait "$PID"; }; finalize_pending; exit 143' TERM INT

GPUS=""
CHECKPOINT_DIR=""
for arg in "$@"; do
    case "$arg" in
        gpus=*) GPUS="${arg#gpus=}" ;;
        train.checkpoint_dir=*) CHECKPOINT_DIR="${arg#train.checkpoint_dir=}" ;;
    esac
done
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

# The port: below Linux's ephemeral range (32768-60999, where the OS hands out clients' ports)
# and distinct for up to 20000 consecutive jobs.
PORT="${ZERO_REPRO_RDZV_PORT:-$(( 10000 + SLURM_JOB_ID % 20000 ))}"
if ! [[ "$PORT" =~ ^[1-9][0-9]*$ ]] || (( PORT > 65535 )); then
    refuse "ZERO_REPRO_RDZV_PORT=$PORT is not a port (1-65535)"
fi

# The job's nodes by name. A failed expansion would leave the hostlist itself ("node[1-2]") as
# the first node's name, and torchrun a ValueError at its endpoint.
if ! NAMES="$(scontrol show hostnames "$SLURM_JOB_NODELIST" 2>&1)"; then
    refuse "scontrol show hostnames $SLURM_JOB_NODELIST failed: $(tail -n 1 <<< "$NAMES")"
fi
read -r -d '' -a NAMES <<< "$NAMES"
if (( ${#NAMES[@]} != SLURM_NNODES )); then
    refuse "scontrol show hostnames $SLURM_JOB_NODELIST gave ${#NAMES[@]} names for the job's $SLURM_NNODES nodes (SLURM_NNODES)"
fi
# The nodes this job uses: the first NODES, named to both sruns (run_60b_scaling.sh's elements
# hold more nodes than they use, and srun --nodes=N alone would choose its own N).
USED=("${NAMES[@]:0:$NODES}")
NODELIST="$(IFS=,; echo "${USED[*]}")"
JOB_NODES="${USED[*]}"
HEAD="${USED[0]}"

# Every node must see the records' folder (rank 0 writes the records, every rank its checkpoint
# shards) and train.checkpoint_dir when given: this node writes a marker in each, each node must
# read them. A fresh random name, so that no node holds a cached miss of it (NFS) nor an old
# job's; a few tries, for a file system slower to show it. The same step reports each node's GPUs
# (Slurm's count, else nvidia-smi's) and the batch node's address as srun's tasks saw it.
TOKEN="$(od -An -N8 -tx8 /dev/urandom | tr -d ' \n')"
MARKERS=("$JOB_DIR/.node_check.$TOKEN")
if [ -n "$CHECKPOINT_DIR" ]; then
    mkdir -p "$CHECKPOINT_DIR" && MARKERS+=("$CHECKPOINT_DIR/.node_check.$TOKEN")
fi
for marker in "${MARKERS[@]}"; do echo "$TOKEN" > "$marker"; done
CHECK_ERR="$JOB_DIR/.node_check.err"
SEEN="$(srun --overlap --nodelist="$NODELIST" --nodes="$NODES" --ntasks="$NODES" --ntasks-per-node=1 \
    --kill-on-bad-exit=0 bash -c '
    token="$1"; shift
    for marker in "$@"; do
        for try in 1 2 3 4 5 6 7 8 9 10; do grep -qsx "$token" "$marker" && continue 2; sleep 0.5; done
        echo "unseen $SLURMD_NODENAME $marker"; exit
    done
    echo "seen $SLURMD_NODENAME ${SLURM_GPUS_ON_NODE:-$(nvidia-smi -L 2>/dev/null | wc -l)} ${SLURM_LAUNCH_NODE_IPADDR:-}"' \
    _ "$TOKEN" "${MARKERS[@]}" 2>"$CHECK_ERR")"
cat "$CHECK_ERR" >&2  # srun's own warnings and errors, for the log
CHECK_WHY="$(tail -n 1 "$CHECK_ERR")"
rm -f "${MARKERS[@]}" "$CHECK_ERR"
for marker in "${MARKERS[@]}"; do
    UNSEEN="$(grep -F " $marker" <<< "$SEEN" | awk '$1 == "unseen" {print $2}' | sort -u | tr '\n' ' ')"
    [ -n "$UNSEEN" ] || continue
    if [ "$marker" = "${MARKERS[0]}" ]; then WHAT="results folder $JOB_DIR" FIX="ZERO_REPRO_SLURM_RESULTS"
    else WHAT="checkpoint folder $CHECKPOINT_DIR" FIX="train.checkpoint_dir"; fi
    refuse "the $WHAT is not shared: ${UNSEEN% } cannot read what $HEAD wrote there;\
 put it on a file system every node mounts ($FIX)"
done
# Fail closed: a node counts as checked only by its own "seen" line (an srun that failed prints none).
CHECKED="$(awk '$1 == "seen" {print $2}' <<< "$SEEN" | sort -u | wc -l)"
if (( CHECKED != NODES )); then
    refuse "the node check (srun on $NODELIST) heard from $CHECKED of $NODES nodes: ${CHECK_WHY:-no error}"
fi
# Every node's GPUs, not only this one's: a node with fewer would fail its ranks, one with more
# leave GPUs idle. Not for CPU jobs (--gpus-per-node=0, or no GPU on this node).
if [ "${SLURM_GPUS_PER_NODE:-}" != 0 ] && { (( ALLOCATED > 0 )) || nvidia-smi -L >/dev/null 2>&1; }; then
    OFF="$(awk -v n="$PER_NODE" '$1 == "seen" && $3 != n {printf "%s%s has %s", sep, $2, $3; sep = ", "}' <<< "$SEEN")"
    [ -z "$OFF" ] || refuse "$OFF GPUs, and the job runs $PER_NODE ranks on each node ($SOURCE)"
fi

# Each node's address as Slurm has it (NodeAddr): node names may resolve nowhere but in Slurm.
# Where scontrol cannot say, the batch node (this one) has the address srun's tasks saw it at.
LAUNCH_ADDR="$(awk '$1 == "seen" {print $4; exit}' <<< "$SEEN")"
[ "$HEAD" = "${SLURMD_NODENAME:-}" ] || LAUNCH_ADDR=""
mapfile -t NODE_ADDRS < <(SLURM_LAUNCH_NODE_IPADDR="$LAUNCH_ADDR" "$PYTHON" "$REPO/experiments/slurm_nodes.py" "${USED[@]}")
if (( ${#NODE_ADDRS[@]} != NODES )); then
    write_status fail 1 "experiments/slurm_nodes.py gave no address for the job's nodes (see the log)"
    echo "job $JOB: no addresses for the nodes, nothing started" >&2; exit 1
fi
export ZERO_REPRO_NODE_ADDRS="$(printf '%s\n' "${NODE_ADDRS[@]}" | cut -d' ' -f1,2 | tr ' ' '=' | tr '\n' ' ')"  # for slurm/node.sh
export ZERO_REPRO_RDZV_HEAD="$HEAD"  # the node that serves the rendezvous' store (slurm/node.sh)
read -r _ HEAD_ADDR HOW <<< "${NODE_ADDRS[0]}"

case "$HOW" in
    nodeaddr) WHERE="$HEAD's NodeAddr" ;;
    launch) WHERE="$HEAD's address as srun saw it: scontrol show node failed" ;;
    *) WHERE="$HEAD's name: Slurm gives it no NodeAddr" ;;
esac
if [ -n "${ZERO_REPRO_RDZV_ADDR:-}" ]; then HEAD_ADDR="$ZERO_REPRO_RDZV_ADDR" WHERE="ZERO_REPRO_RDZV_ADDR, on $HEAD"; fi
RDZV_HOST="$HEAD_ADDR"
if [[ "$RDZV_HOST" == *:* ]]; then RDZV_HOST="[$RDZV_HOST]"; fi  # an IPv6 address

# NCCL on DGX clusters: a failed or stuck collective aborts its communicator and raises in the
# rank (mode 2; mode 1 would kill the process before rank 0 records why, experiments/run/outcome.py),
# and errors are printed. Fabric-specific settings (NCCL_IB_HCA, NCCL_SOCKET_IFNAME, ...) come from
# the site's environment modules; set them before sbatch if your cluster documents them (the
# banner below prints NCCL_SOCKET_IFNAME).
export TORCH_NCCL_ASYNC_ERROR_HANDLING="${TORCH_NCCL_ASYNC_ERROR_HANDLING:-2}"
export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
export ZERO_REPRO_LAUNCHER="slurm"
if [ "${SLURM_RESTART_COUNT:-0}" -gt 0 ]; then
    set -- "$@" train.resume=true  # a requeued job continues from its latest checkpoint
    OVERRIDES=("$@")
fi

echo "job $JOB: $NODES node(s) x $PER_NODE ranks, rendezvous $RDZV_HOST:$PORT ($WHERE), records in $JOB_DIR"
echo "nodes: $NODELIST; NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-unset (NCCL chooses)}; commit ${COMMIT:-unknown}"
echo "overrides: $*"
write_status running - "started on $NODES node(s) x $PER_NODE"
# Since Slurm 22.05 srun no longer inherits sbatch's --cpus-per-task (only SRUN_CPUS_PER_TASK):
# without it each torchrun, its ranks and NCCL's proxy threads share one core. The one task per
# node gets the allocation's --cpus-per-task, else every CPU the job holds on the node (e.g.
# salloc --exclusive with no -c); with neither known, srun's default.
# --kill-on-bad-exit: a node whose torchrun fails (a rank died) ends the others' at once, rather
# than leaving them to wait in a collective until the job's time limit.
TASK_CPUS="${SLURM_CPUS_PER_TASK:-${SLURM_CPUS_ON_NODE:-}}"
srun --nodelist="$NODELIST" --nodes="$NODES" --ntasks="$NODES" --ntasks-per-node=1 --kill-on-bad-exit=1 \
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
    trap - TERM INT  # the requeue ends this script with TERM: the status is written first
    write_status timeout "$CODE" "checkpointed at Slurm's warning before the time limit; requeued to resume (restart $(( ${SLURM_RESTART_COUNT:-0} + 1 )))"
    echo "job $JOB: checkpointed before the time limit; requeueing"
    if ! WHY="$(scontrol requeue "$SLURM_JOB_ID" 2>&1)"; then
        WHY="checkpointed at Slurm's warning, but scontrol requeue failed ($(tail -n 1 <<< "$WHY")): resubmit with train.resume=true"
        write_status timeout "$CODE" "$WHY"
        echo "job $JOB: $WHY" >&2; exit "$CODE"
    fi
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
}

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
    JOB_NODES="$JOB_NODES" "$PYTHON" - "$JOB_DIR/job_status.json" "$1" "$2" "$3" "$JOB" "$LOG" "$COMMIT" "${OVERRIDES[@]}" <<'PY'
import json, os, sys, time
path, status, code, message, job, log, commit = sys.argv[1:8]
record = {"job": job, "status": status, "exit_code": None if code == "-" else int(code), "message": message,
          "log": log, "nodes": os.environ["JOB_NODES"].split(), "commit": commit or None, "overrides": sys.argv[8:],
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


main "$@"; exit
