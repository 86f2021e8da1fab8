#!/usr/bin/env bash
# The launcher every slurm/run_*.sh uses, inside its sbatch allocation:
#
#   slurm/launch.sh <Hydra overrides of experiments/train.py, including gpus=N>
#
# It checks the overrides (a bad one: status "invalid", exit 2, nothing started), then starts one
# torchrun per node through srun, with c10d rendezvous on the allocation's first node, running
# experiments/train.py on gpus/nodes ranks per node. Records land in a folder of this job,
# results/slurm/<job id>/, beside job_status.json, which is written however the job ends (ok,
# invalid, fail, or timeout when Slurm ends the job at its time limit).
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

REPO="${ZERO_REPRO_DIR:-${SLURM_SUBMIT_DIR:-$(pwd)}}"
PYTHON="${PYTHON:-$REPO/.venv/bin/python}"
: "${SLURM_JOB_ID:?run this inside a Slurm allocation (sbatch slurm/run_<...>.sh)}"
JOB="$SLURM_JOB_ID"
if [ -n "${SLURM_ARRAY_TASK_ID:-}" ]; then JOB="${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}"; fi
JOB_DIR="${ZERO_REPRO_SLURM_RESULTS:-$REPO/results/slurm}/$JOB"
mkdir -p "$JOB_DIR"
# Slurm's warning may come at any time (it checks every 30 s or so, and may signal up to that much
# earlier than asked): trap it first thing. The ranks poll this file after every step.
export ZERO_REPRO_STOP_FILE="$JOB_DIR/stop_requested"
rm -f "$ZERO_REPRO_STOP_FILE" "$ZERO_REPRO_STOP_FILE.saved"
trap 'echo "job $JOB: USR1, the time limit is near: the ranks checkpoint and stop"; touch "$ZERO_REPRO_STOP_FILE"' USR1
LOG="$(scontrol show job "$SLURM_JOB_ID" 2>/dev/null | sed -n 's/^ *StdOut=//p' | head -n 1)"

OVERRIDES=("$@")

finalize_pending() {  # records rank 0 kept ready (experiments/train.py PendingTimeout); never over an ok one
    find "$JOB_DIR" -name '*.json.pending' 2>/dev/null | while read -r pending; do
        if grep -qs '"status": "ok"' "${pending%.pending}"; then rm -f "$pending"; else mv -f "$pending" "${pending%.pending}"; fi
    done
}

write_status() {  # status exit_code message
    "$PYTHON" - "$JOB_DIR/job_status.json" "$1" "$2" "$3" "$JOB" "$LOG" "${OVERRIDES[@]}" <<'PY'
import json, os, sys, time
path, status, code, message, job, log = sys.argv[1:7]
record = {"job": job, "status": status, "exit_code": None if code == "-" else int(code), "message": message,
          "log": log, "nodes": os.environ.get("SLURM_JOB_NODELIST"), "overrides": sys.argv[7:],
          "updated": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
tmp = path + ".tmp"
with open(tmp, "w") as f:
    json.dump(record, f, indent=1)
os.replace(tmp, path)
PY
}

GPUS=""
for arg in "$@"; do case "$arg" in gpus=*) GPUS="${arg#gpus=}" ;; esac; done
if [ -z "$GPUS" ]; then
    write_status invalid 2 "launch.sh needs a gpus=N override"; echo "error: launch.sh needs a gpus=N override" >&2; exit 2
fi
if ! ZERO_REPRO_CHECK_ONLY=1 "$PYTHON" "$REPO/experiments/train.py" "$@"; then
    write_status invalid 2 "the overrides were rejected (see the log)"
    echo "job $JOB: invalid overrides, nothing started" >&2; exit 2
fi
PER_NODE="${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-$(( (GPUS + SLURM_NNODES - 1) / SLURM_NNODES ))}}"
NODES=$(( (GPUS + PER_NODE - 1) / PER_NODE ))
if (( NODES * PER_NODE != GPUS || NODES > SLURM_NNODES )); then
    msg="gpus=$GPUS does not fit $SLURM_NNODES node(s) x $PER_NODE GPUs"
    write_status invalid 2 "$msg"; echo "error: $msg" >&2; exit 2
fi
HEAD="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"
PORT=$(( 20000 + SLURM_JOB_ID % 20000 ))

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
echo "job $JOB: $NODES node(s) x $PER_NODE ranks, rendezvous $HEAD:$PORT, records in $JOB_DIR"
echo "overrides: $*"
write_status running - "started on $NODES node(s) x $PER_NODE"
# Since Slurm 22.05 srun no longer inherits sbatch's --cpus-per-task (only SRUN_CPUS_PER_TASK):
# without it each torchrun, its ranks and NCCL's proxy threads share one core. The one task per
# node gets the allocation's --cpus-per-task, else every CPU the job holds on the node (e.g.
# salloc --exclusive with no -c); with neither known, srun's default.
TASK_CPUS="${SLURM_CPUS_PER_TASK:-${SLURM_CPUS_ON_NODE:-}}"
srun --nodes="$NODES" --ntasks="$NODES" --ntasks-per-node=1 --kill-on-bad-exit=1 \
    ${TASK_CPUS:+"--cpus-per-task=$TASK_CPUS"} \
    "$PYTHON" -m torch.distributed.run --nnodes="$NODES" --nproc-per-node="$PER_NODE" \
    --rdzv-backend=c10d --rdzv-endpoint="$HEAD:$PORT" --rdzv-id="$JOB" \
    "$REPO/experiments/train.py" "results_dir=$JOB_DIR" "$@" &
PID=$!
while true; do  # a trapped USR1 interrupts `wait`: wait again until the ranks have exited
    wait "$PID"
    CODE=$?
    kill -0 "$PID" 2>/dev/null || break
done
finalize_pending
if [ -e "$ZERO_REPRO_STOP_FILE.saved" ] && [ "$CODE" -ne 0 ]; then  # rank 0 saved and recorded at our request
    trap - TERM INT
    write_status timeout "$CODE" "checkpointed at Slurm's warning before the time limit; requeued to resume (restart $(( ${SLURM_RESTART_COUNT:-0} + 1 )))"
    echo "job $JOB: checkpointed before the time limit; requeueing"
    scontrol requeue "$SLURM_JOB_ID"
    exit 0
fi
if [ "$CODE" -eq 0 ]; then
    write_status ok 0 "records in $JOB_DIR"
else
    write_status fail "$CODE" "a rank failed; its record (if it got that far) and the log say why"
fi
echo "job $JOB: $(sed -n 's/.*"status": "\(.*\)".*/\1/p' "$JOB_DIR/job_status.json"), exit code $CODE"
exit "$CODE"
